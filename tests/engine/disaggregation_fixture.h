// The disaggregation tests' shared fixture (tests/engine/disaggregation_test.cc and
// disaggregation_peer_test.cc): prefill, decode and mixed instances of the real CPU workers
// (TpGroups with in-process KV transports, or the peer-copy exchange) with an engine each, an
// observer that counts transfers and failures, the prompts, a runner that collects each
// request's tokens, and the leak check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "kv/kv_cache_groups.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "tests/engine/collecting_sink.h"
#include "worker/kv_peer_exchange.h"
#include "worker/tp_group.h"

namespace kvshard::disagg_test {

class RecordingObserver : public EngineObserver {
  public:
    void OnFirstToken(const std::string& pool, double) override {
        pool == "prefill" ? ttft_prefill++ : ttft_other++;
        std::lock_guard<std::mutex> lock(mu);
        first_token_pools.push_back(pool);
    }
    void OnInterToken(const std::string&, double) override { itl++; }
    void OnKvTransfer(int64_t bytes, double) override {
        transfers++;
        bytes_total += bytes;
    }
    void OnKvTransferFailed(const Status& status) override {
        failures++;
        std::lock_guard<std::mutex> lock(mu);
        failure_codes.push_back(status.code());
    }
    // How many failures had `code`.
    int64_t FailuresWith(StatusCode code) {
        std::lock_guard<std::mutex> lock(mu);
        return std::count(failure_codes.begin(), failure_codes.end(), code);
    }
    std::atomic<int64_t> ttft_prefill{0}, ttft_other{0}, itl{0}, transfers{0}, bytes_total{0},
        failures{0};
    std::mutex mu;
    std::vector<std::string> first_token_pools;  // guarded by mu
    std::vector<StatusCode> failure_codes;       // guarded by mu
};

// Lets a test take an instance's workers down (as a dead worker process would) and up again.
class DownableExecutor : public StepExecutor {
  public:
    explicit DownableExecutor(StepExecutor& inner) : inner_(inner) {}
    Result<StepResult> Execute(const StepPlan& plan) override {
        if (down.load()) return Status(StatusCode::kUnavailable, "rank 0: dead");
        return inner_.Execute(plan);
    }
    Status Health() const override {
        return down.load() ? Status(StatusCode::kUnavailable, "rank 0: dead") : Status::Ok();
    }
    uint64_t epoch() const override { return inner_.epoch(); }
    std::vector<std::string> kv_endpoints() const override { return inner_.kv_endpoints(); }
    std::atomic<bool> down{false};

  private:
    StepExecutor& inner_;
};

// How MakeWith builds an instance beyond its name, role and tp.
struct InstanceOptions {
    int64_t timeout_ms = 10'000;                    // of a handoff's receive
    bool layerwise = false;                         // send mode of a prefill instance
    std::vector<std::string> endpoints_override;    // the KV endpoints it says it has, when set
    std::string pool;                               // "": the role's name
    bool downable = false;                          // a DownableExecutor between group and engine
    std::shared_ptr<KvPeerExchange> peer_exchange;  // set: the peer-copy handoff path
};

struct Instance {
    std::unique_ptr<TpGroup> group;
    std::unique_ptr<DownableExecutor> gate;  // between the group and the engine, when asked
    std::unique_ptr<InstanceEngine> engine;
};

class DisaggregationFixture : public ::testing::Test {
  protected:
    void Load(const std::string& path) {
        Result<std::unique_ptr<ModelFile>> m = OpenModel(path);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        file_ = std::move(*m);
        Result<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(file_->tokenizer_data());
        ASSERT_TRUE(t.ok());
        tokenizer_ = std::move(*t);
    }

    // An instance with `tp` rank threads and a KV transport named `name`.
    Instance Make(const std::string& name, PoolRole role, int tp, int64_t timeout_ms = 10'000,
                  bool layerwise = false, std::vector<std::string> endpoints_override = {},
                  const std::string& pool = "", bool downable = false) {
        InstanceOptions o;
        o.timeout_ms = timeout_ms;
        o.layerwise = layerwise;
        o.endpoints_override = std::move(endpoints_override);
        o.pool = pool;
        o.downable = downable;
        return MakeWith(name, role, tp, o);
    }

