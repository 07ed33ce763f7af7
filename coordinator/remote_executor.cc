// Process mode, the step path and recovery (coordinator/remote_executor.h): RemoteStepExecutor
// waits for its instance's ranks to be Ready (serving their rendezvous store meanwhile), runs
// each step on every rank and merges the results, and fails, re-forms or shuts the instance down.
// The registrations that fill its slots are taken by WorkerRegistry (worker_registry.cc).
#include "coordinator/remote_executor.h"

#include <algorithm>
#include <optional>
#include <variant>

#include "comm/collective_store.h"
#include "common/logging.h"
#include "coordinator/remote_slots.h"

namespace kvshard {

using SteadyClock = std::chrono::steady_clock;

namespace {

std::string RankList(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
}

// The answer to one StoreRequest of a forming instance's rank.
StoreReplyMessage ServeStore(MemoryCollectiveStore& store, const StoreRequestMessage& request) {
    StoreReplyMessage reply;
    if (request.set) {
        const Status set = store.Set(request.key, request.value);
        if (!set.ok()) reply.error = set.message();
        return reply;
    }
    const Status valid = CheckCollectiveStoreEntry(request.key, "");
    if (!valid.ok()) {
        reply.error = valid.message();
        return reply;
    }
    std::optional<std::string> value = store.Find(request.key);
    reply.found = value.has_value();
    if (value.has_value()) reply.value = std::move(*value);
    return reply;
}

}  // namespace

// ---- RemoteStepExecutor ----

RemoteStepExecutor::RemoteStepExecutor(std::shared_ptr<WorkerRegistry::Slots> slots)
    : slots_(std::move(slots)) {}

RemoteStepExecutor::~RemoteStepExecutor() {
    Shutdown("the coordinator's executor for the instance was destroyed");
    std::vector<std::unique_ptr<FrameChannel>> channels;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        slots_->closed = true;
        channels = std::move(slots_->channels);
        slots_->Reset();
        slots_->cv.notify_all();  // a registration held for a re-form gives up now
    }
    std::lock_guard<std::mutex> update_lock(update_mu_);  // UpdateRankSettings let go of them
    channels.clear();  // joins their I/O threads, outside the lock
}

const std::string& RemoteStepExecutor::instance_id() const { return slots_->options.instance_id; }
int RemoteStepExecutor::tp() const { return slots_->options.tp; }

Status RemoteStepExecutor::status() const {
    std::lock_guard<std::mutex> lock(slots_->mu);
    return slots_->failed;
}

uint64_t RemoteStepExecutor::epoch() const {
    std::lock_guard<std::mutex> lock(slots_->mu);
    return slots_->epoch;
}

Status RemoteStepExecutor::Health() const {
    uint64_t generation = 0;
    int dead_rank = -1;
    Status dead;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        if (!slots_->failed.ok()) return slots_->failed;
        if (!slots_->formed)
            return Unavailable("instance " + instance_id() + ": workers not ready");
        generation = slots_->generation;
        for (int r = 0; r < tp() && dead_rank < 0; ++r) {
            const FrameChannel* c = slots_->channels[static_cast<size_t>(r)].get();
            const Status s = c != nullptr ? c->status() : Unavailable("no channel");
            if (!s.ok()) {
                dead_rank = r;
                dead = s;
            }
        }
    }
    if (dead_rank < 0) return Status::Ok();
    return Fail(generation, RankError(dead_rank, "connection lost", dead));
}

Status RemoteStepExecutor::UpdateRankSettings(
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_settings) {
    if (rank_settings.size() != static_cast<size_t>(tp())) {
        return InvalidArgument("instance " + instance_id() + ": rank settings for " +
                               std::to_string(rank_settings.size()) + " ranks, tp " +
                               std::to_string(tp()));
    }
    std::vector<std::pair<FrameChannel*, RankSettingsMessage>> tell;
    // Held until the sends are done: BeginReform and the destructor destroy channels only after.
    std::lock_guard<std::mutex> update_lock(update_mu_);
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        slots_->rank_settings = std::move(rank_settings);
        slots_->settings_version++;
        for (size_t r = 0; r < slots_->channels.size(); ++r) {
            // Not Ready yet: WaitFormed tells it when its Ready arrives (its channel is read
            // there until then: a Gloo group's store requests).
            if (slots_->channels[r] == nullptr || !slots_->ready[r]) continue;
            slots_->rank_settings_version[r] = slots_->settings_version;
            tell.emplace_back(slots_->channels[r].get(),
                              RankSettingsMessage{slots_->rank_settings[r]});
        }
    }
    // Sent outside slots_->mu (Send is thread-safe). A failed send is the channel's failure:
    // Health() reports it.
    for (auto& [channel, message] : tell) {
        const Status sent = channel->Send(message);
        if (!sent.ok()) {
            spdlog::warn("instance {}: new rank settings not sent: {}", instance_id(),
                         sent.ToString());
        }
    }
    return Status::Ok();
}

