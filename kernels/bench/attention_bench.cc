// kvshard_attention_bench: milliseconds per layer of cpu::PagedAttentionBatched (new) against
// cpu::PagedAttention called once per sequence (old), over the same paged pool, at SmolLM2-135M's
// attention shape (9 query heads, 3 KV heads, head_dim 64, block 16), with 1 and 2 threads.
//
//   kvshard_attention_bench [--storage f32|bf16|fp16|int8|fp8] [--min-ms N]
//
// Each figure is the best of repeated runs lasting at least --min-ms (default 300) in total.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/paged_attention.h"

namespace kvshard::cpu {
namespace {

constexpr int64_t kNumHeads = 9;
constexpr int64_t kNumKvHeads = 3;
constexpr int64_t kHeadDim = 64;
constexpr int64_t kBlockSize = 16;

// One step of the benchmark: sequences with their contexts after the step and their new rows.
struct Step {
    std::vector<int32_t> context_lens;
    std::vector<int32_t> rows;
};

struct Scenario {
    std::string name;
    std::vector<Step> steps;  // timed together: one layer of each
};

// A pool holding every sequence of a step, with its blocks in order and random K/V.
class StepData {
  public:
    StepData(const Step& step, KvDtype storage, std::mt19937& gen) {
        const int64_t layer_bytes = PagedLayerBytes(storage, kBlockSize, kNumKvHeads, kHeadDim);
        std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
        int64_t num_blocks = 0;
        query_starts_.push_back(0);
        table_starts_.push_back(0);
        for (size_t s = 0; s < step.rows.size(); ++s) {
            const int64_t blocks = (step.context_lens[s] + kBlockSize - 1) / kBlockSize;
            for (int64_t b = 0; b < blocks; ++b)
                tables_.push_back(static_cast<int32_t>(num_blocks++));
            table_starts_.push_back(static_cast<int32_t>(tables_.size()));
            query_starts_.push_back(query_starts_.back() + step.rows[s]);
        }
        context_lens_ = step.context_lens;
        pool_.assign(static_cast<size_t>(num_blocks * layer_bytes), 0);
        kv_ = MakePagedKvLayer(pool_.data(), layer_bytes, 0, storage, kBlockSize, kNumKvHeads,
                               kHeadDim);
        const int64_t row = kNumKvHeads * kHeadDim;
        for (size_t s = 0; s < step.rows.size(); ++s) {
            const int64_t n = step.context_lens[s];
            std::vector<float> k(static_cast<size_t>(n * row)), v(k.size());
            for (float& x : k) x = dist(gen);
            for (float& x : v) x = dist(gen);
            std::vector<int64_t> slots(static_cast<size_t>(n));
            for (int64_t p = 0; p < n; ++p) {
                slots[p] = int64_t{tables_[table_starts_[s] + p / kBlockSize]} * kBlockSize +
                           p % kBlockSize;
            }
            PagedKvWrite(kv_, k.data(), v.data(), row, slots.data(), n);
        }
        q_.resize(static_cast<size_t>(query_starts_.back() * kNumHeads * kHeadDim));
        for (float& x : q_) x = dist(gen);
        out_.resize(q_.size());
    }

    void RunOld() {
        const int64_t width = kNumHeads * kHeadDim;
        for (size_t s = 0; s + 1 < query_starts_.size(); ++s) {
            const int64_t n = query_starts_[s + 1] - query_starts_[s];
            PagedAttention(
                q_.data() + query_starts_[s] * width, kv_, tables_.data() + table_starts_[s],
                out_.data() + query_starts_[s] * width, n, context_lens_[s] - n, kNumHeads);
        }
    }

    void RunNew() {
        PagedAttentionBatch batch;
        batch.num_seqs = static_cast<int64_t>(context_lens_.size());
        batch.query_starts = query_starts_.data();
        batch.context_lens = context_lens_.data();
        batch.block_table_starts = table_starts_.data();
        batch.block_tables = tables_.data();
        PagedAttentionBatched(q_.data(), kNumHeads * kHeadDim, kv_, batch, out_.data(), kNumHeads);
    }

