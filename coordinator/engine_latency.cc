// InstanceEngine's latency observations: the one place where a request's time to first token,
// inter-token gaps, end-to-end latency and phases are measured — on the engine's clock, from the
// request's one arrival time (GenerationRequest::arrival) — and reported to the EngineObserver
// (coordinator/metrics.h). The HTTP layer measures nothing; it only reads the metrics.
#include <algorithm>
#include <chrono>
#include <string>

#include "coordinator/engine.h"
#include "coordinator/engine_state.h"

namespace kvshard {
namespace {

double Seconds(Clock::duration d) {
    return std::max(0.0, std::chrono::duration<double>(d).count());
}

}  // namespace

void InstanceEngine::ObserveScheduled(const StepPlan& plan) {
    if (config_.observer == nullptr) return;
    const auto now = clock_.Now();
    for (const ScheduledSequence& s : plan.sequences) {
        auto where = by_seq_.find(s.seq_id);
        if (where == by_seq_.end()) continue;
        RequestState& r = *where->second.first;
        if (!r.first_scheduled) r.first_scheduled = now;
    }
}

void InstanceEngine::ObserveFinished(const RequestState& r, const Status& status) const {
    if (config_.observer == nullptr) return;
    const auto now = clock_.Now();
    const auto scheduled = r.first_scheduled.value_or(now);
    const auto first = r.first_token.value_or(scheduled);
    const auto last = r.first_token ? r.last_any_token : first;
    FinishedRequestStats st;
    st.e2e_seconds = Seconds(now - r.arrival);
    st.queue_seconds = Seconds(scheduled - r.arrival);
    st.prefill_seconds = Seconds(first - scheduled);
    st.decode_seconds = Seconds(last - first);
    st.inference_seconds = st.prefill_seconds + st.decode_seconds;
    st.failed = !status.ok();
    st.finished_reason = st.failed       ? "error"
                         : r.last_finish ? std::string(FinishReasonName(*r.last_finish))
                                         : "abort";
    st.prompt_tokens = r.usage.prompt_tokens;
    st.generation_tokens = r.usage.completion_tokens;
    st.cache_creation_tokens = r.usage.cache_creation_tokens;
    st.n = r.request.n;
    st.max_tokens = r.request.max_tokens;
    config_.observer->OnRequestFinished(st);
}

void InstanceEngine::ObserveToken(RequestState& r, int index) {
    if (config_.observer == nullptr) return;
    const auto now = clock_.Now();
    if (r.last_token.size() < r.choices.size()) r.last_token.resize(r.choices.size());
    std::optional<Clock::time_point>& last = r.last_token[static_cast<size_t>(index)];
    if (!r.first_token) {
        r.first_token = now;
        config_.observer->OnFirstToken(config_.pool, Seconds(now - r.arrival));
    } else if (last) {
        // After a handoff the decode instance's first token counts from the prefill
        // instance's: the gap the client saw.
        config_.observer->OnInterToken(config_.pool, Seconds(now - *last));
    }
    last = now;
    r.last_any_token = now;
}

}  // namespace kvshard
