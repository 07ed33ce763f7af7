// The MPI communicator (Open MPI; one process per rank). Built only with KVSHARD_WITH_MPI.
//
// Every operation is a non-blocking MPI collective on buffers the communicator owns, polled with
// MPI_Test until it completes, the deadline passes or Abort() is called. Owning the buffers is
// what makes giving up safe: an operation abandoned at its deadline may still read or write them
// later, but never the caller's memory, which the caller may free as soon as the call returns.
//
// AllReduceSum adds in rank order (the same bits as LocalGroup), in one of two ways:
//   small payloads: MPI_Iallgather of every rank's buffer, then each rank adds the size() copies
//     in rank order: receives (size-1) × bytes per rank, one round of latency.
//   payloads >= mpi_two_phase_min_bytes: a reduce-scatter written as MPI_Ialltoallv (rank r
//     receives every rank's values of the r-th slice and adds them in rank order) followed by an
//     MPI_Iallgatherv of the summed slices: 2 × (size-1)/size × bytes per rank, two rounds.
// MPI_Allreduce itself is not used: MPI does not promise the order of its additions (Open MPI
// chooses tree and ring algorithms by size), so its bits could differ from a thread group's.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/collective_impls.h"
#include "comm/mpi_check.h"
#include "comm/mpi_runtime.h"
#include "common/logging.h"

namespace kvshard::internal {
namespace {

using Clock = std::chrono::steady_clock;

class MpiCollective final : public Collective {
  public:
    MpiCollective(MPI_Comm comm, int rank, int size, const CollectiveConfig& config)
        : comm_(comm),
          rank_(rank),
          size_(size),
          timeout_ms_(config.timeout_ms),
          two_phase_min_bytes_(config.mpi_two_phase_min_bytes) {}

    ~MpiCollective() override {
        if (pending_ != MPI_REQUEST_NULL) ReleaseAbandoned();
        if (comm_ != MPI_COMM_NULL) {
            // Pending operations (if any) keep the communicator alive inside MPI until they end.
            const Status freed = MpiStatus(MPI_Comm_free(&comm_), "MPI_Comm_free");
            if (!freed.ok()) spdlog::warn("MPI rank {}: {}", rank_, freed.ToString());
        }
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }

    Status AllReduceSum(float* data, int64_t count) override {
        KV_RETURN_IF_ERROR(CheckUsable("AllReduceSum"));
        KV_RETURN_IF_ERROR(CheckCount("AllReduceSum", count, size_));
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
        KV_RETURN_IF_ERROR(CheckCount("AllGather", count_per_rank, size_));
        const auto count = static_cast<int>(count_per_rank);
        send_.assign(send, send + count);
        recv_.resize(static_cast<size_t>(count) * size_);
        MPI_Request request = MPI_REQUEST_NULL;
        KV_RETURN_IF_ERROR(
            Fail(MpiStatus(MPI_Iallgather(send_.data(), count, MPI_FLOAT, recv_.data(), count,
                                          MPI_FLOAT, comm_, &request),
                           "MPI_Iallgather")));
        KV_RETURN_IF_ERROR(Wait(request, "AllGather", Deadline()));
        if (!recv_.empty()) std::memcpy(recv, recv_.data(), recv_.size() * sizeof(float));
        return Status::Ok();
    }

    Status Broadcast(void* data, int64_t bytes, int root) override {
        KV_RETURN_IF_ERROR(CheckUsable("Broadcast"));
        if (bytes < 0 || bytes > INT_MAX || root < 0 || root >= size_) {
            return InvalidArgument("Broadcast: bytes " + std::to_string(bytes) + ", root " +
                                   std::to_string(root) + " of " + std::to_string(size_));
        }
        bytes_.resize(static_cast<size_t>(bytes));
        if (rank_ == root && bytes > 0) std::memcpy(bytes_.data(), data, bytes_.size());
        MPI_Request request = MPI_REQUEST_NULL;
        KV_RETURN_IF_ERROR(Fail(MpiStatus(
            MPI_Ibcast(bytes_.data(), static_cast<int>(bytes), MPI_BYTE, root, comm_, &request),
            "MPI_Ibcast")));
        KV_RETURN_IF_ERROR(Wait(request, "Broadcast", Deadline()));
        if (rank_ != root && bytes > 0) std::memcpy(data, bytes_.data(), bytes_.size());
        return Status::Ok();
    }

