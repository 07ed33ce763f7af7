// The Gloo communicator (one process per rank, started any way at all). Built only with
// KVSHARD_WITH_GLOO (Debian: libgloo-dev).
//
// Bootstrap: every rank opens a Gloo TCP device on CollectiveConfig::gloo_host (or the interface
// gloo_iface / GLOO_SOCKET_IFNAME names) and connects a full mesh of pairs through
// gloo::rendezvous::Context, which publishes each rank's pair addresses in a key-value store and
// reads the others'. The store is a CollectiveStore (comm/collective_store.h): in process mode
// the coordinator's, reached over the worker's registration channel, so no other rendezvous
// service (file system, Redis) is needed.
//
// Operations are point-to-point transfers on Gloo's unbound buffers, all posted before any is
// waited for, so no rank waits for another's turn:
//   AllReduceSum, small payloads: every rank sends its buffer to every other rank, then adds
//     the size() copies in rank order 0..size-1: (size-1) × bytes per rank, one round.
//   AllReduceSum, payloads >= gloo_two_phase_min_bytes: a reduce-scatter (rank r receives every
//     rank's values of the r-th slice, as LocalGroup and the MPI communicator slice, and adds
//     them in rank order), then an all-gather of the summed slices: 2 × (size-1)/size × bytes.
//   Both produce the bits of LocalGroup and of the MPI communicator (comm/collective.h).
//   AllGather, Broadcast (root to every rank) and Barrier (one byte to and from every rank) the
//   same way.
// Gloo's own allreduce algorithms are not used: they do not add in rank order.
//
// Failure: Gloo signals errors by exceptions; none leaves this file. A wait that reaches the
// call's deadline throws inside Gloo, which closes every pair of the context: the communicator
// is broken and every later call returns the error. Abort() interrupts the wait in progress
// (UnboundBuffer::abortWaitRecv/abortWaitSend) and breaks the communicator too. Memory Gloo may
// still write after a given-up operation is owned here, never the caller's, and lives until the
// connections are closed in the destructor.
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <vector>

#include "comm/collective_impls.h"
#include "comm/collective_store.h"
#include "common/logging.h"

namespace kvshard::internal {
namespace {

using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// Gloo's view of a CollectiveStore. Gloo expects failures as exceptions; they are caught where
// Gloo was called (MakeGlooCollective), with the store's Status kept for the message.
class StoreAdapter final : public gloo::rendezvous::Store {
  public:
    StoreAdapter(CollectiveStore& store, Clock::time_point deadline)
        : store_(store), deadline_(deadline) {}

    void set(const std::string& key, const std::vector<char>& data) override {
        Check(store_.Set(key, std::string(data.begin(), data.end())));
    }
    std::vector<char> get(const std::string& key) override {
        Result<std::string> value = store_.Get(key, deadline_);
        Check(value.status());
        return std::vector<char>(value->begin(), value->end());
    }
    void wait(const std::vector<std::string>& keys) override { wait(keys, {}); }
    void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
        // One deadline for the whole rendezvous: the call's, not Gloo's per-wait timeout.
        for (const std::string& key : keys) Check(store_.Get(key, deadline_).status());
    }

    const Status& failure() const { return failure_; }

  private:
    void Check(const Status& status) {
        if (status.ok()) return;
        if (failure_.ok()) failure_ = status;
        throw gloo::IoException(status.message());
    }
    CollectiveStore& store_;
    const Clock::time_point deadline_;
    Status failure_;
};

// One transfer of a phase: `bytes` bytes at `offset` of the phase's buffer, to or from `peer`.
struct Transfer {
    int peer = 0;
    size_t offset = 0;
    size_t bytes = 0;
};

class GlooCollective final : public Collective {
  public:
    GlooCollective(std::shared_ptr<gloo::rendezvous::Context> context,
                   const CollectiveConfig& config)
        : rank_(config.rank),
          size_(config.size),
          timeout_ms_(config.timeout_ms),
          two_phase_min_bytes_(config.gloo_two_phase_min_bytes),
          context_(std::move(context)) {}

