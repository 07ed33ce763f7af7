// InstanceEngine's part in disaggregated serving: the transfer ops of its plans and the moves of
// requests between a prefill and a decode instance (the protocol is described in engine.h).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/engine.h"
#include "coordinator/engine_state.h"

namespace kvshard {
void InstanceEngine::AcceptHandoff(std::unique_ptr<Handoff> handoff) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!stopping_) {
            num_queued_++;
            handoffs_in_.push_back(std::move(handoff));
            handoff = nullptr;
        }
    }
    if (handoff == nullptr) {
        cv_.notify_one();
        return;
    }
    InstanceEngine* source = handoff->source;
    const uint64_t id = handoff->transfer_id;
    source->FinishHandoff(
        id, std::move(handoff),
        Status(StatusCode::kUnavailable, "decode instance " + config_.name + " is stopping"));
}

void InstanceEngine::FinishHandoff(uint64_t transfer_id, std::unique_ptr<Handoff> returned,
                                   const Status& status) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!stopping_) {
            handoffs_done_.push_back({transfer_id, std::move(returned), status});
            returned = nullptr;
        }
    }
    if (returned == nullptr) {
        cv_.notify_one();
        return;
    }
    // Both instances are going away: the request ends here, on the caller's thread.
    if (returned->state != nullptr) {
        const Status stopped(StatusCode::kUnavailable, "the engine stopped");
        ObserveFinished(*returned->state, stopped);
        returned->state->sink->OnFinish(returned->state->usage, stopped);
    }
}

void InstanceEngine::DiscardTransfer(uint64_t transfer_id) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        discards_.push_back(transfer_id);
    }
    cv_.notify_one();
}

void InstanceEngine::ReadyTransfer(uint64_t transfer_id) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        readies_.push_back(transfer_id);
    }
    cv_.notify_one();
}

void InstanceEngine::AddTransferOps(StepPlan* plan) {
    const bool pairs = config_.handoff.path == KvHandoffPath::kNccl;
    {
        // Under one lock: a transfer readied before it was discarded is in this plan or an
        // earlier one, and the workers take kv_ready before kv_discards.
        std::lock_guard<std::mutex> lock(mu_);
        plan->kv_discards.swap(discards_);
        plan->kv_ready.swap(readies_);
    }
    const int64_t bs = config_.blocks.block_size;
    for (const ScheduledSequence& s : plan->sequences) {
        auto where = by_seq_.find(s.seq_id);
        if (where == by_seq_.end()) continue;
        RequestState& r = *where->second.first;
        const Sequence& seq = *r.choices[static_cast<size_t>(where->second.second)];
        const int64_t end = s.start_pos + static_cast<int64_t>(s.token_ids.size());
        if (r.handoff_to != nullptr && s.sample && seq.num_generated == 0 &&
            end == seq.num_prompt_tokens) {
            const InstanceEngineConfig& dst = r.handoff_to->config();
            plan->kv_sends.push_back({.transfer_id = r.transfer_id,
                                      .seq_id = s.seq_id,
                                      .block_table = s.block_table,
                                      .group_block_tables = s.group_block_tables,
                                      .num_tokens = seq.num_prompt_tokens,
                                      .dst_tp = dst.tp,
                                      .dst_endpoints = r.handoff_to->kv_endpoints(),
                                      .layerwise = config_.handoff.layerwise,
                                      .timeout_ms = config_.handoff.timeout_ms,
                                      .dst_instance = dst.name});
        }
        if (seq.num_incoming_tokens > 0 && s.start_pos == seq.num_incoming_tokens) {
            KvRecvOp op{.transfer_id = r.transfer_id,
                        .seq_id = s.seq_id,
                        .block_table = {},
                        .group_block_tables = {},
                        .num_tokens = seq.num_incoming_tokens,
                        .timeout_ms = config_.handoff.timeout_ms,
                        .src_instance = r.handoff_from->config().name};
            const auto num_blocks = static_cast<size_t>((seq.num_incoming_tokens + bs - 1) / bs);
            // Blocks matched in this instance's prefix cache are shared: keep them as they are.
            // (Entries a window released at admission are kNoBlock already; the workers receive
            // only the entries the window reads, worker/kv_handoff.h FirstHandoffEntry.)
            const auto shared = static_cast<size_t>(seq.admitted_cached_tokens / bs);
            auto receiving = [&](const std::vector<int32_t>& table) {
                std::vector<int32_t> out(table.begin(),
                                         table.begin() + static_cast<ptrdiff_t>(num_blocks));
                for (size_t i = 0; i < std::min(shared, num_blocks); ++i) out[i] = kv::kNoBlock;
                return out;
            };
            op.block_table = receiving(s.block_table);
            for (const std::vector<int32_t>& table : s.group_block_tables)
                op.group_block_tables.push_back(receiving(table));
            // The pair path's "ready for T": the sending instance's workers send T once told,
            // and this plan's receive waits for it (worker/kv_handoff_pairs.h).
            if (pairs) r.handoff_from->ReadyTransfer(r.transfer_id);
            plan->kv_recvs.push_back(std::move(op));
        }
    }
}