    Status Barrier() override {
        KV_RETURN_IF_ERROR(CheckUsable("Barrier"));
        MPI_Request request = MPI_REQUEST_NULL;
        KV_RETURN_IF_ERROR(Fail(MpiStatus(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier")));
        return Wait(request, "Barrier", Deadline());
    }

    void Abort(const std::string& reason) override {
        std::lock_guard<std::mutex> lock(abort_mu_);
        if (abort_reason_.empty()) abort_reason_ = reason.empty() ? "(no reason given)" : reason;
        aborted_.store(true);
    }

    int64_t bytes_all_reduced() const override {
        return bytes_all_reduced_.load(std::memory_order_relaxed);
    }

  private:
    static Status CheckCount(std::string_view what, int64_t count, int size) {
        if (count < 0 || count > INT_MAX / size) {
            return InvalidArgument(std::string(what) + ": count " + std::to_string(count) +
                                   " outside [0, " + std::to_string(INT_MAX / size) + "]");
        }
        return Status::Ok();
    }

    Clock::time_point Deadline() const {
        return Clock::now() + std::chrono::milliseconds(timeout_ms_);
    }

    Status CheckUsable(std::string_view what) {
        if (!failure_.ok()) return failure_;
        if (aborted_.load()) return Fail(AbortStatus(what));
        return Status::Ok();
    }

    Status AbortStatus(std::string_view what) {
        std::lock_guard<std::mutex> lock(abort_mu_);
        return kvshard::Aborted("MPI rank " + std::to_string(rank_) + " " + std::string(what) +
                                ": communicator aborted: " + abort_reason_);
    }

    // The first failure breaks the communicator: the ranks no longer agree on which operation
    // comes next, so every later call returns it.
    Status Fail(Status status) {
        if (!status.ok() && failure_.ok()) failure_ = status;
        return status;
    }

    Status Wait(MPI_Request& request, std::string_view what, Clock::time_point deadline) {
        for (int64_t polls = 0;; ++polls) {
            int done = 0;
            const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
            if (code != MPI_SUCCESS) return Fail(MpiStatus(code, "MPI_Test"));
            if (done) return Status::Ok();
            if (aborted_.load()) {
                pending_ = request;
                return Fail(AbortStatus(what));
            }
            if (polls % 64 == 0 && Clock::now() > deadline) {
                pending_ = request;
                return Fail(Status(StatusCode::kDeadlineExceeded,
                                   "MPI rank " + std::to_string(rank_) + " " + std::string(what) +
                                       ": no completion within " + std::to_string(timeout_ms_) +
                                       " ms (a peer is missing or stuck)"));
            }
            // Spin briefly for latency, then leave the core to the peers (oversubscribed runs).
            if (polls > 1000) std::this_thread::yield();
        }
    }

    Status SumGathered(float* data, int64_t count64) {
        const auto count = static_cast<size_t>(count64);
        send_.assign(data, data + count);
        recv_.resize(count * size_);
        MPI_Request request = MPI_REQUEST_NULL;
        KV_RETURN_IF_ERROR(Fail(
            MpiStatus(MPI_Iallgather(send_.data(), static_cast<int>(count), MPI_FLOAT, recv_.data(),
                                     static_cast<int>(count), MPI_FLOAT, comm_, &request),
                      "MPI_Iallgather")));
        KV_RETURN_IF_ERROR(Wait(request, "AllReduceSum", Deadline()));
        std::memcpy(data, recv_.data(), count * sizeof(float));
        for (int r = 1; r < size_; ++r) {
            const float* src = recv_.data() + r * count;
            for (size_t i = 0; i < count; ++i) data[i] += src[i];
        }
        return Status::Ok();
    }

    Status SumTwoPhase(float* data, int64_t count64) {
        const Clock::time_point deadline = Deadline();
        const auto count = static_cast<int>(count64);
        // Rank r owns slice [begin(r), begin(r+1)), as in LocalGroup.
        auto begin = [&](int r) { return static_cast<int>(count64 * r / size_); };
        const int mine = begin(rank_ + 1) - begin(rank_);
        send_counts_.resize(size_);
        send_displs_.resize(size_);
        recv_counts_.assign(size_, mine);
        recv_displs_.resize(size_);
        for (int r = 0; r < size_; ++r) {
            send_counts_[r] = begin(r + 1) - begin(r);
            send_displs_[r] = begin(r);
            recv_displs_[r] = r * mine;
        }
        send_.assign(data, data + count);
        recv_.resize(static_cast<size_t>(mine) * size_);
        MPI_Request request = MPI_REQUEST_NULL;
        KV_RETURN_IF_ERROR(
            Fail(MpiStatus(MPI_Ialltoallv(send_.data(), send_counts_.data(), send_displs_.data(),
                                          MPI_FLOAT, recv_.data(), recv_counts_.data(),
                                          recv_displs_.data(), MPI_FLOAT, comm_, &request),
                           "MPI_Ialltoallv")));
        KV_RETURN_IF_ERROR(Wait(request, "AllReduceSum (reduce-scatter)", deadline));

        // send_ is free again: it receives the whole sum, this rank's slice written in place.
        float* slice = send_.data() + begin(rank_);
        if (mine > 0) std::memcpy(slice, recv_.data(), static_cast<size_t>(mine) * sizeof(float));
        for (int r = 1; r < size_; ++r) {
            const float* src = recv_.data() + static_cast<size_t>(r) * mine;
            for (int i = 0; i < mine; ++i) slice[i] += src[i];
        }
        KV_RETURN_IF_ERROR(Fail(MpiStatus(
            MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, send_.data(), send_counts_.data(),
                            send_displs_.data(), MPI_FLOAT, comm_, &request),
            "MPI_Iallgatherv")));
        KV_RETURN_IF_ERROR(Wait(request, "AllReduceSum (all-gather)", deadline));
        std::memcpy(data, send_.data(), static_cast<size_t>(count) * sizeof(float));
        return Status::Ok();
    }

    // An operation was given up at its deadline. If the peers caught up since, it completed and
    // nothing is left behind; otherwise its buffers are leaked on purpose (MPI may still write
    // them) and the job will end with MPI_Abort instead of MPI_Finalize (comm/mpi_runtime.h).
    void ReleaseAbandoned() {
        const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
        while (Clock::now() < deadline) {
            int done = 0;
            if (MPI_Test(&pending_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
            if (done) return;
            std::this_thread::yield();
        }
        NoteAbandonedMpiOperation();
        struct Leaked {
            std::vector<float> send, recv;
            std::vector<char> bytes;
            std::vector<int> counts[4];
        };
        new Leaked{std::move(send_),
                   std::move(recv_),
                   std::move(bytes_),
                   {std::move(send_counts_), std::move(send_displs_), std::move(recv_counts_),
                    std::move(recv_displs_)}};
    }

    MPI_Comm comm_;
    const int rank_;
    const int size_;
    const int64_t timeout_ms_;
    const int64_t two_phase_min_bytes_;

    // Buffers MPI reads and writes; reused from call to call.
    std::vector<float> send_, recv_;
    std::vector<char> bytes_;
    std::vector<int> send_counts_, send_displs_, recv_counts_, recv_displs_;

    Status failure_;                          // owner thread only
    MPI_Request pending_ = MPI_REQUEST_NULL;  // abandoned at its deadline or by Abort()
    std::atomic<bool> aborted_{false};
    std::mutex abort_mu_;
    std::string abort_reason_;  // guarded by abort_mu_
    std::atomic<int64_t> bytes_all_reduced_{0};
};

}  // namespace

Result<std::unique_ptr<Collective>> MakeMpiCollective(const CollectiveConfig& config) {
    int initialized = 0;
    KV_MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
    if (!initialized) {
        return InvalidArgument("MPI collective: MPI is not initialized (create an MpiRuntime)");
    }
    if (config.timeout_ms <= 0) {
        return InvalidArgument("MPI collective: timeout_ms " + std::to_string(config.timeout_ms) +
                               " must be > 0");
    }
    int world_rank = 0;
    KV_MPI_RETURN_IF_ERROR(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    // A communicator of our own: its error handler and its message matching are kvshard's.
    MPI_Comm comm = MPI_COMM_NULL;
    if (config.mpi_color < 0) {
        KV_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    } else {
        KV_MPI_RETURN_IF_ERROR(MPI_Comm_split(MPI_COMM_WORLD, config.mpi_color, world_rank, &comm));
    }
    const Status handler =
        MpiStatus(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int rank = 0;
    int size = 0;
    Status status = handler;
    if (status.ok()) status = MpiStatus(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    if (status.ok()) status = MpiStatus(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    if (!status.ok()) {
        MPI_Comm_free(&comm);
        return status;
    }
    return std::unique_ptr<Collective>(new MpiCollective(comm, rank, size, config));
}

}  // namespace kvshard::internal
