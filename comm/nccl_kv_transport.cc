// NcclKvChannel (comm/nccl_kv_transport.h): ncclSend/ncclRecv between two ranks, polled like
// comm/nccl_collective.cc so that a lost peer costs a deadline and an aborted communicator,
// never a hang.
#include "comm/nccl_kv_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include "common/logging.h"

namespace kvshard {

namespace {

using Clock = std::chrono::steady_clock;

Status CudaStatus(cudaError_t err, std::string_view call) {
    if (err == cudaSuccess) return Status::Ok();
    return Status(StatusCode::kUnavailable, std::string(call) + " failed: CUDA error " +
                                                std::to_string(static_cast<int>(err)) + " (" +
                                                cudaGetErrorName(err) +
                                                "): " + cudaGetErrorString(err));
}

Status NcclStatus(ncclResult_t result, std::string_view call) {
    if (result == ncclSuccess) return Status::Ok();
    return Status(StatusCode::kUnavailable, std::string(call) + " failed: NCCL error " +
                                                std::to_string(static_cast<int>(result)) + ": " +
                                                ncclGetErrorString(result));
}

int VisibleDevices() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

}  // namespace

class NcclKvChannel::Impl {
  public:
    Impl(ncclComm_t comm, int device) : comm_(comm), device_(device) {}

    ~Impl() {
        cudaSetDevice(device_);
        if (comm_ != nullptr && failure_.ok()) {
            // Finalize flushes outstanding work without blocking; abort if it does not end.
            Status done = NcclStatus(ncclCommFinalize(comm_), "ncclCommFinalize");
            if (done.ok()) {
                done = PollComm("ncclCommFinalize",
                                Clock::now() + std::chrono::milliseconds(kFinalizeTimeoutMs));
            }
            if (done.ok()) {
                ncclCommDestroy(comm_);
                comm_ = nullptr;
            } else {
                spdlog::warn("NCCL KV channel rank {}: {}", rank_, done.ToString());
            }
        }
        if (comm_ != nullptr) ncclCommAbort(comm_);
        if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
    }