std::vector<std::string> RemoteStepExecutor::kv_endpoints() const {
    std::lock_guard<std::mutex> lock(slots_->mu);
    return slots_->kv_endpoints;
}

std::vector<int64_t> RemoteStepExecutor::num_kv_blocks() const {
    std::lock_guard<std::mutex> lock(slots_->mu);
    return slots_->num_kv_blocks;
}

Status RemoteStepExecutor::RankError(int rank, const std::string& what, const Status& why) const {
    std::string peer;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        peer = slots_->peers[static_cast<size_t>(rank)];
    }
    return Unavailable("instance " + instance_id() + ": worker rank " + std::to_string(rank) +
                       (peer.empty() ? "" : " (" + peer + ")") + ": " + what + ": " +
                       why.message());
}

Status RemoteStepExecutor::Fail(uint64_t generation, Status status) const {
    std::vector<FrameChannel*> channels;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        if (generation != slots_->generation) return status;  // a formation already replaced
        if (!slots_->failed.ok() && !slots_->reforming) return slots_->failed;
        slots_->failed = status;
        slots_->formed = false;
        slots_->reforming = false;
        for (auto& c : slots_->channels) {
            if (c != nullptr) channels.push_back(c.get());
        }
        slots_->cv.notify_all();
    }
    spdlog::error("{}", status.message());
    // The surviving workers see their connection close and exit; the channels stay allocated
    // until the next BeginReform (after any Execute let go) or the executor's destruction, so a
    // concurrent Execute's Receive returns Unavailable.
    for (FrameChannel* c : channels) c->Close();
    return status;
}

void RemoteStepExecutor::Shutdown(const std::string& reason) {
    std::vector<FrameChannel*> channels;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        if (slots_->failed.ok() || slots_->reforming) {
            slots_->failed = Unavailable("instance " + instance_id() + ": shut down: " + reason);
        }
        slots_->shut_down = true;
        slots_->formed = false;
        slots_->reforming = false;
        for (auto& c : slots_->channels) {
            if (c != nullptr) channels.push_back(c.get());
        }
        slots_->cv.notify_all();
    }
    for (FrameChannel* c : channels) {
        if (c->status().ok()) (void)c->Send(ShutdownMessage{reason});
        c->Close();
    }
}

void RemoteStepExecutor::BeginReform(const std::string& reason) {
    std::vector<std::unique_ptr<FrameChannel>> old;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        if (slots_->shut_down || slots_->closed) return;
        slots_->generation++;
        slots_->failed = Unavailable("instance " + instance_id() + ": re-forming: " + reason);
        slots_->formed = false;
        slots_->reforming = true;
        old = std::move(slots_->channels);
        slots_->Reset();
        slots_->cv.notify_all();
    }
    spdlog::warn("instance {}: re-forming: {}", instance_id(), reason);
    for (auto& c : old) {
        if (c != nullptr) c->Close();  // an Execute waiting on it returns now
    }
    // The channels die only once no Execute (and no UpdateRankSettings) refers to them.
    std::lock_guard<std::mutex> execute_lock(execute_mu_);
    std::lock_guard<std::mutex> update_lock(update_mu_);
    old.clear();
}

Status RemoteStepExecutor::Reform(std::chrono::milliseconds timeout,
                                  const std::function<Status()>& check_workers) {
    bool begun = false;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        begun = slots_->reforming;
    }
    if (!begun) BeginReform("re-forming requested");
    uint64_t generation = 0;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        if (!slots_->reforming) return slots_->failed;  // shut down meanwhile
        generation = slots_->generation;
    }
    return WaitFormed(generation, timeout, check_workers);
}

Status RemoteStepExecutor::WaitReady(std::chrono::milliseconds timeout,
                                     const std::function<Status()>& check_workers) {
    uint64_t generation = 0;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        generation = slots_->generation;
    }
    return WaitFormed(generation, timeout, check_workers);
}