void InstanceEngine::HandleTransfers(const StepPlan& plan, const StepResult& result) {
    auto failure = [&](uint64_t id) -> const TransferFailure* {
        for (const TransferFailure& f : result.failed_transfers) {
            if (f.transfer_id == id) return &f;
        }
        return nullptr;
    };
    // Prefill side: a send that failed means the request simply stays here.
    for (const KvSendOp& op : plan.kv_sends) {
        const TransferFailure* f = failure(op.transfer_id);
        if (f == nullptr) continue;
        auto where = by_seq_.find(op.seq_id);
        if (where == by_seq_.end()) continue;
        RequestState& r = *where->second.first;
        spdlog::warn("[{}] request {}: sending its KV to {} failed ({}); decoding it here",
                     config_.name, r.request.request_id, r.handoff_to->config().name,
                     f->status().ToString());
        if (f->pairs_down && config_.pair_health != nullptr) {
            config_.pair_health->OnPairsDown(config_.name, r.handoff_to->config().name,
                                             f->pairs_first_transfer, f->status());
        }
        r.handoff_to->DiscardTransfer(r.transfer_id);
        // The pair path: other pairs of this instance may hold an offer of it.
        if (config_.handoff.path == KvHandoffPath::kNccl) DiscardTransfer(r.transfer_id);
        r.handoff_to = nullptr;
        if (config_.observer != nullptr) config_.observer->OnKvTransferFailed(f->status());
    }
    // Decode side.
    for (const KvRecvOp& op : plan.kv_recvs) {
        auto where = by_seq_.find(op.seq_id);
        if (where == by_seq_.end()) continue;  // aborted during the step
        RequestState& r = *where->second.first;
        if (const TransferFailure* f = failure(op.transfer_id); f != nullptr) {
            spdlog::warn("[{}] request {}: receiving its KV failed ({}); it goes back to {}",
                         config_.name, r.request.request_id, f->status().ToString(),
                         r.handoff_from->config().name);
            if (config_.observer != nullptr) config_.observer->OnKvTransferFailed(f->status());
            if (f->pairs_down && config_.pair_health != nullptr) {
                config_.pair_health->OnPairsDown(r.handoff_from->config().name, config_.name,
                                                 f->pairs_first_transfer, f->status());
            }
            ReturnHandoff(r.request.request_id, f->status());
            continue;
        }
        r.choices[0]->num_incoming_tokens = 0;
        if (config_.pair_health != nullptr) {
            config_.pair_health->OnPairsTransferred(r.handoff_from->config().name, config_.name);
        }
        if (config_.observer != nullptr) {
            config_.observer->OnKvTransfer(result.kv_bytes_received, clock_.SecondsSince(r.handoff_ready));
        }
        r.handoff_from->FinishHandoff(r.transfer_id, nullptr, Status::Ok());
    }
}

void InstanceEngine::HandOff(RequestState& r) {
    Sequence* seq = r.choices[0].get();
    scheduler_.Detach(seq);
    by_seq_.erase(seq->seq_id);
    handed_off_[r.transfer_id] = seq->seq_id;
    auto h = std::make_unique<Handoff>();
    h->transfer_id = r.transfer_id;
    h->source = this;
    h->src_seq_id = seq->seq_id;
    h->ready = clock_.Now();
    InstanceEngine* decode = r.handoff_to;
    const std::string id = r.request.request_id;
    h->state = std::move(requests_.at(id));
    requests_.erase(id);
    {
        std::lock_guard<std::mutex> lock(mu_);
        num_queued_--;
    }
    spdlog::debug("[{}] request {}: prefilled, handing off to {} (transfer {})", config_.name, id,
                  decode->config().name, h->transfer_id);
    decode->AcceptHandoff(std::move(h));
}

