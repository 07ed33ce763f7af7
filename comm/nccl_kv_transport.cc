// NcclKvChannel (comm/nccl_kv_transport.h): ncclSend/ncclRecv between two ranks, polled by
// NcclComm (comm/nccl_comm.h) as comm/nccl_collective.cc is, so that a lost peer costs a
// deadline and an aborted communicator, never a hang.
#include "comm/nccl_kv_transport.h"

#include "comm/nccl_comm.h"
#include "common/logging.h"

namespace kvshard {

namespace {

using Clock = std::chrono::steady_clock;
using internal::NcclComm;
using internal::NcclStatus;

}  // namespace

class NcclKvChannel::Impl {
  public:
    Impl(ncclComm_t comm, int device)
        : comm_(comm,
                [this](std::string_view what) {
                    return "NCCL KV channel rank " + std::to_string(rank_) + " " +
                           std::string(what) +
                           ": not done by the deadline (the peer is missing or stuck); "
                           "communicator aborted";
                }),
          device_(device) {}

    // The stream (a member) is released after the communicator.
    ~Impl() {
        (void)SetDevice(device_);
        const Status done =
            comm_.Finalize(Clock::now() + std::chrono::milliseconds(kFinalizeTimeoutMs));
        if (!done.ok()) spdlog::warn("NCCL KV channel rank {}: {}", rank_, done.ToString());
        comm_.Abort();
    }

    // Starts creating a two-rank communicator (Create; Init waits for it).
    Status StartInit(int rank, const std::string& unique_id) {
        return comm_.StartInit(2, rank, unique_id);
    }

    // After the communicator exists (it may still be initializing: non-blocking).
    Status Init(Clock::time_point deadline) {
        KV_RETURN_IF_ERROR(SetDevice(device_));
        KV_RETURN_IF_ERROR(comm_.PollComm("ncclCommInitRankConfig", deadline));
        KV_RETURN_IF_ERROR(
            comm_.Fail(NcclStatus(ncclCommUserRank(comm_.get(), &rank_), "ncclCommUserRank")));
        KV_RETURN_IF_ERROR(
            comm_.Fail(NcclStatus(ncclCommCount(comm_.get(), &size_), "ncclCommCount")));
        KV_ASSIGN_OR_RETURN(own_stream_, DeviceStream::Create());
        return Status::Ok();
    }

    Status Transfer(bool send, void* buffer, size_t bytes, int peer, StreamHandle stream,
                    Clock::time_point deadline) {
        const std::string_view what = send ? "ncclSend" : "ncclRecv";
        if (!comm_.failure().ok()) return comm_.failure();
        if (peer < 0 || peer >= size_ || peer == rank_) {
            return InvalidArgument(std::string(what) + ": peer " + std::to_string(peer) +
                                   " (this is rank " + std::to_string(rank_) + " of " +
                                   std::to_string(size_) + ")");
        }
        if (bytes > 0 && buffer == nullptr) {
            return InvalidArgument(std::string(what) + ": null buffer for " +
                                   std::to_string(bytes) + " bytes");
        }
        KV_RETURN_IF_ERROR(SetDevice(device_));
        const StreamHandle s = stream != nullptr ? stream : own_stream_.get();
        // Inside a group so that NCCL may schedule it with the peer's matching call without the
        // two ranks' calls having to be ordered (and so that later callers can add pieces).
        KV_RETURN_IF_ERROR(comm_.Fail(NcclStatus(ncclGroupStart(), "ncclGroupStart")));
        const ncclResult_t issued = send ? ncclSend(buffer, bytes, ncclUint8, peer, comm_.get(), s)
                                         : ncclRecv(buffer, bytes, ncclUint8, peer, comm_.get(), s);
        const ncclResult_t ended = ncclGroupEnd();
        KV_RETURN_IF_ERROR(comm_.CheckIssued(issued, what));
        KV_RETURN_IF_ERROR(comm_.CheckIssued(ended, "ncclGroupEnd"));
        return comm_.WaitStream(what, s, deadline);
    }

    int rank() const { return rank_; }
    int size() const { return size_; }

  private:
    static constexpr int64_t kFinalizeTimeoutMs = 10'000;

    DeviceStream own_stream_;  // declared before comm_, so that it outlives it
    NcclComm comm_;
    const int device_;
    int rank_ = -1;
    int size_ = 0;
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
    const int devices = DeviceCount();
    if (config.cuda_device < 0 || config.cuda_device >= devices) {
        return Status(StatusCode::kUnavailable,
                      "NCCL KV channel: CUDA device " + std::to_string(config.cuda_device) +
                          " does not exist (" + std::to_string(devices) + " visible)");
    }
    const Clock::time_point deadline =
        Clock::now() + std::chrono::milliseconds(config.init_timeout_ms);
    KV_RETURN_IF_ERROR(SetDevice(config.cuda_device));
    auto impl = std::make_unique<Impl>(nullptr, config.cuda_device);
    KV_RETURN_IF_ERROR(impl->StartInit(config.rank, config.nccl_unique_id));
    KV_RETURN_IF_ERROR(impl->Init(deadline));
    return std::unique_ptr<NcclKvChannel>(new NcclKvChannel(std::move(impl)));
}

Result<std::unique_ptr<NcclKvChannel>> NcclKvChannel::Adopt(ncclComm* nccl_comm, int cuda_device) {
    if (nccl_comm == nullptr) return InvalidArgument("NCCL KV channel: null communicator");
    auto impl = std::make_unique<Impl>(nccl_comm, cuda_device);
    // An adopted communicator is normally initialized already; the deadline covers a
    // non-blocking one still joining its peer.
    KV_RETURN_IF_ERROR(impl->Init(Clock::now() + std::chrono::seconds(60)));
    return std::unique_ptr<NcclKvChannel>(new NcclKvChannel(std::move(impl)));
}

Status NcclKvChannel::SendBlocks(const void* device_src, size_t bytes, int peer,
                                 StreamHandle stream, Clock::time_point deadline) {
    return impl_->Transfer(true, const_cast<void*>(device_src), bytes, peer, stream, deadline);
}

Status NcclKvChannel::RecvBlocks(void* device_dst, size_t bytes, int peer, StreamHandle stream,
                                 Clock::time_point deadline) {
    return impl_->Transfer(false, device_dst, bytes, peer, stream, deadline);
}

int NcclKvChannel::rank() const { return impl_->rank(); }
int NcclKvChannel::size() const { return impl_->size(); }

}  // namespace kvshard
