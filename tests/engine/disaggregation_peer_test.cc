// Disaggregated prefill/decode in one process over the peer-copy KV handoff
// (kv_transfer.path: peer; worker/kv_peer_exchange.h): the prefill ranks post where their blocks
// are and the decode ranks copy them pool to pool through PeerCopy (the CPU backend's memcpy here;
// cudaMemcpyPeerAsync between GPUs). Greedy outputs equal the colocated tp 1 output for every tp
// pairing (re-sharded heads included), alone and concurrently, in both send modes; nothing stays
// posted and no block leaks; a receiver whose sources never come fails the transfer by its
// deadline and the request decodes on its prefill instance, as with a dead peer.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "coordinator/router.h"
#include "kv/kv_cache_groups.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "tests/engine/collecting_sink.h"
#include "tests/test_util.h"
#include "worker/kv_peer_exchange.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

class CountingObserver : public EngineObserver {
  public:
    void OnFirstToken(const std::string&, double) override {}
    void OnInterToken(const std::string&, double) override {}
    void OnKvTransfer(int64_t bytes, double) override {
        transfers++;
        bytes_total += bytes;
    }
    void OnKvTransferFailed(const Status& status) override {
        failures++;
        if (status.code() == StatusCode::kDeadlineExceeded) deadline_failures++;
    }
    std::atomic<int64_t> transfers{0}, bytes_total{0}, failures{0}, deadline_failures{0};
};

struct Instance {
    std::unique_ptr<TpGroup> group;
    std::unique_ptr<InstanceEngine> engine;
};

class PeerDisaggregation : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = testing::SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K.bin");
        Result<std::unique_ptr<ModelFile>> m = OpenModel(path);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        file_ = std::move(*m);
        Result<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(file_->tokenizer_data());
        ASSERT_TRUE(t.ok());
        tokenizer_ = std::move(*t);
    }

    // An instance of `tp` rank threads; `exchange` null: the host-staged path.
    Instance Make(const std::string& name, PoolRole role, int tp,
                  std::shared_ptr<KvPeerExchange> exchange, bool layerwise = false,
                  int64_t timeout_ms = 10'000) {
        TpGroupConfig tc;
        tc.tp = tp;
        tc.threads_per_rank = 1;
        tc.runner.max_context = 512;
        tc.runner.block_size = 16;
        tc.runner.num_kv_blocks = 256;
        tc.kv_transport_name = "peer-" + name + "-" + std::to_string(++counter_);
        tc.peer_exchange = std::move(exchange);
        Result<std::unique_ptr<TpGroup>> g = TpGroup::Create(*file_, tc);
        EXPECT_TRUE(g.ok()) << g.status().ToString();
        Instance out;
        out.group = std::move(*g);
        InstanceEngineConfig c;
        c.name = name;
        c.pool = std::string(PoolRoleName(role));
        c.role = role;
        c.tp = tp;
        c.kv_endpoints = out.group->kv_endpoints();
        c.handoff.layerwise = layerwise;
        c.handoff.timeout_ms = timeout_ms;
        c.observer = &observer_;
        c.scheduler.max_num_seqs = 64;
        c.scheduler.max_num_batched_tokens = 256;
        c.blocks.num_blocks = 256;
        c.blocks.block_size = 16;
        c.blocks.group_windows =
            kv::MakeKvCacheGroups(kv::LayerWindows(file_->spec()))->BlockManagerWindows();
        c.max_context = 512;
        if (tokenizer_->eos_id() >= 0) c.stop_token_ids.push_back(tokenizer_->eos_id());
        out.engine = std::make_unique<InstanceEngine>(c, *tokenizer_, *out.group);
        out.engine->Start();
        return out;
    }

    std::vector<std::vector<int32_t>> Prompts(int count) const {
        const std::vector<std::string> words = {"Once upon a time", "The little dog",
                                                "Lily and Tom went", "One day, a big bird",
                                                "The sun was hot and"};
        std::vector<std::vector<int32_t>> out;
        for (int i = 0; i < count; ++i) {
            std::string text = words[static_cast<size_t>(i) % words.size()];
            for (int k = 0; k < i / int(words.size()); ++k) text += " and then they played again";
            out.push_back(tokenizer_->Encode(text, {.add_bos = tokenizer_->data().add_bos}));
        }
        return out;
    }

    std::vector<std::vector<int32_t>> Run(Engine& engine,
                                          const std::vector<std::vector<int32_t>>& prompts,
                                          int64_t max_tokens, bool concurrent) {
        std::vector<std::shared_ptr<CollectingSink>> sinks;
        for (const std::vector<int32_t>& p : prompts) {
            GenerationRequest r;
            r.request_id = "peer-req-" + std::to_string(++request_counter_);
            r.prompt_token_ids = p;
            r.max_tokens = max_tokens;
            r.ignore_eos = true;
            sinks.push_back(std::make_shared<CollectingSink>(1));
            EXPECT_TRUE(engine.Submit(r, sinks.back()).ok());
            if (!concurrent) sinks.back()->Wait();
        }
        std::vector<std::vector<int32_t>> out;
        for (auto& s : sinks) {
            s->Wait();
            EXPECT_TRUE(s->status_.ok()) << s->status_.ToString();
            out.push_back(s->ids_[0]);
        }
        return out;
    }

    std::vector<std::vector<int32_t>> Colocated(const std::vector<std::vector<int32_t>>& prompts,
                                                int64_t max_tokens) {
        Instance mixed = Make("mixed", PoolRole::kMixed, 1, nullptr);
        return Run(*mixed.engine, prompts, max_tokens, /*concurrent=*/false);
    }

    static void ExpectClean(Instance& i) {
        i.engine->Stop();
        EXPECT_EQ(i.engine->BlockStats().num_used_blocks, 0) << i.engine->config().name;
        EXPECT_EQ(i.group->kv_staged_bytes(), 0) << i.engine->config().name;
    }

    std::unique_ptr<ModelFile> file_;
    std::unique_ptr<Tokenizer> tokenizer_;
    CountingObserver observer_;
    int counter_ = 0;
    int request_counter_ = 0;
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
    EXPECT_EQ(observer_.deadline_failures.load(), 2);
    EXPECT_EQ(observer_.transfers.load(), 0);
    ExpectClean(decode);
    ExpectClean(prefill);
}

}  // namespace
}  // namespace kvshard