    ~GlooCollective() override {
        // Closed first: after this no pair reads into buffers given up at a deadline or Abort.
        try {
            context_->closeConnections();
        } catch (const std::exception& e) {
            spdlog::warn("Gloo rank {}: closing connections: {}", rank_, e.what());
        }
        active_.clear();
        context_.reset();
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }

    Status AllReduceSum(float* data, int64_t count) override {
        KV_RETURN_IF_ERROR(CheckUsable("AllReduceSum"));
        KV_RETURN_IF_ERROR(CheckCount("AllReduceSum", count));
        if (size_ > 1 && count > 0) {
            const int64_t bytes = count * static_cast<int64_t>(sizeof(float));
            KV_RETURN_IF_ERROR(bytes >= two_phase_min_bytes_ ? SumTwoPhase(data, count)
                                                             : SumGathered(data, count));
        }
        bytes_all_reduced_.fetch_add(count * static_cast<int64_t>(sizeof(float)),
                                     std::memory_order_relaxed);
        return Status::Ok();
    }

    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override {
        KV_RETURN_IF_ERROR(CheckUsable("AllGather"));
        KV_RETURN_IF_ERROR(CheckCount("AllGather", count_per_rank));
        const auto count = static_cast<size_t>(count_per_rank);
        const size_t bytes = count * sizeof(float);
        send_.assign(send, send + count);
        recv_.resize(count * static_cast<size_t>(size_));
        if (size_ > 1 && count > 0) {
            std::vector<Transfer> sends, recvs;
            for (int p = 0; p < size_; ++p) {
                if (p == rank_) continue;
                sends.push_back({p, 0, bytes});
                recvs.push_back({p, static_cast<size_t>(p) * bytes, bytes});
            }
            KV_RETURN_IF_ERROR(Exchange("AllGather", send_.data(), bytes, sends, recv_.data(),
                                        recv_.size() * sizeof(float), recvs, Deadline()));
        }
        if (count > 0) {
            std::memcpy(recv_.data() + static_cast<size_t>(rank_) * count, send_.data(), bytes);
            std::memcpy(recv, recv_.data(), recv_.size() * sizeof(float));
        }
        return Status::Ok();
    }

    Status Broadcast(void* data, int64_t bytes, int root) override {
        KV_RETURN_IF_ERROR(CheckUsable("Broadcast"));
        if (bytes < 0 || bytes > INT_MAX || root < 0 || root >= size_) {
            return InvalidArgument("Broadcast: bytes " + std::to_string(bytes) + ", root " +
                                   std::to_string(root) + " of " + std::to_string(size_));
        }
        if (size_ == 1 || bytes == 0) return Status::Ok();
        const auto n = static_cast<size_t>(bytes);
        bytes_.resize(n);
        std::vector<Transfer> sends, recvs;
        if (rank_ == root) {
            std::memcpy(bytes_.data(), data, n);
            for (int p = 0; p < size_; ++p) {
                if (p != rank_) sends.push_back({p, 0, n});
            }
        } else {
            recvs.push_back({root, 0, n});
        }
        KV_RETURN_IF_ERROR(
            Exchange("Broadcast", bytes_.data(), n, sends, bytes_.data(), n, recvs, Deadline()));
        if (rank_ != root) std::memcpy(data, bytes_.data(), n);
        return Status::Ok();
    }

    Status Barrier() override {
        KV_RETURN_IF_ERROR(CheckUsable("Barrier"));
        if (size_ == 1) return Status::Ok();
        // One byte to and from every rank: nobody leaves before everybody arrived.
        bytes_.assign(static_cast<size_t>(size_) + 1, 0);
        std::vector<Transfer> sends, recvs;
        for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            sends.push_back({p, 0, 1});
            recvs.push_back({p, static_cast<size_t>(p) + 1, 1});
        }
        return Exchange("Barrier", bytes_.data(), 1, sends, bytes_.data(), bytes_.size(), recvs,
                        Deadline());
    }

