#include "worker/steps_after_gap.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "worker/sampler.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

using SteadyClock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

double MsSince(SteadyClock::time_point t0) {
    return std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
}

int64_t MinorFaults() {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
}

// Reads every cache line of `buffer` once; the sum keeps the reads from being dropped.
uint64_t ReadThrough(const std::vector<uint64_t>& buffer) {
    uint64_t sum = 0;
    for (size_t i = 0; i < buffer.size(); i += 8) sum += buffer[i];
    return sum;
}

constexpr int64_t kDecodingSeq = 0;  // the sequence whose steps are timed
constexpr int64_t kOtherSeq = 1;     // the one the prefill gap prefills

}  // namespace

std::string_view StepGapName(StepGap gap) {
    switch (gap) {
        case StepGap::kNone:
            return "none";
        case StepGap::kPrefill:
            return "prefill";
        case StepGap::kIdle:
            return "idle";
        case StepGap::kSpin:
            return "spin";
        case StepGap::kWarm:
            return "warm";
        case StepGap::kEvict:
            return "evict";
    }
    return "?";
}

Result<StepGap> ParseStepGap(std::string_view name) {
    for (StepGap g : {StepGap::kNone, StepGap::kPrefill, StepGap::kIdle, StepGap::kSpin,
                      StepGap::kWarm, StepGap::kEvict}) {
        if (name == StepGapName(g)) return g;
    }
    return InvalidArgument("step gap '" + std::string(name) +
                           "' is not one of none, prefill, idle, spin, warm, evict");
}

int64_t StepsAfterGapTokensPerSequence(const StepsAfterGapConfig& c) {
    return std::max(c.context + c.steps, c.prefill_tokens);
}

Result<std::vector<StepPositionFigures>> MeasureStepsAfterGap(ModelRunner& runner,
                                                              const StepsAfterGapConfig& c) {
    if (c.context <= 0 || c.steps <= 0 || c.repeats <= 0 || c.prefill_tokens <= 0 ||
        c.idle_ms < 0 || c.evict_bytes <= 0 || c.gaps.empty()) {
        return InvalidArgument(
            "steps after a gap: context, steps, repeats, prefill tokens and evict bytes must be "
            "positive, idle ms not negative, and at least one gap given");
    }
    const int64_t per_seq = StepsAfterGapTokensPerSequence(c);
    if (per_seq > runner.max_context()) {
        return InvalidArgument("steps after a gap: " + std::to_string(per_seq) +
                               " tokens per sequence exceed the context of " +
                               std::to_string(runner.max_context()));
    }
    FixedBlockTables tables(2, per_seq, runner.pool()->config().block_size,
                            runner.kv_groups().num_groups());
    if (tables.num_blocks() > runner.pool()->config().num_blocks) {
        return InvalidArgument("steps after a gap: the KV pool of " +
                               std::to_string(runner.pool()->config().num_blocks) +
                               " blocks cannot hold two sequences of " + std::to_string(per_seq) +
                               " tokens (" + std::to_string(tables.num_blocks()) + " blocks)");
    }
    const int64_t vocab = runner.spec().vocab_size;
    // Deterministic pseudo-random prompts, as MeasureThroughput's.
    uint64_t state = 0x9E3779B97F4A7C15ULL;
    auto prompt = [&](int64_t n) {
        std::vector<int32_t> ids;
        for (int64_t i = 0; i < n; ++i) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            ids.push_back(static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab)));
        }
        return ids;
    };
    const std::vector<int32_t> decoding_prompt = prompt(c.context);
    const std::vector<int32_t> other_prompt = prompt(c.prefill_tokens);
    std::vector<float> logits;
    SequenceChunk chunk;
    chunk.seq_id = kDecodingSeq;
    chunk.tokens = decoding_prompt;
    tables.Place(kDecodingSeq, &chunk);
    KV_RETURN_IF_ERROR(runner.Forward(std::span<const SequenceChunk>(&chunk, 1), &logits));
    const int32_t first_token = Sampler::Argmax(logits.data(), vocab);

    std::vector<uint64_t> evict;
    if (std::find(c.gaps.begin(), c.gaps.end(), StepGap::kEvict) != c.gaps.end()) {
        evict.assign(static_cast<size_t>(c.evict_bytes / 8), 1);
    }
    uint64_t sink = 0;
    auto run_gap = [&](StepGap gap) -> Status {
        switch (gap) {
            case StepGap::kNone:
                return Status::Ok();
            case StepGap::kPrefill: {
                SequenceChunk other;
                other.seq_id = kOtherSeq;
                other.tokens = other_prompt;
                tables.Place(kOtherSeq, &other);
                return runner.Forward(std::span<const SequenceChunk>(&other, 1), &logits);
            }
            case StepGap::kIdle:
                std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(c.idle_ms));
                return Status::Ok();
            case StepGap::kSpin: {
                const SteadyClock::time_point t0 = SteadyClock::now();
                while (MsSince(t0) < c.idle_ms) {
                }
                return Status::Ok();
            }
            case StepGap::kWarm: {
                const SteadyClock::time_point t0 = SteadyClock::now();
                while (MsSince(t0) < c.idle_ms) {
                    SequenceChunk step;
                    step.seq_id = kDecodingSeq;
                    step.tokens = std::span<const int32_t>(&first_token, 1);
                    step.start_pos = c.context;
                    tables.Place(kDecodingSeq, &step);
                    KV_RETURN_IF_ERROR(
                        runner.Forward(std::span<const SequenceChunk>(&step, 1), &logits));
                    const double left = c.idle_ms - MsSince(t0);
                    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(
                        std::max(0.0, std::min(kWarmEveryMs, left))));
                }
                return Status::Ok();
            }
            case StepGap::kEvict:
                sink += ReadThrough(evict);
                return Status::Ok();
        }
        return Status::Ok();
    };

    const size_t kinds = c.gaps.size();
    // [kind][position][repeat]
    std::vector<std::vector<std::vector<double>>> ms(
        kinds, std::vector<std::vector<double>>(static_cast<size_t>(c.steps)));
    std::vector<std::vector<std::vector<double>>> faults = ms;
    std::vector<std::vector<double>> gap_ms(kinds);
    // The tokens every round decodes: the same context and KV each time, whatever ran before.
    std::vector<int32_t> reference;
    std::vector<int32_t> decoded;
    for (int64_t repeat = -1; repeat < c.repeats; ++repeat) {
        for (size_t kind = 0; kind < kinds; ++kind) {
            const SteadyClock::time_point g0 = SteadyClock::now();
            KV_RETURN_IF_ERROR(run_gap(c.gaps[kind]));
            const double g = MsSince(g0);
            if (repeat >= 0) gap_ms[kind].push_back(g);
            int32_t token = first_token;
            decoded.clear();
            for (int64_t s = 0; s < c.steps; ++s) {
                SequenceChunk step;
                step.seq_id = kDecodingSeq;
                step.tokens = std::span<const int32_t>(&token, 1);
                step.start_pos = c.context + s;
                tables.Place(kDecodingSeq, &step);
                const int64_t f0 = MinorFaults();
                const SteadyClock::time_point t0 = SteadyClock::now();
                KV_RETURN_IF_ERROR(
                    runner.Forward(std::span<const SequenceChunk>(&step, 1), &logits));
                const double t = MsSince(t0);
                if (repeat >= 0) {
                    ms[kind][static_cast<size_t>(s)].push_back(t);
                    faults[kind][static_cast<size_t>(s)].push_back(
                        static_cast<double>(MinorFaults() - f0));
                }
                token = Sampler::Argmax(logits.data(), vocab);
                decoded.push_back(token);
            }
            if (reference.empty()) reference = decoded;
            if (decoded != reference) {
                return Internal("steps after a gap: the tokens decoded after a " +
                                std::string(StepGapName(c.gaps[kind])) +
                                " gap differ from the first round's");
            }
        }
    }
    std::vector<StepPositionFigures> out;
    for (size_t kind = 0; kind < kinds; ++kind) {
        StepPositionFigures f;
        f.gap = c.gaps[kind];
        f.gap_ms = Median(gap_ms[kind]);
        f.tokens = reference;
        for (int64_t s = 0; s < c.steps; ++s) {
            f.step_ms.push_back(Median(ms[kind][static_cast<size_t>(s)]));
            f.minor_faults.push_back(Median(faults[kind][static_cast<size_t>(s)]));
        }
        out.push_back(std::move(f));
    }
    // The evict gap's reads are used (a volatile store), so that they are not optimized away.
    volatile uint64_t used = sink;
    (void)used;
    return out;
}

Result<std::vector<StepPositionFigures>> MeasureStepsAfterGap(TpGroup& group,
                                                              const StepsAfterGapConfig& config) {
    std::vector<StepPositionFigures> rank0;
    KV_RETURN_IF_ERROR(group.RunOnEveryRank([&](int rank, ModelRunner& runner) -> Status {
        KV_ASSIGN_OR_RETURN(std::vector<StepPositionFigures> f,
                            MeasureStepsAfterGap(runner, config));
        if (rank == 0) rank0 = std::move(f);
        return Status::Ok();
    }));
    return rank0;
}

}  // namespace kvshard
