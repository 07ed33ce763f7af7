// The metrics vLLM's dashboards read, as an InstanceEngine feeds them through its EngineObserver:
// the engine is stepped by the test (PlanStep, a fake executor, CompleteStep) on a VirtualClock
// that each step moves on by its cost, so every phase time is known exactly and nothing sleeps.
// Then the process_* metrics read from /proc, and the vllm: names.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "coordinator/engine.h"
#include "coordinator/metrics.h"
#include "coordinator/process_metrics.h"
#include "model/bpe_tokenizer.h"
#include "model/tokenizer.h"

namespace kvshard {
namespace {

constexpr double kStepSeconds = 0.25;

// One token for every sequence that samples; each step takes kStepSeconds of the clock.
class TimedExecutor final : public StepExecutor {
  public:
    explicit TimedExecutor(VirtualClock& clock) : clock_(clock) {}
    Result<StepResult> Execute(const StepPlan& plan) override {
        clock_.AdvanceSeconds(kStepSeconds);
        StepResult r;
        r.step_id = plan.step_id;
        for (const ScheduledSequence& s : plan.sequences) {
            if (!s.sample) continue;
            SampledToken t;
            t.seq_id = s.seq_id;
            t.token_id = 'a';
            r.tokens.push_back(t);
        }
        return r;
    }

  private:
    VirtualClock& clock_;
};

class NullSink final : public RequestSink {
  public:
    void OnDelta(const GenerationDelta&) override {}
    void OnFinish(const GenerationUsage&, const Status&) override {}
};

std::unique_ptr<Tokenizer> ByteTokenizer() {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    for (int i = 256; i < 1024; ++i) d.tokens.push_back("t" + std::to_string(i));
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.source = "engine metrics test vocabulary";
    Result<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(std::move(d));
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(*t);
}

// Sample "name{labels}" -> value of an exposition.
std::map<std::string, double> Samples(const std::string& text) {
    std::map<std::string, double> out;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
        if (line.empty() || line[0] == '#') continue;
        const size_t space = line.rfind(' ');
        const std::string v = line.substr(space + 1);
        out[line.substr(0, space)] = v == "+Inf" ? INFINITY : std::stod(v);
    }
    return out;
}

ServerMetricsOptions Options(bool vllm_names) {
    ServerMetricsOptions o;
    o.max_model_len = 64;
    o.vllm_names = vllm_names;
    return o;
}

class EngineMetrics : public ::testing::Test {
  protected:
    EngineMetrics()
        : tokenizer_(ByteTokenizer()),
          executor_(clock_),
          metrics_(std::make_shared<ServerMetrics>("m", Options(false))) {
        InstanceEngineConfig c;
        c.name = "solo";
        c.observer = metrics_.get();
        c.scheduler.max_num_seqs = 8;
        c.scheduler.max_num_batched_tokens = 256;
        c.blocks.num_blocks = 32;
        c.blocks.block_size = 4;
        c.blocks.watermark = 0.0;
        c.max_context = 64;
        c.clock = &clock_;
        engine_ = std::make_unique<InstanceEngine>(c, *tokenizer_, executor_);
    }

    GenerationRequest Request(int n, int64_t max_tokens) {
        GenerationRequest r;
        r.request_id = "req-" + std::to_string(++counter_);
        for (int i = 0; i < 9; ++i) r.prompt_token_ids.push_back(300 + i);
        r.max_tokens = max_tokens;
        r.n = n;
        r.ignore_eos = true;
        r.arrival = clock_.Now();
        return r;
    }

    void Drain() {
        for (int guard = 0; guard < 1000 && engine_->HasWork(); ++guard) {
            std::optional<StepPlan> plan = engine_->PlanStep();
            if (!plan) break;
            engine_->CompleteStep(*plan, executor_.Execute(*plan));
        }
        ASSERT_FALSE(engine_->HasWork());
    }

    std::map<std::string, double> Scrape() { return Samples(metrics_->Render(engine_->Stats())); }