    void Abort(const std::string& reason) override {
        std::lock_guard<std::mutex> lock(abort_mu_);
        if (abort_reason_.empty()) abort_reason_ = reason.empty() ? "(no reason given)" : reason;
        aborted_.store(true);
        for (UnboundBuffer* b : waiting_) {
            b->abortWaitRecv();
            b->abortWaitSend();
        }
    }

    int64_t bytes_all_reduced() const override {
        return bytes_all_reduced_.load(std::memory_order_relaxed);
    }

  private:
    Status CheckCount(std::string_view what, int64_t count) const {
        if (count < 0 || count > INT_MAX / size_) {
            return InvalidArgument(std::string(what) + ": count " + std::to_string(count) +
                                   " outside [0, " + std::to_string(INT_MAX / size_) + "]");
        }
        return Status::Ok();
    }

    Clock::time_point Deadline() const {
        return Clock::now() + std::chrono::milliseconds(timeout_ms_);
    }

    std::string Who(std::string_view what) const {
        return "Gloo rank " + std::to_string(rank_) + " of " + std::to_string(size_) + " " +
               std::string(what);
    }

    Status CheckUsable(std::string_view what) {
        if (!failure_.ok()) return failure_;
        if (aborted_.load()) return Fail(AbortStatus(what));
        return Status::Ok();
    }

    Status AbortStatus(std::string_view what) {
        std::lock_guard<std::mutex> lock(abort_mu_);
        return kvshard::Aborted(Who(what) + ": communicator aborted: " + abort_reason_);
    }

    // The first failure breaks the communicator: the ranks no longer agree on which operation
    // comes next, so every later call returns it.
    Status Fail(Status status) {
        if (!status.ok() && failure_.ok()) failure_ = status;
        return status;
    }

    // Posts `sends` from send_ptr and `recvs` into recv_ptr (Gloo slot: one per phase, the same
    // on every rank because every rank makes the same calls), then waits for all of them.
    Status Exchange(std::string_view what, void* send_ptr, size_t send_size,
                    const std::vector<Transfer>& sends, void* recv_ptr, size_t recv_size,
                    const std::vector<Transfer>& recvs, Clock::time_point deadline) {
        const uint64_t slot = next_slot_++;
        std::unique_ptr<UnboundBuffer> send_buffer, recv_buffer;
        try {
            if (!sends.empty()) send_buffer = context_->createUnboundBuffer(send_ptr, send_size);
            if (!recvs.empty()) recv_buffer = context_->createUnboundBuffer(recv_ptr, recv_size);
            {
                std::lock_guard<std::mutex> lock(abort_mu_);
                if (send_buffer) waiting_.push_back(send_buffer.get());
                if (recv_buffer) waiting_.push_back(recv_buffer.get());
            }
            if (aborted_.load()) {
                return Fail(
                    Given(std::move(send_buffer), std::move(recv_buffer), AbortStatus(what)));
            }
            for (const Transfer& t : recvs) recv_buffer->recv(t.peer, slot, t.offset, t.bytes);
            for (const Transfer& t : sends) send_buffer->send(t.peer, slot, t.offset, t.bytes);
            for (size_t i = 0; i < recvs.size(); ++i) {
                if (!recv_buffer->waitRecv(nullptr, Left(deadline))) {
                    return Fail(
                        Given(std::move(send_buffer), std::move(recv_buffer), AbortStatus(what)));
                }
            }
            for (size_t i = 0; i < sends.size(); ++i) {
                if (!send_buffer->waitSend(nullptr, Left(deadline))) {
                    return Fail(
                        Given(std::move(send_buffer), std::move(recv_buffer), AbortStatus(what)));
                }
            }
        } catch (const std::exception& e) {
            const bool timed_out = std::strstr(e.what(), "Timed out") != nullptr;
            return Fail(Given(
                std::move(send_buffer), std::move(recv_buffer),
                Status(timed_out ? StatusCode::kDeadlineExceeded : StatusCode::kUnavailable,
                       Who(what) +
                           (timed_out ? ": no completion within " + std::to_string(timeout_ms_) +
                                            " ms (a peer is missing or stuck): "
                                      : ": ") +
                           e.what())));
        }
        std::lock_guard<std::mutex> lock(abort_mu_);
        waiting_.clear();
        return Status::Ok();
    }

