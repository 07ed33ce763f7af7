#include "coordinator/remote_executor.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <variant>

#include "comm/collective.h"
#include "comm/collective_store.h"
#include "common/build_config.h"
#include "common/check.h"
#include "common/logging.h"

namespace kvshard {

using SteadyClock = std::chrono::steady_clock;

// One instance's ranks. The registry fills a rank's slot (channel, peer, kv_endpoint) while the
// instance takes registrations (before its first formation, and while re-forming); the executor
// reads them and owns the channels' use from then on.
struct WorkerRegistry::Slots {
    explicit Slots(const RemoteInstanceOptions& o) : options(o) { Reset(); }

    // REQUIRES: mu held. Empties every rank's slot (the caller keeps the old channels).
    void Reset() {
        const auto n = static_cast<size_t>(options.tp);
        channels.clear();
        channels.resize(n);
        peers.assign(n, "");
        kv_endpoints.assign(n, "");
        ready.assign(n, false);
        num_kv_blocks.assign(n, 0);
        num_registered = 0;
        store = std::make_shared<MemoryCollectiveStore>();
        nccl_unique_id.clear();
    }

    // REQUIRES: mu held. Whether a Register for this instance may take a free rank now.
    bool TakesRegistrations() const {
        return !closed && !shut_down && (reforming || (failed.ok() && !formed));
    }

    const RemoteInstanceOptions options;
    mutable std::mutex mu;
    std::condition_variable cv;  // a rank registered, or the instance failed
    // Guarded by mu. A channel, once set, is only taken out by BeginReform and the destructor.
    std::vector<std::unique_ptr<FrameChannel>> channels;
    std::vector<std::string> peers;
    std::vector<std::string> kv_endpoints;
    std::vector<bool> ready;
    std::vector<int64_t> num_kv_blocks;
    int num_registered = 0;
    // The formation's rendezvous store (comm/collective_store.h): the ranks of a Gloo group
    // exchange their addresses in it, through StoreRequest messages between RegisterAck and
    // Ready. A fresh one per formation, so a re-formed group never reads the old one's keys.
    std::shared_ptr<MemoryCollectiveStore> store;
    // CUDA builds, tp > 1, options.nccl_bootstrap: the formation's NCCL unique id, made at its
    // first registration and handed to every rank in RegisterAck.settings ("nccl_unique_id").
    std::string nccl_unique_id;
    // The state of the current formation, guarded by mu:
    //   forming (initial) ─WaitReady OK→ formed ─failure→ failed ─BeginReform→ reforming
    //   reforming ─Reform OK→ formed;  reforming ─failure→ failed;  any ─Shutdown→ shut down
    Status failed;           // why the current formation cannot run steps; OK otherwise
    bool formed = false;     // every rank Ready and nothing failed since
    bool reforming = false;  // BeginReform ran and its Reform has not ended yet
    bool shut_down = false;
    bool closed = false;      // the executor is gone: no more registrations
    uint64_t epoch = 0;       // formations so far
    uint64_t generation = 0;  // BeginReforms so far: tells a stale failure from a current one
};

namespace {

std::string RankList(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
}

// Compares in time that depends on the expected token's length only, not on where the first
// difference is.
// A worker's --model against the instance's model path: a path must be the same path, a bare
// file name the path's last part (a pod may mount the same file elsewhere).
bool ModelMatches(const std::string& wanted, const std::string& served) {
    if (wanted.find('/') != std::string::npos) return wanted == served;
    const size_t slash = served.rfind('/');
    return wanted == (slash == std::string::npos ? served : served.substr(slash + 1));
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
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
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
        std::lock_guard<std::mutex> lock(slots->mu);
        const int tp = slots->options.tp;
        std::string problem;
        if (slots->closed || slots->shut_down) {
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
    }
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
    // The channels die only once no Execute refers to them.
    std::lock_guard<std::mutex> execute_lock(execute_mu_);
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
            std::lock_guard<std::mutex> lock(slots_->mu);
            slots_->ready[static_cast<size_t>(r)] = true;
            slots_->num_kv_blocks[static_cast<size_t>(r)] = ready->num_kv_blocks;
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
