#include "worker/throughput.h"

#include <algorithm>
#include <chrono>

#include "worker/sampler.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

}  // namespace

Result<ThroughputFigures> MeasureThroughput(ModelRunner& runner, const ThroughputConfig& c) {
    if (c.batch <= 0 || c.prompt_tokens <= 0 || c.decode_tokens < 0 || c.runs <= 0) {
        return InvalidArgument("batch, prompt_tokens and runs must be positive");
    }
    if (c.prompt_tokens + c.decode_tokens > runner.max_context()) {
        return InvalidArgument("prompt_tokens + decode_tokens exceed the context of " +
                               std::to_string(runner.max_context()));
    }
    const int64_t vocab = runner.spec().vocab_size;
    FixedBlockTables tables(c.batch, c.prompt_tokens + c.decode_tokens,
                            runner.pool()->config().block_size, runner.kv_groups().num_groups());
    if (tables.num_blocks() > runner.pool()->config().num_blocks) {
        return InvalidArgument("the KV pool of " +
                               std::to_string(runner.pool()->config().num_blocks) +
                               " blocks cannot hold the batch (" +
                               std::to_string(tables.num_blocks()) + " blocks needed)");
    }
    using Clock = std::chrono::steady_clock;
    ThroughputFigures f;
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(c.batch));
    uint64_t state = 0x9E3779B97F4A7C15ULL;
    for (auto& p : prompts) {
        for (int64_t i = 0; i < c.prompt_tokens; ++i) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            p.push_back(static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab)));
        }
    }
    std::vector<float> logits;
    std::vector<double> comm_fractions;
    for (int64_t run = 0; run < c.runs; ++run) {
        std::vector<SequenceChunk> batch;
        for (int64_t s = 0; s < c.batch; ++s) {
            batch.push_back(
                {.seq_id = s, .tokens = prompts[static_cast<size_t>(s)], .start_pos = 0});
            tables.Place(s, &batch.back());
        }
        auto t0 = Clock::now();
        Status st = runner.Forward(batch, &logits);
        const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
        std::vector<int32_t> next(static_cast<size_t>(c.batch));
        double decode_s = 0;
        const double comm_s0 = runner.comm_stats().seconds;
        for (int64_t step = 0; st.ok() && step < c.decode_tokens; ++step) {
            for (int64_t s = 0; s < c.batch; ++s) {
                next[static_cast<size_t>(s)] = Sampler::Argmax(&logits[s * vocab], vocab);
                batch[static_cast<size_t>(s)].tokens =
                    std::span<const int32_t>(&next[static_cast<size_t>(s)], 1);
                batch[static_cast<size_t>(s)].start_pos = c.prompt_tokens + step;
                tables.Place(s, &batch[static_cast<size_t>(s)]);
            }
            t0 = Clock::now();
            st = runner.Forward(batch, &logits);
            decode_s += std::chrono::duration<double>(Clock::now() - t0).count();
        }
        KV_RETURN_IF_ERROR(st);
        f.prefill_runs.push_back(static_cast<double>(c.batch * c.prompt_tokens) / prefill_s);
        if (c.decode_tokens > 0) {
            f.decode_runs.push_back(static_cast<double>(c.batch * c.decode_tokens) / decode_s);
            comm_fractions.push_back((runner.comm_stats().seconds - comm_s0) / decode_s);
        }
    }
    f.prefill_tokens_per_second = Median(f.prefill_runs);
    f.decode_tokens_per_second = Median(f.decode_runs);
    f.decode_comm_fraction = Median(comm_fractions);
    return f;
}

Result<ThroughputFigures> MeasureThroughput(TpGroup& group, const ThroughputConfig& config) {
    ThroughputFigures rank0;
    KV_RETURN_IF_ERROR(group.RunOnEveryRank([&](int rank, ModelRunner& runner) -> Status {
        KV_ASSIGN_OR_RETURN(ThroughputFigures f, MeasureThroughput(runner, config));
        if (rank == 0) rank0 = std::move(f);
        return Status::Ok();
    }));
    return rank0;
}

}  // namespace kvshard