  private:
    std::vector<uint8_t> pool_;
    PagedKvLayer kv_;
    std::vector<int32_t> query_starts_, context_lens_, table_starts_, tables_;
    std::vector<float> q_, out_;
};

// Best milliseconds of fn over runs lasting at least min_ms in total (and at least 3 runs).
double BestMs(const std::function<void()>& fn, double min_ms) {
    double best = 1e30, total = 0.0;
    for (int run = 0; run < 3 || total < min_ms; ++run) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        best = std::min(best, ms);
        total += ms;
    }
    return best;
}

Step Decode(int32_t num_seqs, int32_t context_len) {
    return Step{std::vector<int32_t>(static_cast<size_t>(num_seqs), context_len),
                std::vector<int32_t>(static_cast<size_t>(num_seqs), 1)};
}

int Main(int argc, char** argv) {
    KvDtype storage = KvDtype::kFp32;
    std::string storage_name = "f32";
    double min_ms = 300.0;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--storage" && i + 1 < argc) {
            storage_name = argv[++i];
            if (storage_name == "int8") {
                storage = KvDtype::kInt8;
            } else if (storage_name == "fp8") {
                storage = KvDtype::kFp8;
            } else if (storage_name == "bf16") {
                storage = KvDtype::kBf16;
            } else if (storage_name == "fp16") {
                storage = KvDtype::kFp16;
            } else if (storage_name != "f32") {
                std::fprintf(stderr, "unknown storage %s (f32, bf16, fp16, int8, fp8)\n",
                             storage_name.c_str());
                return 2;
            }
        } else if (arg == "--min-ms" && i + 1 < argc) {
            min_ms = std::atof(argv[++i]);
        } else {
            std::fprintf(stderr, "usage: %s [--storage f32|bf16|fp16|int8|fp8] [--min-ms N]\n",
                         argv[0]);
            return 2;
        }
    }
    const std::vector<Scenario> scenarios = {
        {"prefill 2048 in one chunk", {Step{{2048}, {2048}}}},
        {"prefill 2048 in chunks of 512",
         {Step{{512}, {512}}, Step{{1024}, {512}}, Step{{1536}, {512}}, Step{{2048}, {512}}}},
        {"prefill chunk 512 at context 2048", {Step{{2048}, {512}}}},
        {"decode 16 seqs at context 1024", {Decode(16, 1024)}},
        {"decode 1 seq at context 2048", {Decode(1, 2048)}},
        {"decode 1 seq at context 160", {Decode(1, 160)}},
    };
    std::printf(
        "attention per layer: %lld query heads, %lld KV heads, head_dim "
        "%lld, block %lld, "
        "%s storage\n",
        static_cast<long long>(kNumHeads), static_cast<long long>(kNumKvHeads),
        static_cast<long long>(kHeadDim), static_cast<long long>(kBlockSize), storage_name.c_str());
    std::printf("%-36s %7s %10s %10s %9s\n", "case", "threads", "old ms", "new ms", "new/old");
    std::mt19937 gen(1);
    for (const Scenario& sc : scenarios) {
        std::vector<StepData> steps;
        for (const Step& step : sc.steps) steps.emplace_back(step, storage, gen);
        for (int threads : {1, 2}) {
            omp_set_num_threads(threads);
            const double old_ms = BestMs(
                [&] {
                    for (StepData& s : steps) s.RunOld();
                },
                min_ms);
            const double new_ms = BestMs(
                [&] {
                    for (StepData& s : steps) s.RunNew();
                },
                min_ms);
            std::printf("%-36s %7d %10.3f %10.3f %9.3f\n", sc.name.c_str(), threads, old_ms, new_ms,
                        new_ms / old_ms);
        }
    }
    return 0;
}

}  // namespace
}  // namespace kvshard::cpu

int main(int argc, char** argv) { return kvshard::cpu::Main(argc, argv); }
