// kvshard_kv_bench: how much of the KV memory the paged block manager fills with real tokens under
// continuous batching, next to what a maximum-length contiguous reservation per request would use
// for the same workload. Not a test: it prints figures (docs/kv.md quotes a run).
//
// Workload: requests with prompt and output lengths drawn from log-normal distributions (wide:
// sigma 1 spans ~30x between the 5th and 95th percentiles), clipped to the model length. Each step
// every running sequence decodes one token (preempting the newest sequences by recompute when a
// slot cannot be had), finished sequences are freed, and waiting requests are admitted in order
// while CanAllocate says yes and the step's prefill token budget lasts.
//
//   kvshard_kv_bench [--blocks N] [--block-size B] [--requests N] [--max-model-len L]
//                    [--prompt-median T] [--output-median T] [--sigma S] [--watermark W]
//                    [--prefill-budget T] [--print-every STEPS] [--seed N]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kv/block_manager.h"

namespace {

using kvshard::kv::BlockManager;
using kvshard::kv::BlockManagerConfig;
using kvshard::kv::SeqId;

struct Options {
    int64_t num_blocks = 8192;  // 131,072 slots at block size 16
    int64_t block_size = 16;
    int64_t num_requests = 20000;
    int64_t max_model_len = 8192;
    double prompt_median = 512;
    double output_median = 256;
    double sigma = 1.0;
    double watermark = 0.01;
    int64_t prefill_budget = 16384;  // prompt tokens admitted per step
    int64_t print_every = 0;         // 0: about 40 rows
    uint64_t seed = 1;
};

struct Request {
    int64_t prompt_len = 0;
    int64_t output_len = 0;
};

struct Running {
    SeqId id = 0;
    size_t request = 0;
    int64_t generated = 0;
};

bool ParseArgs(int argc, char** argv, Options& o) {
    auto i64 = [](int64_t& field) { return [&field](const char* v) { field = std::atoll(v); }; };
    auto f64 = [](double& field) { return [&field](const char* v) { field = std::atof(v); }; };
    const std::pair<const char*, std::function<void(const char*)>> flags[] = {
        {"--blocks", i64(o.num_blocks)},
        {"--block-size", i64(o.block_size)},
        {"--requests", i64(o.num_requests)},
        {"--max-model-len", i64(o.max_model_len)},
        {"--prompt-median", f64(o.prompt_median)},
        {"--output-median", f64(o.output_median)},
        {"--sigma", f64(o.sigma)},
        {"--watermark", f64(o.watermark)},
        {"--prefill-budget", i64(o.prefill_budget)},
        {"--print-every", i64(o.print_every)},
        {"--seed", [&o](const char* v) { o.seed = std::strtoull(v, nullptr, 10); }},
    };
    for (int i = 1; i + 1 < argc; i += 2) {
        auto it = std::find_if(std::begin(flags), std::end(flags),
                               [&](const auto& f) { return std::strcmp(f.first, argv[i]) == 0; });
        if (it == std::end(flags)) return false;
        it->second(argv[i + 1]);
    }
    return argc % 2 == 1 && o.num_blocks > 0 && o.block_size > 0 && o.num_requests > 0 &&
           o.max_model_len > 1 && o.prefill_budget > 0;
}

std::vector<Request> MakeWorkload(const Options& o) {
    std::mt19937_64 rng(o.seed);
    std::lognormal_distribution<double> prompt(std::log(o.prompt_median), o.sigma);
    std::lognormal_distribution<double> output(std::log(o.output_median), o.sigma);
    std::vector<Request> reqs(static_cast<size_t>(o.num_requests));
    for (Request& r : reqs) {
        r.prompt_len = std::clamp<int64_t>(std::llround(prompt(rng)), 1, o.max_model_len - 1);
        r.output_len =
            std::clamp<int64_t>(std::llround(output(rng)), 1, o.max_model_len - r.prompt_len);
    }
    return reqs;
}

// The same workload with a max_model_len contiguous region reserved per request: how many steps
// it takes, and the running count it can sustain.
int64_t ContiguousSteps(const std::vector<Request>& reqs, int64_t slots, int64_t max_len) {
    const int64_t capacity = slots / max_len;
    std::vector<int64_t> left;  // decode steps left per running request
    size_t next = 0;
    int64_t steps = 0;
    while (next < reqs.size() || !left.empty()) {
        for (int64_t& l : left) --l;
        std::erase_if(left, [](int64_t l) { return l <= 0; });
        while (next < reqs.size() && static_cast<int64_t>(left.size()) < capacity) {
            left.push_back(reqs[next++].output_len);
        }
        ++steps;
    }
    return steps;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    if (!ParseArgs(argc, argv, o)) {
        std::fprintf(stderr,
                     "usage: kvshard_kv_bench [--blocks N] [--block-size B] [--requests N] "
                     "[--max-model-len L] [--prompt-median T] [--output-median T] [--sigma S] "
                     "[--watermark W] [--prefill-budget T] [--print-every STEPS] [--seed N]\n");
        return 2;
    }
    const std::vector<Request> reqs = MakeWorkload(o);
    BlockManagerConfig config;
    config.num_blocks = o.num_blocks;
    config.block_size = o.block_size;
    config.watermark = o.watermark;
    config.enable_prefix_caching = false;  // random prompts: nothing to share
    kvshard::Result<BlockManager> made = BlockManager::Create(config);
    if (!made.ok()) {
        std::fprintf(stderr, "kvshard_kv_bench: %s\n", made.status().ToString().c_str());
        return 2;
    }
    BlockManager& bm = *made;
    const int64_t slots = o.num_blocks * o.block_size;

    double mean_prompt = 0, mean_output = 0;
    for (const Request& r : reqs) {
        mean_prompt += static_cast<double>(r.prompt_len) / static_cast<double>(reqs.size());
        mean_output += static_cast<double>(r.output_len) / static_cast<double>(reqs.size());
    }
    std::printf(
        "kvshard_kv_bench: %lld blocks x %lld slots = %lld KV slots, %lld requests, "
        "prompt ~ lognormal(median %.0f, sigma %.2f) mean %.0f, output ~ lognormal(median "
        "%.0f, sigma %.2f) mean %.0f, max model len %lld, watermark %.2f, seed %llu\n",
        static_cast<long long>(o.num_blocks), static_cast<long long>(o.block_size),
        static_cast<long long>(slots), static_cast<long long>(o.num_requests), o.prompt_median,
        o.sigma, mean_prompt, o.output_median, o.sigma, mean_output,
        static_cast<long long>(o.max_model_len), o.watermark,
        static_cast<unsigned long long>(o.seed));

    std::deque<size_t> waiting;
    for (size_t i = 0; i < reqs.size(); ++i) waiting.push_back(i);
    std::vector<Running> running;
    std::vector<int32_t> prompt_tokens(static_cast<size_t>(o.max_model_len), 1);
    SeqId next_id = 1;
    int64_t step = 0, finished = 0, preemptions = 0;
    int64_t full_load_steps = 0;
    double min_util_full = 1.0, sum_util_full = 0, sum_contig_util_full = 0;
    double min_contig_util_full = 1.0, sum_running_full = 0, sum_occupancy_full = 0;
    const int64_t print_every = o.print_every > 0 ? o.print_every : 0;
    std::vector<std::string> rows;

    while (!waiting.empty() || !running.empty()) {
        // Decode one token for each running sequence, oldest first; preempt the newest on need.
        for (size_t i = 0; i < running.size(); ++i) {
            bool preempted_self = false;
            while (!bm.CanAppend(running[i].id, 1)) {
                // Preempt by recompute: the request goes back to the front of the queue.
                const Running victim = running.back();
                running.pop_back();
                bm.Free(victim.id);
                waiting.push_front(victim.request);
                ++preemptions;
                if (i >= running.size()) {
                    preempted_self = true;
                    break;
                }
            }
            if (preempted_self) break;
            bm.AppendSlot(running[i].id, 1);
            if (++running[i].generated >= reqs[running[i].request].output_len) {
                bm.Free(running[i].id);
                running[i].id = -1;
                ++finished;
            }
        }
        std::erase_if(running, [](const Running& r) { return r.id < 0; });

        // Admit in order while memory and the prefill budget allow.
        int64_t budget = o.prefill_budget;
        bool memory_bound = false;
        while (!waiting.empty()) {
            const Request& r = reqs[waiting.front()];
            if (r.prompt_len > budget && budget < o.prefill_budget) break;
            kvshard::kv::SequenceRequest sr{
                next_id, std::span<const int32_t>(prompt_tokens.data(), r.prompt_len)};
            if (!bm.CanAllocate(sr)) {
                memory_bound = true;
                break;
            }
            bm.Allocate(sr);
            running.push_back({next_id++, waiting.front(), 0});
            waiting.pop_front();
            budget -= r.prompt_len;
        }

        const kvshard::kv::BlockManagerStats st = bm.Stats();
        // A max-length contiguous reservation for the same running requests.
        const double contiguous_util =
            running.empty() ? 1.0
                            : static_cast<double>(st.stored_tokens) /
                                  static_cast<double>(running.size() * o.max_model_len);
        if (memory_bound) {
            ++full_load_steps;
            min_util_full = std::min(min_util_full, st.utilization);
            sum_util_full += st.utilization;
            min_contig_util_full = std::min(min_contig_util_full, contiguous_util);
            sum_contig_util_full += contiguous_util;
            sum_running_full += static_cast<double>(running.size());
            sum_occupancy_full +=
                static_cast<double>(st.stored_tokens) / static_cast<double>(slots);
        }
        char row[256];
        std::snprintf(row, sizeof row, "%7lld %8zu %8zu %8lld %7lld %11lld %9.2f%% %9.2f%% %s",
                      static_cast<long long>(step), running.size(), waiting.size(),
                      static_cast<long long>(st.num_used_blocks),
                      static_cast<long long>(st.num_free_blocks),
                      static_cast<long long>(st.stored_tokens), 100.0 * st.utilization,
                      100.0 * contiguous_util, memory_bound ? "full" : "");
        rows.emplace_back(row);
        ++step;
    }

    const int64_t every = print_every > 0 ? print_every : std::max<int64_t>(1, step / 40);
    std::printf(
        "\n   step  running  waiting   blocks    free stored_tok paged_util "
        "contig_util load\n");
    for (size_t i = 0; i < rows.size(); i += static_cast<size_t>(every)) {
        std::printf("%s\n", rows[i].c_str());
    }
    const int64_t contiguous_capacity = slots / o.max_model_len;
    const int64_t contiguous_steps = ContiguousSteps(reqs, slots, o.max_model_len);
    std::printf("\npaged, block size %lld: %lld steps, %lld requests finished, %lld preemptions\n",
                static_cast<long long>(o.block_size), static_cast<long long>(step),
                static_cast<long long>(finished), static_cast<long long>(preemptions));
    if (full_load_steps > 0) {
        std::printf(
            "  at full load (%lld steps where admission waited for memory): utilization "
            "(stored tokens / allocated slots) min %.2f%%, mean %.2f%%; stored tokens / "
            "all slots mean %.2f%%; %.1f requests running on average\n",
            static_cast<long long>(full_load_steps), 100.0 * min_util_full,
            100.0 * sum_util_full / static_cast<double>(full_load_steps),
            100.0 * sum_occupancy_full / static_cast<double>(full_load_steps),
            sum_running_full / static_cast<double>(full_load_steps));
        std::printf(
            "  the same running requests with a %lld-slot contiguous reservation each "
            "would use %.2f%% of the reserved slots for tokens (min %.2f%%), and would need "
            "%.1fx the memory\n",
            static_cast<long long>(o.max_model_len),
            100.0 * sum_contig_util_full / static_cast<double>(full_load_steps),
            100.0 * min_contig_util_full,
            sum_running_full / static_cast<double>(full_load_steps) *
                static_cast<double>(o.max_model_len) / static_cast<double>(slots));
    } else {
        std::printf(
            "  the workload never filled the KV memory: raise --requests or lower --blocks\n");
    }
    std::printf(
        "contiguous, %lld slots reserved per request: %lld requests fit at once; the "
        "workload takes %lld steps (%.2fx the paged run)\n",
        static_cast<long long>(o.max_model_len), static_cast<long long>(contiguous_capacity),
        static_cast<long long>(contiguous_steps),
        static_cast<double>(contiguous_steps) / static_cast<double>(step));
    return full_load_steps > 0 ? 0 : 1;
}