    // An operation was given up: its buffers may still be the target of a pending transfer, so
    // they (and the memory under them, which the communicator owns) stay until the destructor
    // has closed the connections.
    Status Given(std::unique_ptr<UnboundBuffer> send, std::unique_ptr<UnboundBuffer> recv,
                 Status why) {
        std::lock_guard<std::mutex> lock(abort_mu_);
        waiting_.clear();
        if (send) active_.push_back(std::move(send));
        if (recv) active_.push_back(std::move(recv));
        return why;
    }

    // What is left of the deadline, at least 1 ms (Gloo treats a timeout of 0 as its default).
    static std::chrono::milliseconds Left(Clock::time_point deadline) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        return std::max(left, std::chrono::milliseconds(1));
    }

    Status SumGathered(float* data, int64_t count64) {
        const auto count = static_cast<size_t>(count64);
        const size_t bytes = count * sizeof(float);
        send_.assign(data, data + count);
        recv_.resize(count * static_cast<size_t>(size_));
        std::vector<Transfer> sends, recvs;
        for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            sends.push_back({p, 0, bytes});
            recvs.push_back({p, static_cast<size_t>(p) * bytes, bytes});
        }
        KV_RETURN_IF_ERROR(Exchange("AllReduceSum", send_.data(), bytes, sends, recv_.data(),
                                    recv_.size() * sizeof(float), recvs, Deadline()));
        // Rank 0's copy first (this rank's own values where it is rank 0), then the others.
        const float* first = rank_ == 0 ? send_.data() : recv_.data();
        std::memcpy(data, first, bytes);
        for (int r = 1; r < size_; ++r) {
            const float* src = r == rank_ ? send_.data() : recv_.data() + r * count;
            for (size_t i = 0; i < count; ++i) data[i] += src[i];
        }
        return Status::Ok();
    }

    Status SumTwoPhase(float* data, int64_t count64) {
        const Clock::time_point deadline = Deadline();
        const auto count = static_cast<size_t>(count64);
        // Rank r owns slice [begin(r), begin(r+1)), as in LocalGroup and the MPI communicator.
        auto begin = [&](int r) { return static_cast<size_t>(count64 * r / size_); };
        const size_t mine = begin(rank_ + 1) - begin(rank_);
        send_.assign(data, data + count);
        recv_.resize(mine * static_cast<size_t>(size_));
        std::vector<Transfer> sends, recvs;
        for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            const size_t theirs = begin(p + 1) - begin(p);
            if (theirs > 0) {
                sends.push_back({p, begin(p) * sizeof(float), theirs * sizeof(float)});
            }
            if (mine > 0) {
                recvs.push_back(
                    {p, static_cast<size_t>(p) * mine * sizeof(float), mine * sizeof(float)});
            }
        }
        KV_RETURN_IF_ERROR(Exchange("AllReduceSum (reduce-scatter)", send_.data(),
                                    send_.size() * sizeof(float), sends, recv_.data(),
                                    recv_.size() * sizeof(float), recvs, deadline));
        // This rank's own values of its slice sit in send_; the others' in recv_.
        slice_.resize(mine);
        for (size_t i = 0; i < mine; ++i) {
            float sum = rank_ == 0 ? send_[begin(rank_) + i] : recv_[i];
            for (int r = 1; r < size_; ++r) {
                sum += r == rank_ ? send_[begin(rank_) + i] : recv_[r * mine + i];
            }
            slice_[i] = sum;
        }
        // send_ is free again (every send completed): it receives the whole sum.
        sends.clear();
        recvs.clear();
        for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            const size_t theirs = begin(p + 1) - begin(p);
            if (mine > 0) sends.push_back({p, 0, mine * sizeof(float)});
            if (theirs > 0) {
                recvs.push_back({p, begin(p) * sizeof(float), theirs * sizeof(float)});
            }
        }
        KV_RETURN_IF_ERROR(Exchange("AllReduceSum (all-gather)", slice_.data(),
                                    std::max<size_t>(mine, 1) * sizeof(float), sends, send_.data(),
                                    send_.size() * sizeof(float), recvs, deadline));
        if (mine > 0) std::memcpy(send_.data() + begin(rank_), slice_.data(), mine * sizeof(float));
        std::memcpy(data, send_.data(), count * sizeof(float));
        return Status::Ok();
    }

    const int rank_;
    const int size_;
    const int64_t timeout_ms_;
    const int64_t two_phase_min_bytes_;

    // Memory Gloo reads and writes; reused from call to call. Declared before the context and
    // the buffers, so destroyed after them.
    std::vector<float> send_, recv_, slice_;
    std::vector<char> bytes_;

    std::shared_ptr<gloo::rendezvous::Context> context_;
    uint64_t next_slot_ = 1;
    Status failure_;  // owner thread only

    std::atomic<bool> aborted_{false};
    std::mutex abort_mu_;
    std::string abort_reason_;             // guarded by abort_mu_
    std::vector<UnboundBuffer*> waiting_;  // guarded by abort_mu_: the operation in progress
    // Buffers of operations given up (guarded by abort_mu_); destroyed after closeConnections.
    std::vector<std::unique_ptr<UnboundBuffer>> active_;
    std::atomic<int64_t> bytes_all_reduced_{0};
};

}  // namespace