    VirtualClock clock_;
    std::unique_ptr<Tokenizer> tokenizer_;
    TimedExecutor executor_;
    std::shared_ptr<ServerMetrics> metrics_;
    std::unique_ptr<InstanceEngine> engine_;
    int counter_ = 0;
};

const std::string kModel = "{model_name=\"m\"}";

// Read at 10 s, submitted at 11 s, first planned at 11.5 s: queued 1.5 s. The prompt fits one
// step (0.25 s, prefill), then three decode steps (0.75 s) give tokens 2..4.
TEST_F(EngineMetrics, PhasesOfOneRequestOnTheEnginesClock) {
    clock_.AdvanceSeconds(10);
    GenerationRequest r = Request(/*n=*/1, /*max_tokens=*/4);
    clock_.AdvanceSeconds(1);
    ASSERT_TRUE(engine_->Submit(std::move(r), std::make_shared<NullSink>()).ok());
    clock_.AdvanceSeconds(0.5);
    Drain();
    const auto s = Scrape();
    EXPECT_DOUBLE_EQ(s.at("kvshard:request_queue_time_seconds_sum" + kModel), 1.5);
    EXPECT_DOUBLE_EQ(s.at("kvshard:request_prefill_time_seconds_sum" + kModel), 0.25);
    EXPECT_DOUBLE_EQ(s.at("kvshard:request_decode_time_seconds_sum" + kModel), 0.75);
    EXPECT_DOUBLE_EQ(s.at("kvshard:request_inference_time_seconds_sum" + kModel), 1.0);
    for (const char* h : {"queue_time_seconds", "prefill_time_seconds", "decode_time_seconds",
                          "inference_time_seconds", "prompt_tokens", "generation_tokens",
                          "params_n", "params_max_tokens"}) {
        EXPECT_EQ(s.at("kvshard:request_" + std::string(h) + "_count" + kModel), 1) << h;
    }
    // Buckets as vLLM's: 0.3 s is the first phase bound; 1-2-5 for token counts.
    EXPECT_EQ(s.at("kvshard:request_prefill_time_seconds_bucket{model_name=\"m\",le=\"0.3\"}"), 1);
    EXPECT_EQ(s.at("kvshard:request_queue_time_seconds_bucket{model_name=\"m\",le=\"1.5\"}"), 1);
    EXPECT_EQ(s.at("kvshard:request_queue_time_seconds_bucket{model_name=\"m\",le=\"1\"}"), 0);
    EXPECT_EQ(s.at("kvshard:request_prompt_tokens_sum" + kModel), 9);
    EXPECT_EQ(s.at("kvshard:request_prompt_tokens_bucket{model_name=\"m\",le=\"5\"}"), 0);
    EXPECT_EQ(s.at("kvshard:request_prompt_tokens_bucket{model_name=\"m\",le=\"10\"}"), 1);
    EXPECT_EQ(s.at("kvshard:request_prompt_tokens_bucket{model_name=\"m\",le=\"50\"}"), 1);
    EXPECT_EQ(s.count("kvshard:request_prompt_tokens_bucket{model_name=\"m\",le=\"100\"}"), 0u)
        << "buckets stop at max_model_len (64)";
    EXPECT_EQ(s.at("kvshard:request_generation_tokens_sum" + kModel), 4);
    EXPECT_EQ(s.at("kvshard:request_params_max_tokens_sum" + kModel), 4);
    EXPECT_EQ(s.at("kvshard:request_params_n_bucket{model_name=\"m\",le=\"1\"}"), 1);
    // Four steps: the 9-token prompt, then one token each for tokens 2..4.
    EXPECT_EQ(s.at("kvshard:iteration_tokens_total_count" + kModel), 4);
    EXPECT_EQ(s.at("kvshard:iteration_tokens_total_sum" + kModel), 12);
    EXPECT_EQ(s.at("kvshard:iteration_tokens_total_bucket{model_name=\"m\",le=\"1\"}"), 3);
    EXPECT_EQ(s.at("kvshard:iteration_tokens_total_bucket{model_name=\"m\",le=\"8\"}"), 3);
    EXPECT_EQ(s.at("kvshard:iteration_tokens_total_bucket{model_name=\"m\",le=\"16\"}"), 4);
}

// n = 2 is one request of two choices; a second request queued behind nothing else.
TEST_F(EngineMetrics, ChoicesAreOneRequest) {
    ASSERT_TRUE(engine_->Submit(Request(2, 3), std::make_shared<NullSink>()).ok());
    Drain();
    ASSERT_TRUE(engine_->Submit(Request(1, 5), std::make_shared<NullSink>()).ok());
    Drain();
    const auto s = Scrape();
    EXPECT_EQ(s.at("kvshard:request_params_n_count" + kModel), 2);
    EXPECT_EQ(s.at("kvshard:request_params_n_sum" + kModel), 3);
    EXPECT_EQ(s.at("kvshard:request_params_n_bucket{model_name=\"m\",le=\"1\"}"), 1);
    EXPECT_EQ(s.at("kvshard:request_params_n_bucket{model_name=\"m\",le=\"2\"}"), 2);
    EXPECT_EQ(s.at("kvshard:request_generation_tokens_sum" + kModel), 2 * 3 + 5);
    EXPECT_EQ(s.at("kvshard:request_params_max_tokens_sum" + kModel), 3 + 5);
    // Prefill + decode = inference, request by request, so in the sums too.
    EXPECT_DOUBLE_EQ(s.at("kvshard:request_prefill_time_seconds_sum" + kModel) +
                         s.at("kvshard:request_decode_time_seconds_sum" + kModel),
                     s.at("kvshard:request_inference_time_seconds_sum" + kModel));
    EXPECT_GT(s.at("kvshard:request_decode_time_seconds_sum" + kModel), 0);
}

// The latencies are the engine's alone, measured once from the request's arrival: the
// model-wide and the pool's histograms hold the same observations. Read at 10 s, submitted at
// 11 s; the choices' first tokens come at 11.5 s, after two steps of 0.25 s (the shared prompt,
// then the forked choices), so time to first token is 1.5 s, once for the request; two more steps
// give each of the 2 choices 2 more tokens 0.25 s apart (4 inter-token gaps); the request ends at
// 12 s.
TEST_F(EngineMetrics, LatenciesAreTheEnginesFromOneArrival) {
    clock_.AdvanceSeconds(10);
    GenerationRequest r = Request(/*n=*/2, /*max_tokens=*/3);
    clock_.AdvanceSeconds(1);
    ASSERT_TRUE(engine_->Submit(std::move(r), std::make_shared<NullSink>()).ok());
    Drain();
    const auto s = Scrape();
    const std::string pool = "{model_name=\"m\",pool=\"default\"}";
    EXPECT_EQ(s.at("kvshard:time_to_first_token_seconds_count" + kModel), 1);
    EXPECT_DOUBLE_EQ(s.at("kvshard:time_to_first_token_seconds_sum" + kModel), 1.5);
    EXPECT_EQ(s.at("kvshard:inter_token_latency_seconds_count" + kModel), 4);
    EXPECT_DOUBLE_EQ(s.at("kvshard:inter_token_latency_seconds_sum" + kModel), 4 * 0.25);
    for (const char* h : {"time_to_first_token_seconds", "inter_token_latency_seconds"}) {
        for (const char* part : {"_count", "_sum"}) {
            const std::string family = std::string(h) + part;
            EXPECT_EQ(s.at("kvshard:pool_" + family + pool), s.at("kvshard:" + family + kModel))
                << family;
        }
    }
    EXPECT_EQ(s.at("kvshard:e2e_request_latency_seconds_count" + kModel), 1);
    EXPECT_DOUBLE_EQ(s.at("kvshard:e2e_request_latency_seconds_sum" + kModel), 2.0);
    EXPECT_EQ(s.at("kvshard:generation_tokens_total" + kModel), 6);
    EXPECT_EQ(s.at("kvshard:request_success_total{model_name=\"m\",finished_reason=\"length\"}"),
              1);
}

// A request that fails ends once, as "error", with its end-to-end latency and its tokens, but no
// phases (vLLM's request_* histograms count requests that finished).
TEST_F(EngineMetrics, FailedRequestIsCountedAsAnError) {
    GenerationRequest r = Request(1, 4);
    ASSERT_TRUE(engine_->Submit(std::move(r), std::make_shared<NullSink>()).ok());
    std::optional<StepPlan> plan = engine_->PlanStep();
    ASSERT_TRUE(plan.has_value());
    clock_.AdvanceSeconds(2);
    engine_->CompleteStep(*plan, Status(StatusCode::kInternal, "rank 0: out of memory"));
    const auto s = Scrape();
    EXPECT_EQ(s.at("kvshard:request_success_total{model_name=\"m\",finished_reason=\"error\"}"), 1);
    EXPECT_EQ(s.at("kvshard:e2e_request_latency_seconds_count" + kModel), 1);
    EXPECT_DOUBLE_EQ(s.at("kvshard:e2e_request_latency_seconds_sum" + kModel), 2.0);
    EXPECT_EQ(s.at("kvshard:prompt_tokens_total" + kModel), 9);
    EXPECT_EQ(s.at("kvshard:request_queue_time_seconds_count" + kModel), 0);
    EXPECT_EQ(s.at("kvshard:time_to_first_token_seconds_count" + kModel), 0);
}

// An abort before the request ever ran: queue time up to the abort, no prefill or decode.
TEST_F(EngineMetrics, AbortedWhileWaiting) {
    GenerationRequest r = Request(1, 4);
    const std::string id = r.request_id;
    ASSERT_TRUE(engine_->Submit(std::move(r), std::make_shared<NullSink>()).ok());
    clock_.AdvanceSeconds(2);
    engine_->Abort(id);
    Drain();
    const auto s = Scrape();
    EXPECT_EQ(s.at("kvshard:request_queue_time_seconds_count" + kModel), 1);
    EXPECT_DOUBLE_EQ(s.at("kvshard:request_queue_time_seconds_sum" + kModel), 2.0);
    EXPECT_EQ(s.at("kvshard:request_inference_time_seconds_sum" + kModel), 0);
    EXPECT_EQ(s.at("kvshard:request_generation_tokens_sum" + kModel), 0);
}

TEST_F(EngineMetrics, CacheConfigInfoNamesTheInstancesBlocks) {
    const auto s = Scrape();
    EXPECT_EQ(s.at("kvshard:cache_config_info{model_name=\"m\",instance=\"solo\",block_size=\"4\","
                   "num_gpu_blocks=\"32\",enable_prefix_caching=\"True\"}"),
              1);
}

TEST_F(EngineMetrics, VllmNamesRepeatEveryKvshardSeries) {
    ServerMetrics plain("m");
    EXPECT_EQ(plain.Render(engine_->Stats()).find("vllm:"), std::string::npos);

    ServerMetrics both("m", Options(true));
    both.OnStepTokens(7);
    FinishedRequestStats finished;
    finished.queue_seconds = 0.5;
    finished.prompt_tokens = 3;
    finished.n = 2;
    finished.max_tokens = 9;
    finished.e2e_seconds = 1.0;
    finished.finished_reason = "stop";
    finished.generation_tokens = 2;
    both.OnRequestFinished(finished);
    const std::string text = both.Render(engine_->Stats());
    const auto s = Samples(text);
    int kvshard_series = 0;
    for (const auto& [name, value] : s) {
        if (name.rfind("kvshard:", 0) != 0) continue;
        ++kvshard_series;
        const std::string alias = "vllm:" + name.substr(8);
        ASSERT_EQ(s.count(alias), 1u) << alias;
        EXPECT_EQ(s.at(alias), value) << alias;
    }
    EXPECT_GT(kvshard_series, 100);
    EXPECT_NE(text.find("# TYPE vllm:request_queue_time_seconds histogram\n"), std::string::npos);
    EXPECT_EQ(s.at("vllm:request_params_n_sum" + kModel), 2);
    EXPECT_EQ(s.at("vllm:request_success_total{model_name=\"m\",finished_reason=\"stop\"}"), 1);
    // prometheus_client's process metrics have no prefix and are written once.
    EXPECT_EQ(text.find("vllm:process_"), std::string::npos);
}

TEST(ProcessMetrics, ParsesProcStat) {
    // Field 2 may hold spaces and parentheses; utime 300, stime 100 ticks; starttime 5000 ticks;
    // vsize 123456789 bytes; rss 2560 pages.
    const std::string stat =
        "4242 (kv shard) (x)) S 1 4242 4242 0 -1 4194304 100 0 0 0 300 100 0 0 20 0 9 0 5000 "
        "123456789 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
    Result<ProcessStats> p = ParseProcStat(stat, /*boot=*/1'700'000'000, /*ticks=*/100,
                                           /*page=*/4096);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_DOUBLE_EQ(p->cpu_seconds, 4.0);
    EXPECT_DOUBLE_EQ(p->start_time_seconds, 1'700'000'050.0);
    EXPECT_DOUBLE_EQ(p->virtual_memory_bytes, 123456789.0);
    EXPECT_DOUBLE_EQ(p->resident_memory_bytes, 2560.0 * 4096);

    EXPECT_FALSE(ParseProcStat("4242 (kvshard) S 1 2 3", 0, 100, 4096).ok());
    EXPECT_FALSE(ParseProcStat("no command here", 0, 100, 4096).ok());
    Result<ProcessStats> bad =
        ParseProcStat("1 (k) S 1 1 1 0 -1 0 0 0 0 0 x 0 0 0 20 0 1 0 5 6 7", 0, 100, 4096);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("field 14"), std::string::npos) << bad.status().message();
}

TEST(ProcessMetrics, ThisProcess) {
    Result<ProcessStats> p = ReadProcessStats();
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_GT(p->resident_memory_bytes, 1 << 20);
    EXPECT_GE(p->virtual_memory_bytes, p->resident_memory_bytes);
    EXPECT_GE(p->open_fds, 3);  // stdin, stdout, stderr at least
    EXPECT_GE(p->max_fds, p->open_fds);
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    EXPECT_LE(p->start_time_seconds, now + 1);
    EXPECT_GT(p->start_time_seconds, now - 24 * 3600);

    const auto s = Samples(RenderProcessMetrics(*p));
    EXPECT_EQ(s.at("process_resident_memory_bytes"), p->resident_memory_bytes);
    EXPECT_EQ(s.at("process_cpu_seconds_total"), p->cpu_seconds);
    EXPECT_EQ(s.at("process_max_fds"), p->max_fds);
}

}  // namespace
}  // namespace kvshard