    // After the communicator exists (it may still be initializing: non-blocking).
    Status Init(Clock::time_point deadline) {
        KV_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
        KV_RETURN_IF_ERROR(PollComm("ncclCommInitRankConfig", deadline));
        KV_RETURN_IF_ERROR(Fail(NcclStatus(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank")));
        KV_RETURN_IF_ERROR(Fail(NcclStatus(ncclCommCount(comm_, &size_), "ncclCommCount")));
        return CudaStatus(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking),
                          "cudaStreamCreate");
    }

    Status Transfer(bool send, void* buffer, size_t bytes, int peer, void* stream,
                    Clock::time_point deadline) {
        const std::string_view what = send ? "ncclSend" : "ncclRecv";
        if (!failure_.ok()) return failure_;
        if (peer < 0 || peer >= size_ || peer == rank_) {
            return InvalidArgument(std::string(what) + ": peer " + std::to_string(peer) +
                                   " (this is rank " + std::to_string(rank_) + " of " +
                                   std::to_string(size_) + ")");
        }
        if (bytes > 0 && buffer == nullptr) {
            return InvalidArgument(std::string(what) + ": null buffer for " +
                                   std::to_string(bytes) + " bytes");
        }
        KV_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
        cudaStream_t s = stream != nullptr ? static_cast<cudaStream_t>(stream) : own_stream_;
        // Inside a group so that NCCL may schedule it with the peer's matching call without the
        // two ranks' calls having to be ordered (and so that later callers can add pieces).
        KV_RETURN_IF_ERROR(Fail(NcclStatus(ncclGroupStart(), "ncclGroupStart")));
        const ncclResult_t issued = send ? ncclSend(buffer, bytes, ncclUint8, peer, comm_, s)
                                         : ncclRecv(buffer, bytes, ncclUint8, peer, comm_, s);
        const ncclResult_t ended = ncclGroupEnd();
        if (issued != ncclSuccess && issued != ncclInProgress) {
            return Fail(NcclStatus(issued, what));
        }
        if (ended != ncclSuccess && ended != ncclInProgress) {
            return Fail(NcclStatus(ended, "ncclGroupEnd"));
        }
        KV_RETURN_IF_ERROR(PollComm(what, deadline));
        for (int64_t polls = 0;; ++polls) {
            const cudaError_t done = cudaStreamQuery(s);
            if (done == cudaSuccess) return Status::Ok();
            if (done != cudaErrorNotReady) return Fail(CudaStatus(done, "cudaStreamQuery"));
            // A peer's failure shows up here, not on the stream.
            ncclResult_t state = ncclSuccess;
            KV_RETURN_IF_ERROR(
                Fail(NcclStatus(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError")));
            if (state != ncclSuccess && state != ncclInProgress) {
                return Fail(NcclStatus(state, what));
            }
            KV_RETURN_IF_ERROR(CheckDeadline(what, deadline, polls));
        }
    }

    int rank() const { return rank_; }
    int size() const { return size_; }

  private:
    static constexpr int64_t kFinalizeTimeoutMs = 10'000;

    // The first failure aborts the communicator; every later call returns it.
    Status Fail(Status status) {
        if (status.ok()) return status;
        if (failure_.ok()) {
            failure_ = status;
            if (comm_ != nullptr) {
                ncclCommAbort(comm_);
                comm_ = nullptr;
            }
        }
        return status;
    }

    // Waits until the communicator's queued call has been issued (ncclInProgress ends).
    Status PollComm(std::string_view what, Clock::time_point deadline) {
        for (int64_t polls = 0;; ++polls) {
            ncclResult_t state = ncclSuccess;
            KV_RETURN_IF_ERROR(
                Fail(NcclStatus(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError")));
            if (state == ncclSuccess) return Status::Ok();
            if (state != ncclInProgress) return Fail(NcclStatus(state, what));
            KV_RETURN_IF_ERROR(CheckDeadline(what, deadline, polls));
        }
    }

    Status CheckDeadline(std::string_view what, Clock::time_point deadline, int64_t polls) {
        if (Clock::now() > deadline) {
            return Fail(Status(StatusCode::kDeadlineExceeded,
                               "NCCL KV channel rank " + std::to_string(rank_) + " " +
                                   std::string(what) +
                                   ": not done by the deadline (the peer is missing or stuck); "
                                   "communicator aborted"));
        }
        if (polls > 1000) std::this_thread::yield();
        return Status::Ok();
    }

    ncclComm_t comm_;
    const int device_;
    int rank_ = -1;
    int size_ = 0;
    cudaStream_t own_stream_ = nullptr;
    Status failure_;
};

NcclKvChannel::NcclKvChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclKvChannel::~NcclKvChannel() = default;

Result<std::unique_ptr<NcclKvChannel>> NcclKvChannel::Create(const NcclKvChannelConfig& config) {
    if (config.nccl_unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
        return InvalidArgument("NCCL KV channel: unique id of " +
                               std::to_string(config.nccl_unique_id.size()) + " bytes, expected " +
                               std::to_string(NCCL_UNIQUE_ID_BYTES));
    }
    if (config.rank != 0 && config.rank != 1) {
        return InvalidArgument("NCCL KV channel: rank=" + std::to_string(config.rank) +
                               " must be 0 or 1");
    }
    if (config.init_timeout_ms <= 0) {
        return InvalidArgument("NCCL KV channel: init_timeout_ms=" +
                               std::to_string(config.init_timeout_ms) + " must be > 0");
    }
    const int devices = VisibleDevices();
    if (config.cuda_device < 0 || config.cuda_device >= devices) {
        return Status(StatusCode::kUnavailable,
                      "NCCL KV channel: CUDA device " + std::to_string(config.cuda_device) +
                          " does not exist (" + std::to_string(devices) + " visible)");
    }
    const Clock::time_point deadline =
        Clock::now() + std::chrono::milliseconds(config.init_timeout_ms);
    KV_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(config.cuda_device), "cudaSetDevice"));
    ncclUniqueId id;
    std::memcpy(id.internal, config.nccl_unique_id.data(), NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t nccl_config = NCCL_CONFIG_INITIALIZER;
    nccl_config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t started = ncclCommInitRankConfig(&comm, 2, id, config.rank, &nccl_config);
    if (started != ncclSuccess && started != ncclInProgress) {
        if (comm != nullptr) ncclCommAbort(comm);
        return NcclStatus(started, "ncclCommInitRankConfig");
    }
    auto impl = std::make_unique<Impl>(comm, config.cuda_device);
    KV_RETURN_IF_ERROR(impl->Init(deadline));
    return std::unique_ptr<NcclKvChannel>(new NcclKvChannel(std::move(impl)));
}

Result<std::unique_ptr<NcclKvChannel>> NcclKvChannel::Adopt(void* nccl_comm, int cuda_device) {
    if (nccl_comm == nullptr) return InvalidArgument("NCCL KV channel: null communicator");
    auto impl = std::make_unique<Impl>(static_cast<ncclComm_t>(nccl_comm), cuda_device);
    // An adopted communicator is normally initialized already; the deadline covers a
    // non-blocking one still joining its peer.
    KV_RETURN_IF_ERROR(impl->Init(Clock::now() + std::chrono::seconds(60)));
    return std::unique_ptr<NcclKvChannel>(new NcclKvChannel(std::move(impl)));
}

Status NcclKvChannel::SendBlocks(const void* device_src, size_t bytes, int peer, void* stream,
                                 Clock::time_point deadline) {
    return impl_->Transfer(true, const_cast<void*>(device_src), bytes, peer, stream, deadline);
}

Status NcclKvChannel::RecvBlocks(void* device_dst, size_t bytes, int peer, void* stream,
                                 Clock::time_point deadline) {
    return impl_->Transfer(false, device_dst, bytes, peer, stream, deadline);
}

int NcclKvChannel::rank() const { return impl_->rank(); }
int NcclKvChannel::size() const { return impl_->size(); }

}  // namespace kvshard
