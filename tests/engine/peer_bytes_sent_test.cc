// The peer-copy KV handoff (kv_transfer.path: peer, worker/kv_peer_exchange.h) counts on the
// sending side too: the prefill instance's steps report in kv_bytes_sent the bytes the decode
// ranks copy out of its pools, as the host-staged path reports the pieces it sends — equal to the
// decode side's kv_bytes_received, re-sharded heads included. Before, the prefill side reported 0.
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

// Passes steps to the group and adds up what its results report.
class CountingExecutor : public StepExecutor {
  public:
    explicit CountingExecutor(TpGroup& group) : group_(group) {}
    Result<StepResult> Execute(const StepPlan& plan) override {
        Result<StepResult> r = group_.Execute(plan);
        if (r.ok()) {
            sent += r->kv_bytes_sent;
            received += r->kv_bytes_received;
        }
        return r;
    }
    Status Health() const override { return group_.Health(); }
    uint64_t epoch() const override { return group_.epoch(); }
    std::vector<std::string> kv_endpoints() const override { return group_.kv_endpoints(); }

    std::atomic<int64_t> sent{0}, received{0};

  private:
    TpGroup& group_;
};

struct Instance {
    std::unique_ptr<TpGroup> group;
    std::unique_ptr<CountingExecutor> counting;
    std::unique_ptr<InstanceEngine> engine;
};

struct Pair {
    const char* name;
    int prefill_tp;
    int decode_tp;
    bool peer;  // false: host-staged, the reference for what a handoff carries
};

class PeerBytesSent : public ::testing::TestWithParam<Pair> {
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

    Instance Make(const std::string& name, PoolRole role, int tp,
                  std::shared_ptr<KvPeerExchange> exchange) {
        TpGroupConfig tc;
        tc.tp = tp;
        tc.threads_per_rank = 1;
        tc.runner.max_context = 512;
        tc.runner.block_size = 16;
        tc.runner.num_kv_blocks = 128;
        tc.kv_transport_name = "bytes-" + name + "-" + std::to_string(++counter_);
        tc.peer_exchange = std::move(exchange);
        Result<std::unique_ptr<TpGroup>> g = TpGroup::Create(*file_, tc);
        EXPECT_TRUE(g.ok()) << g.status().ToString();
        Instance out;
        out.group = std::move(*g);
        out.counting = std::make_unique<CountingExecutor>(*out.group);
        InstanceEngineConfig c;
        c.name = name;
        c.pool = std::string(PoolRoleName(role));
        c.role = role;
        c.tp = tp;
        c.kv_endpoints = out.group->kv_endpoints();
        c.scheduler.max_num_seqs = 16;
        c.scheduler.max_num_batched_tokens = 256;
        c.blocks.num_blocks = 128;
        c.blocks.block_size = 16;
        c.blocks.group_windows =
            kv::MakeKvCacheGroups(kv::LayerWindows(file_->spec()))->BlockManagerWindows();
        c.max_context = 512;
        out.engine = std::make_unique<InstanceEngine>(c, *tokenizer_, *out.counting);
        out.engine->Start();
        return out;
    }

    std::unique_ptr<ModelFile> file_;
    std::unique_ptr<Tokenizer> tokenizer_;
    int counter_ = 0;
};

TEST_P(PeerBytesSent, ThePrefillSideCountsWhatTheDecodeSideReceives) {
    const Pair& p = GetParam();
    auto exchange = p.peer ? std::make_shared<KvPeerExchange>() : nullptr;
    Instance decode = Make("decode", PoolRole::kDecode, p.decode_tp, exchange);
    Instance prefill = Make("prefill", PoolRole::kPrefill, p.prefill_tp, exchange);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    // Prompts of different first blocks (no prefix shared with an earlier request), one at a time.
    const std::vector<std::string> texts = {
        "Once upon a time there was a little girl named Lily who loved to play outside",
        "The big brown dog ran into the park and found a shiny red ball under a tree",
        "Tom and his mom went to the store to buy some apples and a cake for dinner"};
    for (size_t i = 0; i < texts.size(); ++i) {
        GenerationRequest r;
        r.request_id = std::string(p.name) + "-" + std::to_string(i);
        r.prompt_token_ids = tokenizer_->Encode(texts[i], {.add_bos = tokenizer_->data().add_bos});
        r.max_tokens = 4;
        r.ignore_eos = true;
        auto sink = std::make_shared<CollectingSink>(1);
        ASSERT_TRUE((*router)->Submit(r, sink).ok());
        sink->Wait();
        ASSERT_TRUE(sink->status_.ok()) << sink->status_.ToString();
    }
    prefill.engine->Stop();
    decode.engine->Stop();
    EXPECT_GT(decode.counting->received.load(), 0);
    EXPECT_EQ(prefill.counting->sent.load(), decode.counting->received.load());
}

INSTANTIATE_TEST_SUITE_P(Pairs, PeerBytesSent,
                         ::testing::Values(Pair{"PeerTp1ToTp1", 1, 1, true},
                                           Pair{"PeerTp2ToTp1", 2, 1, true},
                                           Pair{"PeerTp1ToTp2", 1, 2, true},
                                           Pair{"HostStagedTp2ToTp1", 2, 1, false}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvshard
