#include "coordinator/step_log.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

namespace kvshard {

StepShape ShapeOfStep(const StepPlan& plan, const std::vector<int64_t>& previous_seq_ids) {
    StepShape shape;
    for (const ScheduledSequence& s : plan.sequences) {
        const auto q = static_cast<int64_t>(s.token_ids.size());
        if (q == 0) continue;
        if (q == 1 && s.start_pos > 0) {
            ++shape.decode_seqs;
        } else {
            shape.prefill_tokens += q;
            shape.prefill_pairs += q * s.start_pos + q * (q + 1) / 2;
            shape.cached_chunks +=
                s.start_pos > 0 && !std::binary_search(previous_seq_ids.begin(),
                                                       previous_seq_ids.end(), s.seq_id)
                    ? 1
                    : 0;
        }
        shape.kv_tokens += s.start_pos + q;
    }
    shape.multi_row = shape.prefill_tokens + shape.decode_seqs >= 2 ? 1 : 0;
    shape.prefill_step = shape.prefill_tokens > 0 ? 1 : 0;
    return shape;
}

std::string StepLogLine(const StepLogPoint& p) {
    const nlohmann::json line = {
        {"instance", p.instance},
        {"prefill_tokens", p.shape.prefill_tokens},
        {"decode_seqs", p.shape.decode_seqs},
        {"kv_tokens", p.shape.kv_tokens},
        {"prefill_pairs", p.shape.prefill_pairs},
        {"cached_chunks", p.shape.cached_chunks},
        {"multi_row", p.shape.multi_row},
        {"decodes_since_prefill", p.shape.decodes_since_prefill},
        {"prefill_step", p.shape.prefill_step},
        {"seconds", p.seconds},
        {"execute_seconds", p.execute_seconds},
        {"start_clock_s", p.start_clock_s},
    };
    return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Result<std::unique_ptr<StepLog>> StepLog::Open(const std::string& path) {
    std::FILE* file = std::fopen(path.c_str(), "w");
    if (file == nullptr) {
        return InvalidArgument("--step-log " + path + ": cannot write (" + std::strerror(errno) +
                               ")");
    }
    return std::unique_ptr<StepLog>(new StepLog(file));
}

StepLog::~StepLog() { std::fclose(file_); }

void StepLog::Write(const StepLogPoint& point) {
    const std::string line = StepLogLine(point) + "\n";
    std::lock_guard<std::mutex> lock(mu_);
    std::fwrite(line.data(), 1, line.size(), file_);
    std::fflush(file_);
}

StepLogExecutor::StepLogExecutor(StepExecutor& inner, StepLog& log, std::string instance,
                                 const Clock& clock)
    : inner_(inner), log_(log), instance_(std::move(instance)), clock_(clock) {}

Result<StepResult> StepLogExecutor::Execute(const StepPlan& plan) {
    const Clock::time_point start = clock_.Now();
    std::vector<int64_t> seq_ids;
    seq_ids.reserve(plan.sequences.size());
    for (const ScheduledSequence& s : plan.sequences) seq_ids.push_back(s.seq_id);
    std::sort(seq_ids.begin(), seq_ids.end());

    if (has_previous_) {
        // The engine plans the next step at once while a sequence of this one still runs; only
        // then is the gap between the two starts one busy cycle.
        std::vector<int64_t> common;
        std::set_intersection(previous_seq_ids_.begin(), previous_seq_ids_.end(), seq_ids.begin(),
                              seq_ids.end(), std::back_inserter(common));
        if (!common.empty()) {
            log_.Write({.instance = instance_,
                        .shape = previous_shape_,
                        .seconds = std::chrono::duration<double>(start - previous_start_).count(),
                        .execute_seconds = previous_execute_s_,
                        .start_clock_s = std::chrono::duration<double>(
                                             previous_start_.time_since_epoch())
                                             .count()});
        }
    }

    // The shape before the previous step's sequences are replaced (after a failed step: none).
    StepShape shape = ShapeOfStep(plan, has_previous_ ? previous_seq_ids_ : std::vector<int64_t>{});
    // The simulator counts alike (sim/cpu_profile.h NextDecodesSincePrefill), over every step.
    if (shape.prefill_tokens > 0) {
        decodes_since_prefill_ = 0;
    } else if (shape.decode_seqs > 0) {
        ++decodes_since_prefill_;
    }
    shape.decodes_since_prefill = decodes_since_prefill_;
    Result<StepResult> result = inner_.Execute(plan);
    has_previous_ = result.ok() && StepError(*result).ok();
    if (has_previous_) {
        previous_shape_ = shape;
        previous_seq_ids_ = std::move(seq_ids);
        previous_start_ = start;
        previous_execute_s_ = clock_.SecondsSince(start);
    }
    return result;
}

}  // namespace kvshard
