// Process mode, registration (coordinator/remote_executor.h): WorkerRegistry accepts worker
// connections, checks each Register (token, protocol, instance, tp, model, rank) and hands the
// accepted channel to its instance's slots; RandomWorkerToken. The executor that runs steps over
// those channels is in remote_executor.cc.
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <variant>

#include "comm/collective.h"
#include "common/build_config.h"
#include "common/check.h"
#include "common/logging.h"
#include "coordinator/remote_executor.h"
#include "coordinator/remote_slots.h"

namespace kvshard {

using SteadyClock = std::chrono::steady_clock;

namespace {

// A worker's --model against the instance's model path: a path must be the same path, a bare
// file name the path's last part (a pod may mount the same file elsewhere).
bool ModelMatches(const std::string& wanted, const std::string& served) {
    if (wanted.find('/') != std::string::npos) return wanted == served;
    const size_t slash = served.rfind('/');
    return wanted == (slash == std::string::npos ? served : served.substr(slash + 1));
}

// Compares in time that depends on the expected token's length only, not on where the first
// difference is.
bool TokenMatches(std::string_view presented, std::string_view expected) {
    unsigned diff = presented.size() == expected.size() ? 0u : 1u;
    for (size_t i = 0; i < expected.size(); ++i) {
        const unsigned char p =
            i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0u;
        diff |= p ^ static_cast<unsigned char>(expected[i]);
    }
    return diff == 0;
}

}  // namespace

std::string RandomWorkerToken() {
    unsigned char bytes[32];
    size_t got = 0;
    while (got < sizeof(bytes)) {
        const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
        if (n < 0 && errno == EINTR) continue;
        KV_CHECK(n > 0) << "getrandom failed: " << std::strerror(errno);
        got += static_cast<size_t>(n);
    }
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out;
    for (unsigned char b : bytes) {
        out.push_back(kHex[b >> 4]);
        out.push_back(kHex[b & 15]);
    }
    return out;
}

// ---- WorkerRegistry ----

WorkerRegistry::WorkerRegistry(const WorkerRegistryOptions& options) : options_(options) {}

Result<std::unique_ptr<WorkerRegistry>> WorkerRegistry::Start(
    const WorkerRegistryOptions& options) {
    KV_RETURN_IF_ERROR(ValidateFrameChannelOptions(options.channel));
    if (options.max_pending_handshakes < 1) {
        return InvalidArgument("max_pending_handshakes=" +
                               std::to_string(options.max_pending_handshakes) + " must be >= 1");
    }
    WorkerRegistryOptions o = options;
    if (o.token.empty()) o.token = RandomWorkerToken();
    std::unique_ptr<WorkerRegistry> registry(new WorkerRegistry(o));
    KV_ASSIGN_OR_RETURN(registry->listener_, FrameListener::Listen(o.host, o.port));
    registry->accept_thread_ = std::thread([r = registry.get()] { r->AcceptLoop(); });
    spdlog::info("worker registry listening on {}:{}", o.host, registry->port());
    return registry;
}

WorkerRegistry::~WorkerRegistry() {
    std::vector<std::shared_ptr<Slots>> instances;
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
        for (const auto& [id, slots] : instances_) instances.push_back(slots);
    }
    // A registration held for a re-form (HandleConnection) waits on its instance's cv: wake it,
    // so it is refused at once ("shutting down") instead of holding the join below for up to
    // register_message_timeout_ms. Set before each slots->mu is taken, so no wait misses it.
    closing_.store(true);
    for (const std::shared_ptr<Slots>& slots : instances) {
        std::lock_guard<std::mutex> lock(slots->mu);
        slots->cv.notify_all();
    }
    listener_->Close();
    if (accept_thread_.joinable()) accept_thread_.join();
    std::vector<std::thread> threads;
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (Handshake& h : handshakes_) {
            if (h.channel != nullptr) h.channel->Close();  // its Receive returns at once
            threads.push_back(std::move(h.thread));
        }
    }
    for (std::thread& t : threads) t.join();
}

uint16_t WorkerRegistry::port() const { return listener_->port(); }

Result<std::unique_ptr<RemoteStepExecutor>> WorkerRegistry::AddInstance(
    const RemoteInstanceOptions& options) {
    if (options.instance_id.empty()) return InvalidArgument("instance id must not be empty");
    if (options.tp < 1) {
        return InvalidArgument("instance " + options.instance_id + ": tp " +
                               std::to_string(options.tp) + " must be >= 1");
    }
    if (options.step_timeout_ms <= 0) {
        return InvalidArgument("instance " + options.instance_id + ": step_timeout_ms " +
                               std::to_string(options.step_timeout_ms) + " must be > 0");
    }
    if (!options.rank_settings.empty() &&
        options.rank_settings.size() != static_cast<size_t>(options.tp)) {
        return InvalidArgument("instance " + options.instance_id + ": rank_settings for " +
                               std::to_string(options.rank_settings.size()) + " ranks, tp " +
                               std::to_string(options.tp));
    }
    auto slots = std::make_shared<Slots>(options);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = instances_.find(options.instance_id);
    if (it != instances_.end()) {
        std::lock_guard<std::mutex> slots_lock(it->second->mu);
        if (!it->second->closed) {
            return InvalidArgument("instance " + options.instance_id + " is already registered");
        }
    }
    instances_[options.instance_id] = slots;
    return std::make_unique<RemoteStepExecutor>(std::move(slots));
}

