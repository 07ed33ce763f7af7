// The NCCL communicator: one rank per GPU, buffers in device memory. Built only with
// KVSHARD_WITH_CUDA; host code sees it through comm/collective.h.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): initialization and every
// operation return at once, and NcclComm (comm/nccl_comm.h) polls ncclCommGetAsyncError and
// cudaStreamQuery until the work is done, the deadline passes or Abort() was called. On a failure
// or a timeout the communicator is aborted (ncclCommAbort), which releases the GPU work stuck
// waiting for a lost peer, instead of hanging in cudaStreamSynchronize.
//
// Buffers: device memory is handed to NCCL as it is. Host memory (a caller's vote or table kept on
// the host) is copied into a device buffer of the communicator's, reduced there and copied back,
// and the call waits for the stream. With CollectiveConfig::nccl_stream_ordered the stream is the
// caller's compute stream and a device all-reduce returns once queued (see comm/collective.h).
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "comm/collective_impls.h"
#include "comm/nccl_comm.h"
#include "common/logging.h"

namespace kvshard::internal {
namespace {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);

using Clock = std::chrono::steady_clock;

// Whether NCCL can read `p` directly: device or managed memory. Pageable host memory (which the
// runtime reports as unregistered, or as an error it leaves pending) is not.
bool IsDeviceMemory(const void* p) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
        (void)cudaGetLastError();  // clears the error the query left
        return false;
    }
    return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

class NcclCollective final : public Collective {
  public:
    NcclCollective(int rank, int size, int device, int64_t timeout_ms, bool stream_ordered)
        : rank_(rank),
          size_(size),
          device_(device),
          timeout_ms_(timeout_ms),
          stream_ordered_(stream_ordered),
          comm_(
              nullptr,
              [this](std::string_view what) {
                  return "NCCL rank " + std::to_string(rank_) + " " + std::string(what) +
                         ": not done within " + std::to_string(timeout_ms_) +
                         " ms (a peer is missing or stuck); communicator aborted";
              },
              [this](std::string_view what) {
                  return aborted_.load() ? AbortStatus(what) : Status::Ok();
              }) {}

    // The stream and the scratch buffer (members) are released after the communicator.
    ~NcclCollective() override {
        (void)SetDevice(device_);
        if (!aborted_.load()) {
            const Status done = comm_.Finalize(Deadline());
            if (!done.ok()) spdlog::warn("NCCL rank {}: {}", rank_, done.ToString());
        }
        comm_.Abort();
    }

    Status Init(const std::string& unique_id, StreamHandle stream) {
        KV_RETURN_IF_ERROR(SetDevice(device_));
        if (stream != nullptr) {
            stream_ = stream;
        } else {
            KV_ASSIGN_OR_RETURN(own_stream_, DeviceStream::Create());
            stream_ = own_stream_.get();
        }
        KV_ASSIGN_OR_RETURN(scratch_, DeviceBuffer::Allocate(sizeof(float)));
        KV_RETURN_IF_ERROR(comm_.StartInit(size_, rank_, unique_id));
        return comm_.PollComm("ncclCommInitRankConfig", Deadline());
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }

    Status AllReduceSum(float* data, int64_t count) override {
        KV_RETURN_IF_ERROR(CheckUsable("AllReduceSum"));
        if (count < 0) return InvalidArgument("AllReduceSum: count " + std::to_string(count));
        const size_t bytes = static_cast<size_t>(count) * sizeof(float);
        if (count > 0 && !IsDeviceMemory(data)) {
            KV_ASSIGN_OR_RETURN(float* staged, Stage(data, bytes, 0));
            KV_RETURN_IF_ERROR(
                comm_.CheckIssued(ncclAllReduce(staged, staged, static_cast<size_t>(count),
                                                ncclFloat, ncclSum, comm_.get(), stream_),
                                  "ncclAllReduce"));
            KV_RETURN_IF_ERROR(Unstage(data, staged, bytes, "ncclAllReduce"));
        } else if (stream_ordered_) {
            // Queued on the caller's stream; the step's next waiting call (or the caller's own
            // synchronization) finds a failure, and polls the communicator with the deadline.
            KV_RETURN_IF_ERROR(
                comm_.CheckIssued(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat,
                                                ncclSum, comm_.get(), stream_),
                                  "ncclAllReduce"));
            KV_RETURN_IF_ERROR(comm_.PollComm("ncclAllReduce", Deadline()));
        } else {
            KV_RETURN_IF_ERROR(
                Run("ncclAllReduce", ncclAllReduce(data, data, static_cast<size_t>(count),
                                                   ncclFloat, ncclSum, comm_.get(), stream_)));
        }
        bytes_all_reduced_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
        return Status::Ok();
    }

    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override {
        KV_RETURN_IF_ERROR(CheckUsable("AllGather"));
        if (count_per_rank < 0) {
            return InvalidArgument("AllGather: count " + std::to_string(count_per_rank));
        }
        const size_t bytes = static_cast<size_t>(count_per_rank) * sizeof(float);
        if (count_per_rank > 0 && (!IsDeviceMemory(send) || !IsDeviceMemory(recv))) {
            // Both sides staged: the send slice first, the gathered rows after it.
            KV_ASSIGN_OR_RETURN(float* staged_send,
                                Stage(send, bytes, bytes * static_cast<size_t>(size_)));
            float* staged_recv = staged_send + count_per_rank;
            KV_RETURN_IF_ERROR(comm_.CheckIssued(
                ncclAllGather(staged_send, staged_recv, static_cast<size_t>(count_per_rank),
                              ncclFloat, comm_.get(), stream_),
                "ncclAllGather"));
            return Unstage(recv, staged_recv, bytes * static_cast<size_t>(size_), "ncclAllGather");
        }
        return Run("ncclAllGather", ncclAllGather(send, recv, static_cast<size_t>(count_per_rank),
                                                  ncclFloat, comm_.get(), stream_));
    }

    Status Broadcast(void* data, int64_t bytes, int root) override {
        KV_RETURN_IF_ERROR(CheckUsable("Broadcast"));
        if (bytes < 0 || root < 0 || root >= size_) {
            return InvalidArgument("Broadcast: bytes " + std::to_string(bytes) + ", root " +
                                   std::to_string(root) + " of " + std::to_string(size_));
        }
        if (bytes > 0 && !IsDeviceMemory(data)) {
            KV_ASSIGN_OR_RETURN(float* staged, Stage(data, static_cast<size_t>(bytes), 0));
            KV_RETURN_IF_ERROR(
                comm_.CheckIssued(ncclBroadcast(staged, staged, static_cast<size_t>(bytes),
                                                ncclUint8, root, comm_.get(), stream_),
                                  "ncclBroadcast"));
            return Unstage(data, staged, static_cast<size_t>(bytes), "ncclBroadcast");
        }
        return Run("ncclBroadcast", ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8,
                                                  root, comm_.get(), stream_));
    }

    // NCCL has no barrier: an all-reduce of one float does the same.
    Status Barrier() override {
        KV_RETURN_IF_ERROR(CheckUsable("Barrier"));
        return Run("ncclAllReduce (barrier)",
                   ncclAllReduce(scratch_.data(), scratch_.data(), 1, ncclFloat, ncclSum,
                                 comm_.get(), stream_));
    }

    // Only flags the communicator: ncclCommAbort must not race with the owner thread's calls,
    // so the owner aborts it at its next poll or call (or in the destructor).
    void Abort(const std::string& reason) override {
        std::lock_guard<std::mutex> lock(abort_mu_);
        if (abort_reason_.empty()) abort_reason_ = reason.empty() ? "(no reason given)" : reason;
        aborted_.store(true);
    }

    int64_t bytes_all_reduced() const override {
        return bytes_all_reduced_.load(std::memory_order_relaxed);
    }

  private:
    Clock::time_point Deadline() const {
        return Clock::now() + std::chrono::milliseconds(timeout_ms_);
    }

    Status CheckUsable(std::string_view what) {
        if (!comm_.failure().ok()) return comm_.failure();
        if (aborted_.load()) return comm_.Fail(AbortStatus(what));
        return SetDevice(device_);
    }

    Status AbortStatus(std::string_view what) {
        std::lock_guard<std::mutex> lock(abort_mu_);
        return kvshard::Aborted("NCCL rank " + std::to_string(rank_) + " " + std::string(what) +
                                ": communicator aborted: " + abort_reason_);
    }

    // Copies `bytes` of host memory into the staging buffer (grown to `bytes` + `extra`) on the
    // stream, after everything queued there before.
    Result<float*> Stage(const void* host, size_t bytes, size_t extra) {
        const size_t need = bytes + extra;
        if (staging_.bytes() < need) {
            // Grown while nothing queued reads it: the old buffer's last use was waited for.
            KV_ASSIGN_OR_RETURN(staging_, DeviceBuffer::Allocate(need));
        }
        const cudaError_t copied =
            cudaMemcpyAsync(staging_.data(), host, bytes, cudaMemcpyHostToDevice, stream_);
        if (copied != cudaSuccess) {
            return comm_.Fail(Status(StatusCode::kUnavailable,
                                     std::string("cudaMemcpyAsync to the NCCL staging buffer: ") +
                                         cudaGetErrorString(copied)));
        }
        return staging_.floats();
    }

    // Queues the copy of the result back to host memory and waits for the stream.
    Status Unstage(void* host, const void* staged, size_t bytes, std::string_view what) {
        const Clock::time_point deadline = Deadline();
        const cudaError_t copied =
            cudaMemcpyAsync(host, staged, bytes, cudaMemcpyDeviceToHost, stream_);
        if (copied != cudaSuccess) {
            return comm_.Fail(Status(StatusCode::kUnavailable,
                                     std::string("cudaMemcpyAsync from the NCCL staging buffer: ") +
                                         cudaGetErrorString(copied)));
        }
        return comm_.WaitStream(what, stream_, deadline);
    }

    // Issues one operation and waits until the stream has run it.
    Status Run(std::string_view what, ncclResult_t issued) {
        const Clock::time_point deadline = Deadline();
        KV_RETURN_IF_ERROR(comm_.CheckIssued(issued, what));
        return comm_.WaitStream(what, stream_, deadline);
    }

    const int rank_;
    const int size_;
    const int device_;
    const int64_t timeout_ms_;
    const bool stream_ordered_;  // CollectiveConfig::nccl_stream_ordered
    // Declared before comm_, so that they outlive it.
    DeviceStream own_stream_;  // empty when the config gave a stream
    DeviceBuffer scratch_;     // one device float for Barrier
    DeviceBuffer staging_;     // host buffers' copies (grown on demand)
    NcclComm comm_;            // owner thread only
    StreamHandle stream_ = nullptr;

    std::atomic<bool> aborted_{false};
    std::mutex abort_mu_;
    std::string abort_reason_;  // guarded by abort_mu_
    std::atomic<int64_t> bytes_all_reduced_{0};
};

}  // namespace