    Instance MakeWith(const std::string& name, PoolRole role, int tp, const InstanceOptions& o) {
        TpGroupConfig tc;
        tc.tp = tp;
        tc.threads_per_rank = 1;
        tc.runner.max_context = 512;
        tc.runner.block_size = 16;
        tc.runner.num_kv_blocks = 256;
        tc.runner.kv_storage = kv_storage_;
        tc.kv_transport_name = name + "-" + std::to_string(++counter_);
        tc.peer_exchange = o.peer_exchange;
        Result<std::unique_ptr<TpGroup>> g = TpGroup::Create(*file_, tc);
        EXPECT_TRUE(g.ok()) << g.status().ToString();
        Instance out;
        out.group = std::move(*g);
        InstanceEngineConfig c;
        c.name = name;
        c.pool = o.pool.empty() ? std::string(PoolRoleName(role)) : o.pool;
        c.role = role;
        c.tp = tp;
        c.kv_endpoints =
            o.endpoints_override.empty() ? out.group->kv_endpoints() : o.endpoints_override;
        c.handoff.layerwise = o.layerwise;
        c.handoff.timeout_ms = o.timeout_ms;
        c.observer = &observer_;
        c.scheduler.max_num_seqs = 64;
        c.scheduler.max_num_batched_tokens = 256;
        c.blocks.num_blocks = 256;
        c.blocks.block_size = 16;
        c.blocks.group_windows =
            kv::MakeKvCacheGroups(kv::LayerWindows(file_->spec()))->BlockManagerWindows();
        c.blocks.enable_prefix_caching = prefix_caching_;
        c.max_context = 512;
        c.stop_token_ids = StopIds();
        StepExecutor* executor = out.group.get();
        if (o.downable) {
            out.gate = std::make_unique<DownableExecutor>(*out.group);
            executor = out.gate.get();
        }
        out.engine = std::make_unique<InstanceEngine>(c, *tokenizer_, *executor);
        out.engine->Start();
        return out;
    }

    std::vector<int32_t> StopIds() const {
        std::vector<int32_t> ids;
        if (tokenizer_->eos_id() >= 0) ids.push_back(tokenizer_->eos_id());
        return ids;
    }

    std::vector<std::vector<int32_t>> Prompts(int count) const {
        const std::vector<std::string>& words = prompt_words_;
        std::vector<std::vector<int32_t>> out;
        for (int i = 0; i < count; ++i) {
            std::string text = words[static_cast<size_t>(i) % words.size()];
            for (int k = 0; k < i / int(words.size()); ++k) text += " and then they played again";
            out.push_back(tokenizer_->Encode(text, {.add_bos = tokenizer_->data().add_bos}));
        }
        return out;
    }

    // Runs the prompts concurrently (or one by one) through `engine`; returns each one's tokens.
    std::vector<std::vector<int32_t>> Run(Engine& engine,
                                          const std::vector<std::vector<int32_t>>& prompts,
                                          int64_t max_tokens, bool concurrent,
                                          const SamplingParams& sampling = {}) {
        std::vector<std::shared_ptr<CollectingSink>> sinks;
        for (size_t i = 0; i < prompts.size(); ++i) {
            GenerationRequest r;
            r.request_id = "req-" + std::to_string(++request_counter_);
            r.prompt_token_ids = prompts[i];
            r.max_tokens = max_tokens;
            r.ignore_eos = true;
            r.sampling = sampling;
            r.sampling.seed = sampling.seed + i;
            sinks.push_back(std::make_shared<CollectingSink>(1));
            EXPECT_TRUE(engine.Submit(r, sinks.back()).ok());
            if (!concurrent) sinks.back()->Wait();
        }
        std::vector<std::vector<int32_t>> out;
        for (auto& s : sinks) {
            s->Wait();
            EXPECT_TRUE(s->status_.ok()) << s->status_.ToString();
            EXPECT_EQ(s->usage_.completion_tokens, max_tokens);
            out.push_back(s->ids_[0]);
        }
        return out;
    }

    std::vector<std::vector<int32_t>> Colocated(const std::vector<std::vector<int32_t>>& prompts,
                                                int64_t max_tokens) {
        Instance mixed = Make("mixed", PoolRole::kMixed, 1);
        return Run(*mixed.engine, prompts, max_tokens, /*concurrent=*/false);
    }

    static void ExpectClean(Instance& i) {
        i.engine->Stop();
        const kv::BlockManagerStats s = i.engine->BlockStats();
        EXPECT_EQ(s.num_used_blocks, 0) << i.engine->config().name;
        EXPECT_EQ(i.group->kv_staged_bytes(), 0) << i.engine->config().name;
    }

    std::unique_ptr<ModelFile> file_;
    std::unique_ptr<Tokenizer> tokenizer_;
    RecordingObserver observer_;
    int counter_ = 0;
    int request_counter_ = 0;
    bool prefix_caching_ = true;           // of the instances Make builds from now on
    KvDtype kv_storage_ = KvDtype::kFp32;  // likewise
    // What Prompts cycles through (a longer prompt each round).
    std::vector<std::string> prompt_words_ = {"Once upon a time",       "The little dog",
                                              "Lily and Tom went",      "One day, a big bird",
                                              "The sun was hot and",    "Sam had a red ball that",
                                              "In the park there was a"};
};

}  // namespace kvshard::disagg_test