Status RemoteStepExecutor::WaitFormed(uint64_t generation, std::chrono::milliseconds timeout,
                                      const std::function<Status()>& check_workers) {
    const auto deadline = SteadyClock::now() + timeout;
    const int n = tp();
    for (;;) {
        std::vector<FrameChannel*> pending(static_cast<size_t>(n), nullptr);
        std::shared_ptr<MemoryCollectiveStore> store;
        {
            std::lock_guard<std::mutex> lock(slots_->mu);
            store = slots_->store;
            if (slots_->generation != generation) {
                return Unavailable("instance " + instance_id() + ": re-formed meanwhile");
            }
            if (!slots_->failed.ok() && !slots_->reforming) return slots_->failed;
            if (slots_->formed) return Status::Ok();
            for (int r = 0; r < n; ++r) {
                const auto i = static_cast<size_t>(r);
                if (!slots_->ready[i]) pending[i] = slots_->channels[i].get();
            }
        }
        // Take whatever Ready messages have arrived, and answer the rendezvous store's
        // requests, without waiting on any one rank. The channels stay alive: only this
        // thread's BeginReform or the destructor takes them out.
        for (int r = 0; r < n; ++r) {
            FrameChannel* c = pending[static_cast<size_t>(r)];
            if (c == nullptr) continue;
            Result<Message> m = c->Receive(SteadyClock::now());
            // A rank meeting its peers asks the store a few times; the answers go at once.
            while (m.ok() && std::holds_alternative<StoreRequestMessage>(*m)) {
                const Status sent = c->Send(ServeStore(*store, std::get<StoreRequestMessage>(*m)));
                if (!sent.ok()) {
                    return Fail(generation, RankError(r, "connection lost before Ready", sent));
                }
                m = c->Receive(SteadyClock::now());
            }
            if (!m.ok()) {
                if (m.status().code() == StatusCode::kDeadlineExceeded) continue;
                return Fail(generation, RankError(r, "connection lost before Ready", m.status()));
            }
            const auto* ready = std::get_if<ReadyMessage>(&*m);
            if (ready == nullptr) {
                return Fail(generation,
                            RankError(r, "protocol error",
                                      Internal("expected Ready, got " +
                                               std::string(MessageTypeName(TypeOf(*m))))));
            }
            if (!ready->ok) {
                // A rank that gave up waiting for its peers says so; name who never came.
                std::vector<int> unregistered;
                {
                    std::lock_guard<std::mutex> lock(slots_->mu);
                    for (int q = 0; q < n; ++q) {
                        if (slots_->channels[static_cast<size_t>(q)] == nullptr) {
                            unregistered.push_back(q);
                        }
                    }
                }
                const std::string missing =
                    unregistered.empty()
                        ? ""
                        : " (ranks not registered: " + RankList(unregistered) + ")";
                return Fail(generation,
                            RankError(r, "failed to load", Internal(ready->error + missing)));
            }
            std::optional<RankSettingsMessage> update;
            {
                std::lock_guard<std::mutex> lock(slots_->mu);
                const auto i = static_cast<size_t>(r);
                slots_->ready[i] = true;
                slots_->num_kv_blocks[i] = ready->num_kv_blocks;
                // Registered before an UpdateRankSettings: its lists are told now.
                if (slots_->rank_settings_version[i] != slots_->settings_version) {
                    slots_->rank_settings_version[i] = slots_->settings_version;
                    update = RankSettingsMessage{slots_->rank_settings[i]};
                }
            }
            if (update.has_value()) {
                const Status sent = c->Send(*update);
                if (!sent.ok()) {
                    return Fail(generation, RankError(r, "sending its new rank settings", sent));
                }
            }
        }
        std::vector<int> unregistered, loading;
        {
            std::lock_guard<std::mutex> lock(slots_->mu);
            for (int r = 0; r < n; ++r) {
                const auto i = static_cast<size_t>(r);
                if (slots_->channels[i] == nullptr) {
                    unregistered.push_back(r);
                } else if (!slots_->ready[i]) {
                    loading.push_back(r);
                }
            }
            if (unregistered.empty() && loading.empty() && slots_->generation == generation &&
                (slots_->failed.ok() || slots_->reforming)) {
                slots_->formed = true;
                slots_->reforming = false;
                slots_->failed = Status::Ok();
                slots_->epoch++;
                spdlog::info("instance {}: all {} worker ranks ready (epoch {})", instance_id(), n,
                             slots_->epoch);
                return Status::Ok();
            }
        }
        if (check_workers) {
            const Status alive = check_workers();
            if (!alive.ok()) {
                return Fail(generation,
                            Unavailable("instance " + instance_id() + ": " + alive.message()));
            }
        }
        if (SteadyClock::now() >= deadline) {
            std::string missing;
            if (!unregistered.empty()) missing += "ranks not registered: " + RankList(unregistered);
            if (!loading.empty()) {
                missing += std::string(missing.empty() ? "" : "; ") +
                           "ranks registered but not ready: " + RankList(loading);
            }
            return Fail(generation,
                        Status(StatusCode::kDeadlineExceeded,
                               "instance " + instance_id() + ": workers not ready after " +
                                   std::to_string(timeout.count()) + " ms (" + missing + ")"));
        }
        // Registrations wake this wait; Ready messages and exited processes are polled.
        std::unique_lock<std::mutex> lock(slots_->mu);
        const int registered = slots_->num_registered;
        slots_->cv.wait_until(
            lock, std::min(deadline, SteadyClock::now() + std::chrono::milliseconds(20)), [&] {
                return slots_->num_registered != registered ||
                       (!slots_->failed.ok() && !slots_->reforming) ||
                       slots_->generation != generation;
            });
    }
}