Result<std::unique_ptr<Collective>> MakeNcclCollective(const CollectiveConfig& config,
                                                       const std::string& unique_id, int rank,
                                                       int size) {
    if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
        return InvalidArgument("NCCL unique id has " + std::to_string(unique_id.size()) +
                               " bytes, expected " + std::to_string(NCCL_UNIQUE_ID_BYTES));
    }
    if (size < 1 || rank < 0 || rank >= size) {
        return InvalidArgument("NCCL collective: rank " + std::to_string(rank) + " of size " +
                               std::to_string(size));
    }
    if (config.timeout_ms <= 0) {
        return InvalidArgument("NCCL collective: timeout_ms " + std::to_string(config.timeout_ms) +
                               " must be > 0");
    }
    if (config.nccl_stream_ordered && config.cuda_stream == nullptr) {
        return InvalidArgument(
            "NCCL collective: nccl_stream_ordered needs the caller's cuda_stream");
    }
    const int devices = DeviceCount();
    if (config.cuda_device < 0 || config.cuda_device >= devices) {
        return Status(StatusCode::kUnavailable,
                      "NCCL collective: CUDA device " + std::to_string(config.cuda_device) +
                          " does not exist (" + std::to_string(devices) + " visible)");
    }
    auto collective = std::make_unique<NcclCollective>(
        rank, size, config.cuda_device, config.timeout_ms, config.nccl_stream_ordered);
    KV_RETURN_IF_ERROR(collective->Init(unique_id, config.cuda_stream));
    return std::unique_ptr<Collective>(std::move(collective));
}

Result<std::string> MakeNcclUniqueId() {
    ncclUniqueId id;
    KV_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
    return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

}  // namespace kvshard::internal