std::vector<std::string> WorkerRegistry::rejections() const {
    std::lock_guard<std::mutex> lock(mu_);
    return {rejections_.begin(), rejections_.end()};
}

void WorkerRegistry::ReapHandshakes() {
    std::vector<std::thread> finished;
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto it = handshakes_.begin(); it != handshakes_.end();) {
            if (!it->done) {
                ++it;
                continue;
            }
            finished.push_back(std::move(it->thread));
            it = handshakes_.erase(it);
        }
    }
    for (std::thread& t : finished) t.join();  // each has only its return left
}

void WorkerRegistry::AcceptLoop() {
    for (;;) {
        ReapHandshakes();
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stopping_) return;
        }
        Result<std::unique_ptr<FrameChannel>> channel =
            listener_->Accept(std::chrono::milliseconds(250), options_.channel);
        if (!channel.ok()) {
            const StatusCode code = channel.status().code();
            if (code == StatusCode::kUnavailable) return;  // closed
            if (code == StatusCode::kDeadlineExceeded) continue;
            // Out of descriptors, say: the listener stays readable, so pause instead of spinning.
            spdlog::warn("worker registry: accept: {}", channel.status().ToString());
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            continue;
        }
        std::unique_lock<std::mutex> lock(mu_);
        if (pending_handshakes_ >= options_.max_pending_handshakes) {
            lock.unlock();
            Reject(**channel, "too many connections waiting to register (" +
                                  std::to_string(options_.max_pending_handshakes) + ")");
            continue;
        }
        ++pending_handshakes_;
        auto handshake = handshakes_.emplace(handshakes_.end());
        handshake->channel = channel->get();
        handshake->thread = std::thread([this, handshake, c = std::move(*channel)]() mutable {
            HandleConnection(c, handshake);
            std::unique_ptr<FrameChannel> refused;
            {
                std::lock_guard<std::mutex> done_lock(mu_);
                handshake->channel = nullptr;
                refused = std::move(c);  // null when handed to a slot
                --pending_handshakes_;
            }
            refused.reset();  // joins its I/O thread, outside the lock
            std::lock_guard<std::mutex> done_lock(mu_);
            handshake->done = true;
        });
    }
}

void WorkerRegistry::Reject(FrameChannel& channel, const std::string& reason) {
    spdlog::warn("worker registry: refused {}: {}", channel.peer(), reason);
    {
        // Recorded before the answer goes out: whoever has seen the refusal sees it here too.
        std::lock_guard<std::mutex> lock(mu_);
        rejections_.push_back(channel.peer() + ": " + reason);
        if (rejections_.size() > kMaxRejections) rejections_.pop_front();
    }
    RegisterAckMessage nack;
    nack.accepted = false;
    nack.error = reason;
    (void)channel.Send(nack);  // best effort: the peer may not be a worker at all
}