void InstanceEngine::AdmitHandoff(std::unique_ptr<Handoff> h) {
    std::unique_ptr<RequestState> state = std::move(h->state);
    RequestState& r = *state;
    const std::string id = r.request.request_id;
    if (auto it = std::find(unknown_aborts_.begin(), unknown_aborts_.end(), id);
        it != unknown_aborts_.end()) {
        // The client went away while the request was on its way here.
        unknown_aborts_.erase(it);
        {
            std::lock_guard<std::mutex> lock(mu_);  // DiscardTransfer pushes from other threads
            discards_.push_back(h->transfer_id);
        }
        h->source->FinishHandoff(h->transfer_id, nullptr, Status::Ok());
        GenerationDelta d;
        d.finish_reason = FinishReason::kAbort;
        r.last_finish = FinishReason::kAbort;
        r.sink->OnDelta(d);
        ObserveFinished(r, Status::Ok());
        r.sink->OnFinish(r.usage, Status::Ok());
        std::lock_guard<std::mutex> lock(mu_);
        num_queued_--;
        return;
    }
    Sequence* seq = r.choices[0].get();
    seq->seq_id = next_seq_id_++;
    seq->num_incoming_tokens = seq->num_prompt_tokens;
    seq->num_computed = 0;
    r.handoff_to = nullptr;
    r.handoff_from = h->source;
    r.src_seq_id = h->src_seq_id;
    r.transfer_id = h->transfer_id;
    r.handoff_ready = h->ready;
    by_seq_[seq->seq_id] = {&r, 0};
    scheduler_.AddWaiting(seq);
    requests_[id] = std::move(state);
}

void InstanceEngine::ReturnHandoff(const std::string& request_id, const Status& status) {
    auto it = requests_.find(request_id);
    KV_CHECK(it != requests_.end()) << request_id;
    RequestState& r = *it->second;
    Sequence* seq = r.choices[0].get();
    scheduler_.Remove(seq);  // frees this instance's blocks
    by_seq_.erase(seq->seq_id);
    {
        std::lock_guard<std::mutex> lock(mu_);
        discards_.push_back(r.transfer_id);
        num_queued_--;
    }
    seq->seq_id = r.src_seq_id;
    seq->num_incoming_tokens = 0;
    auto h = std::make_unique<Handoff>();
    h->transfer_id = r.transfer_id;
    h->source = r.handoff_from;
    h->src_seq_id = r.src_seq_id;
    h->state = std::move(it->second);
    requests_.erase(it);
    InstanceEngine* source = h->source;
    const uint64_t transfer_id = h->transfer_id;
    source->FinishHandoff(transfer_id, std::move(h), status);
}

void InstanceEngine::ResumeHandoff(uint64_t transfer_id, std::unique_ptr<Handoff> returned,
                                   const Status& status) {
    auto it = handed_off_.find(transfer_id);
    // Not found: this side already released the blocks (the decode instance had the KV and
    // failed later, or this instance's workers re-formed since: CheckEpoch); the request comes
    // back to be recomputed here.
    const bool holds_kv = it != handed_off_.end();
    const int64_t seq_id = holds_kv ? it->second : next_seq_id_++;
    if (holds_kv) handed_off_.erase(it);
    if (config_.handoff.path == KvHandoffPath::kNccl) {
        // The pair path's senders may still hold an offer the decode side never asked for (it
        // was aborted before its receive was planned): the workers drop it (a no-op once sent).
        std::lock_guard<std::mutex> lock(mu_);
        discards_.push_back(transfer_id);
    }
    if (returned == nullptr) {
        // Not held: released when this instance's workers re-formed (CheckEpoch).
        if (holds_kv) scheduler_.ReleaseDetached(seq_id);  // full blocks stay in the prefix cache
        return;
    }
    std::unique_ptr<RequestState> state = std::move(returned->state);
    RequestState& r = *state;
    const std::string id = r.request.request_id;
    Sequence* seq = r.choices[0].get();
    seq->seq_id = seq_id;
    r.handoff_to = nullptr;
    r.handoff_from = nullptr;
    by_seq_[seq_id] = {&r, 0};
    if (holds_kv) {
        spdlog::warn("[{}] request {}: handoff failed ({}); decoding it here", config_.name, id,
                     status.ToString());
        scheduler_.Reattach(seq);
    } else {
        // As after a preemption: prompt and generated tokens are prefilled again, then decoding
        // continues (the sampler from the state the decode side last reported).
        spdlog::warn("[{}] request {}: its decode instance failed ({}); recomputing its {} tokens here",
                     config_.name, id, status.ToString(), seq->num_tokens());
        seq->num_computed = 0;
        seq->num_preemptions++;
        scheduler_.AddWaiting(seq);
    }
    requests_[id] = std::move(state);
    std::lock_guard<std::mutex> lock(mu_);
    num_queued_++;
    // Aborted while it was away: abort it now that it is here again.
    if (auto it = std::find(unknown_aborts_.begin(), unknown_aborts_.end(), id);
        it != unknown_aborts_.end()) {
        unknown_aborts_.erase(it);
        aborts_.push_back(id);
    }
}

}  // namespace kvshard
