// Disaggregated prefill/decode in one process over the peer-copy KV handoff
// (kv_transfer.path: peer; worker/kv_peer_exchange.h): the prefill ranks post where their blocks
// are and the decode ranks copy them pool to pool through PeerCopy (the CPU backend's memcpy here;
// cudaMemcpyPeerAsync between GPUs). Greedy outputs equal the colocated tp 1 output for every tp
// pairing (re-sharded heads included), alone and concurrently, in both send modes; nothing stays
// posted and no block leaks; a receiver whose sources never come fails the transfer by its
// deadline and the request decodes on its prefill instance, as with a dead peer.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "coordinator/router.h"
#include "tests/engine/disaggregation_fixture.h"
#include "tests/test_util.h"
#include "worker/kv_peer_exchange.h"

namespace kvshard::disagg_test {
namespace {

// stories260K, with the fixture's instances on the peer path where an exchange is given.
class PeerDisaggregation : public DisaggregationFixture {
  protected:
    void SetUp() override {
        const std::string path = testing::SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K.bin");
        prompt_words_ = {"Once upon a time", "The little dog", "Lily and Tom went",
                         "One day, a big bird", "The sun was hot and"};
        Load(path);
    }

    // An instance of `tp` rank threads; `exchange` null: the host-staged path.
    Instance Make(const std::string& name, PoolRole role, int tp,
                  std::shared_ptr<KvPeerExchange> exchange, bool layerwise = false,
                  int64_t timeout_ms = 10'000) {
        InstanceOptions o;
        o.timeout_ms = timeout_ms;
        o.layerwise = layerwise;
        o.peer_exchange = std::move(exchange);
        return MakeWith(name, role, tp, o);
    }
};

struct PeerPair {
    const char* name;
    int prefill_tp;
    int decode_tp;
    bool layerwise;
};

class PeerDisaggregationPairs : public PeerDisaggregation,
                                public ::testing::WithParamInterface<PeerPair> {};

TEST_P(PeerDisaggregationPairs, GreedyEqualsColocated) {
    const PeerPair& pc = GetParam();
    const auto prompts = Prompts(12);
    const auto expected = Colocated(prompts, 16);
    auto exchange = std::make_shared<KvPeerExchange>();
    Instance decode = Make("decode", PoolRole::kDecode, pc.decode_tp, exchange);
    Instance prefill = Make("prefill", PoolRole::kPrefill, pc.prefill_tp, exchange, pc.layerwise);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    for (bool concurrent : {false, true}) {
        const auto got = Run(**router, prompts, 16, concurrent);
        for (size_t i = 0; i < prompts.size(); ++i)
            EXPECT_EQ(got[i], expected[i]) << "prompt " << i << " concurrent " << concurrent;
    }
    EXPECT_EQ(observer_.transfers.load(), 24);
    EXPECT_EQ(observer_.failures.load(), 0);
    EXPECT_GT(observer_.bytes_total.load(), 0);
    EXPECT_EQ(exchange->num_waiting(), 0);
    ExpectClean(prefill);
    ExpectClean(decode);
}

INSTANTIATE_TEST_SUITE_P(Pairs, PeerDisaggregationPairs,
                         ::testing::Values(PeerPair{"Tp1ToTp1", 1, 1, false},
                                           PeerPair{"Tp1ToTp1Layerwise", 1, 1, true},
                                           PeerPair{"Tp2ToTp1", 2, 1, false},
                                           PeerPair{"Tp1ToTp2", 1, 2, false},
                                           PeerPair{"Tp2ToTp2", 2, 2, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// A decode instance on the peer path whose prefill instance posts nothing (it hands KV over
// host-staged): each receive fails by its deadline, as with a dead peer, and the request decodes
// on its prefill instance with the colocated tokens.
TEST_F(PeerDisaggregation, MissingSourcesFailByTheDeadlineAndTheRequestDecodesOnPrefill) {
    const auto prompts = Prompts(2);
    const auto expected = Colocated(prompts, 8);
    auto exchange = std::make_shared<KvPeerExchange>();
    Instance decode = Make("decode", PoolRole::kDecode, 1, exchange, false, /*timeout_ms=*/200);
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1, nullptr, false, 200);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    const auto got = Run(**router, prompts, 8, /*concurrent=*/false);
    EXPECT_EQ(got, expected);
    EXPECT_EQ(observer_.FailuresWith(StatusCode::kDeadlineExceeded), 2);
    EXPECT_EQ(observer_.transfers.load(), 0);
    ExpectClean(decode);
    ExpectClean(prefill);
}

}  // namespace
}  // namespace kvshard::disagg_test