Result<StepResult> RemoteStepExecutor::Execute(const StepPlan& plan) {
    std::lock_guard<std::mutex> execute_lock(execute_mu_);
    const int n = tp();
    std::vector<FrameChannel*> channels(static_cast<size_t>(n));
    uint64_t generation = 0;
    {
        std::lock_guard<std::mutex> lock(slots_->mu);
        if (!slots_->failed.ok()) return slots_->failed;
        if (!slots_->formed) {
            return Internal("instance " + instance_id() + ": Execute before WaitReady");
        }
        generation = slots_->generation;
        for (int r = 0; r < n; ++r) {
            channels[static_cast<size_t>(r)] = slots_->channels[static_cast<size_t>(r)].get();
        }
    }
    const std::string step = "step " + std::to_string(plan.step_id);
    for (int r = 0; r < n; ++r) {
        const Status sent = channels[static_cast<size_t>(r)]->Send(plan);
        if (!sent.ok()) return Fail(generation, RankError(r, "sending " + step, sent));
    }
    const auto timeout = std::chrono::milliseconds(slots_->options.step_timeout_ms);
    const auto deadline = SteadyClock::now() + timeout;
    std::vector<StepResult> results(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
        Result<Message> m = channels[static_cast<size_t>(r)]->Receive(deadline);
        if (!m.ok()) {
            if (m.status().code() == StatusCode::kDeadlineExceeded) {
                return Fail(generation,
                            RankError(r, step,
                                      Status(StatusCode::kDeadlineExceeded,
                                             "no StepResult within " +
                                                 std::to_string(timeout.count()) + " ms")));
            }
            return Fail(generation, RankError(r, step, m.status()));
        }
        auto* result = std::get_if<StepResult>(&*m);
        if (result == nullptr || result->step_id != plan.step_id) {
            return Fail(
                generation,
                RankError(r, step,
                          Internal("protocol error: expected its StepResult, got " +
                                   (result == nullptr ? std::string(MessageTypeName(TypeOf(*m)))
                                                      : "the result of step " +
                                                            std::to_string(result->step_id)))));
        }
        results[static_cast<size_t>(r)] = std::move(*result);
    }

    int num_failed = 0;
    int first_failed = -1;
    for (int r = 0; r < n; ++r) {
        if (StepError(results[static_cast<size_t>(r)]).ok()) continue;
        if (first_failed < 0) first_failed = r;
        ++num_failed;
    }
    if (num_failed == n) {
        // The same error on every rank (a bad plan): found before any collective, group intact.
        // The workers' own code (a bad plan is InvalidArgument, a timed-out receive
        // DeadlineExceeded), with where it happened.
        return StepError(results[0]).WithContext("instance " + instance_id() + ": " + step);
    }
    if (num_failed > 0) {
        return Fail(
            generation,
            Internal("instance " + instance_id() + ": tensor-parallel group broken: " + step +
                     " failed on " + std::to_string(num_failed) + " of " + std::to_string(n) +
                     " ranks; rank " + std::to_string(first_failed) + ": " +
                     StepError(results[static_cast<size_t>(first_failed)]).ToString()));
    }
    StepResult merged = std::move(results[0]);
    for (int r = 1; r < n; ++r) {
        StepResult& other = results[static_cast<size_t>(r)];
        // Ranks sample alike; a rank that sent tokens must agree with rank 0 (cheap to check).
        if (!other.tokens.empty() && other.tokens != merged.tokens) {
            return Fail(generation,
                        Internal("instance " + instance_id() + ": " + step + ": rank " +
                                 std::to_string(r) + " sampled other tokens than rank 0"));
        }
        merged.kv_bytes_sent += other.kv_bytes_sent;
        merged.kv_bytes_received += other.kv_bytes_received;
        MergeTransferFailures(other.failed_transfers, &merged.failed_transfers);
    }
    return merged;
}

}  // namespace kvshard