void WorkerRegistry::HandleConnection(std::unique_ptr<FrameChannel>& channel,
                                      std::list<Handshake>::iterator handshake) {
    // A thread of its own per connection: a silent peer holds only this one, for
    // register_message_timeout_ms at most.
    Result<Message> first = channel->Receive(
        SteadyClock::now() + std::chrono::milliseconds(options_.register_message_timeout_ms));
    if (!first.ok()) {
        Reject(*channel, "no Register message: " + first.status().message());
        return;
    }
    const auto* reg = std::get_if<RegisterMessage>(&*first);
    if (reg == nullptr) {
        Reject(*channel, "expected Register as the first message, got " +
                             std::string(MessageTypeName(TypeOf(*first))));
        return;
    }
    const bool any_rank = reg->worker_rank == kAnyRank;
    std::string who = "instance '" + reg->instance_id + "' rank " +
                      (any_rank ? std::string("(any)") : std::to_string(reg->worker_rank));
    if (reg->protocol_version != kControlProtocolVersion) {
        Reject(*channel, who + ": protocol version " + std::to_string(reg->protocol_version) +
                             ", the coordinator speaks " + std::to_string(kControlProtocolVersion));
        return;
    }
    // Before anything about the instances is said: a peer without the token learns nothing.
    if (!TokenMatches(reg->token, options_.token)) {
        Reject(*channel, std::string(reg->token.empty() ? "no token" : "wrong token") +
                             " (set KVSHARD_WORKER_TOKEN to the coordinator's workers.token)");
        return;
    }
    std::shared_ptr<Slots> slots;
    std::string known;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = instances_.find(reg->instance_id);
        if (it != instances_.end()) slots = it->second;
        for (const auto& [id, s] : instances_) known += (known.empty() ? "'" : ", '") + id + "'";
    }
    if (slots == nullptr) {
        Reject(*channel, who + ": unknown instance (the coordinator expects " +
                             (known.empty() ? std::string("none") : known) + ")");
        return;
    }
    RegisterAckMessage ack;
    int rank = reg->worker_rank;
    {
        std::unique_lock<std::mutex> lock(slots->mu);
        // A replacement that arrives while a failed instance waits out its restart backoff is
        // held until the re-form opens the ranks (BeginReform notifies), instead of being refused:
        // an external launcher (a restarted pod, a supervisor) cannot see the backoff. Bounded
        // like any handshake; an instance that does not re-form by then is refused as before.
        const auto waiting_for_reform = [&] {
            return !closing_.load() && !slots->closed && !slots->shut_down && !slots->formed &&
                   !slots->TakesRegistrations();
        };
        if (waiting_for_reform()) {
            slots->cv.wait_until(
                lock,
                SteadyClock::now() + std::chrono::milliseconds(options_.register_message_timeout_ms),
                [&] { return !waiting_for_reform(); });
        }
        const int tp = slots->options.tp;
        std::string problem;
        if (closing_.load()) {
            problem = "the coordinator's worker registry is shutting down";
        } else if (slots->closed || slots->shut_down) {
            problem = "the instance is shut down";
        } else if (!slots->TakesRegistrations()) {
            problem = slots->formed ? "the instance is formed: every rank is registered"
                                    : "the instance failed and is not re-forming yet";
        } else if (reg->tp != kAnyTp && reg->tp != tp) {
            problem =
                "tp " + std::to_string(reg->tp) + ", but the instance has tp " + std::to_string(tp);
        } else if (!reg->model.empty() && !ModelMatches(reg->model, slots->options.model_path)) {
            problem = "model '" + reg->model + "', but the instance serves '" +
                      slots->options.model_path + "'";
        } else if (any_rank) {
            // The lowest free rank (LeaderWorkerSet pods and workers started by hand alike).
            rank = -1;
            for (int r = 0; r < tp && rank < 0; ++r) {
                if (slots->peers[static_cast<size_t>(r)].empty()) rank = r;
            }
            if (rank < 0) {
                problem = "no free rank: all " + std::to_string(tp) + " ranks are registered";
            }
        } else if (rank < 0 || rank >= tp) {
            problem = "rank out of range [0, " + std::to_string(tp) + ")";
        } else if (!slots->peers[static_cast<size_t>(rank)].empty()) {
            problem = "rank " + std::to_string(rank) + " already registered by " +
                      slots->peers[static_cast<size_t>(rank)];
        }
        if (!problem.empty()) {
            // Reject outside the lock: it sends.
            ack.error = who + ": " + problem;
        } else {
            const auto r = static_cast<size_t>(rank);
            // Claimed now, under the lock, so a concurrent handshake for the same rank is
            // refused; the channel follows once the ack is out.
            slots->peers[r] = channel->peer();
            slots->kv_endpoints[r] = reg->kv_endpoint;
            ack.accepted = true;
            ack.model_path = slots->options.model_path;
            ack.tp = tp;
            ack.rank = rank;
            ack.settings = slots->options.settings;
            if (!slots->rank_settings.empty()) {
                const auto& own = slots->rank_settings[r];
                ack.settings.insert(ack.settings.end(), own.begin(), own.end());
            }
            slots->rank_settings_version[r] = slots->settings_version;
#if KVSHARD_WITH_CUDA
            if (slots->options.nccl_bootstrap && tp > 1 && slots->nccl_unique_id.empty()) {
                Result<std::string> id = NewNcclUniqueId();
                if (id.ok()) {
                    slots->nccl_unique_id = std::move(*id);
                } else {
                    spdlog::warn("instance {}: no NCCL unique id for the ranks: {}",
                                 reg->instance_id, id.status().ToString());
                }
            }
#endif
            if (!slots->nccl_unique_id.empty()) {
                ack.settings.emplace_back("nccl_unique_id", slots->nccl_unique_id);
            }
        }
    }
    if (!ack.accepted) {
        Reject(*channel, ack.error);
        return;
    }
    if (any_rank) who = "instance '" + reg->instance_id + "' rank " + std::to_string(rank);
    // The ack goes out before the channel is handed over, so the worker's Ready always follows
    // it; a failed send shows up as the channel's error in WaitReady.
    const Status sent = channel->Send(ack);
    if (!sent.ok()) spdlog::warn("worker registry: {}: RegisterAck: {}", who, sent.ToString());
    spdlog::info("worker registry: {} registered from {}{} (kv endpoint '{}')", who,
                 channel->peer(), any_rank ? " (rank assigned)" : "", reg->kv_endpoint);
    {
        std::lock_guard<std::mutex> lock(mu_);
        handshake->channel = nullptr;  // no longer ours to close
    }
    std::lock_guard<std::mutex> lock(slots->mu);
    const auto r = static_cast<size_t>(rank);
    if (!slots->TakesRegistrations() || slots->channels[r] != nullptr ||
        slots->peers[r] != channel->peer()) {
        // Shut down, failed or re-formed again while the ack was going out: the worker sees its
        // channel close when the caller destroys it.
        return;
    }
    slots->channels[r] = std::move(channel);
    slots->num_registered++;
    slots->cv.notify_all();
}

}  // namespace kvshard