Result<std::unique_ptr<Collective>> MakeGlooCollective(const CollectiveConfig& config) {
    const std::string who =
        "Gloo rank " + std::to_string(config.rank) + " of " + std::to_string(config.size);
    gloo::transport::tcp::attr attr;
    std::string iface = config.gloo_iface;
    if (iface.empty()) {
        const char* env = std::getenv("GLOO_SOCKET_IFNAME");
        if (env != nullptr) iface = env;
    }
    if (!iface.empty()) {
        attr.iface = iface;
    } else {
        attr.hostname = config.gloo_host.empty() ? "127.0.0.1" : config.gloo_host;
    }
    const std::string where =
        iface.empty() ? "host '" + attr.hostname + "'" : "interface '" + iface + "'";
    if (iface.empty()) {
        // Resolved here first: Gloo does not check getaddrinfo's errors and crashes on a name
        // that does not resolve.
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        addrinfo* found = nullptr;
        const int rv = getaddrinfo(attr.hostname.c_str(), nullptr, &hints, &found);
        if (rv != 0 || found == nullptr) {
            return InvalidArgument(who + ": cannot resolve the collective host '" + attr.hostname +
                                   "': " + gai_strerror(rv));
        }
        freeaddrinfo(found);
    }
    std::shared_ptr<gloo::transport::Device> device;
    try {
        device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
        return InvalidArgument(who + ": cannot listen on " + where + ": " + e.what());
    }
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(config.timeout_ms);
    StoreAdapter store(*config.gloo_store, deadline);
    auto context = std::make_shared<gloo::rendezvous::Context>(config.rank, config.size);
    context->setTimeout(std::chrono::milliseconds(config.timeout_ms));
    try {
        context->connectFullMesh(store, device);
    } catch (const std::exception& e) {
        if (!store.failure().ok()) {
            return Status(store.failure().code(),
                          who + ": rendezvous: " + store.failure().message());
        }
        const bool timed_out = std::strstr(e.what(), "Timed out") != nullptr ||
                               std::strstr(e.what(), "timed out") != nullptr;
        return Status(
            timed_out ? StatusCode::kDeadlineExceeded : StatusCode::kUnavailable,
            who + ": connecting to the other ranks (listening on " + where + "): " + e.what());
    }
    spdlog::info("{}: connected ({})", who, device->str());
    return std::unique_ptr<Collective>(new GlooCollective(std::move(context), config));
}

}  // namespace kvshard::internal
