// MakeNcclKvPairChannel (comm/nccl_kv_pair_channel.h).
#include "comm/nccl_kv_pair_channel.h"

#include <atomic>
#include <mutex>

#include "comm/nccl_comm.h"
#include "common/logging.h"

namespace kvshard {

namespace {

using internal::NcclComm;
using internal::NcclStatus;

class NcclKvPairChannel final : public KvPairChannel {
  public:
    NcclKvPairChannel(int rank, int device, std::function<bool()> cancelled)
        : cancelled_(std::move(cancelled)),
          comm_(
              nullptr,
              [rank](std::string_view what) {
                  return "NCCL KV pair rank " + std::to_string(rank) + " " + std::string(what) +
                         ": not done by the deadline (the peer is missing or stuck); "
                         "communicator aborted";
              },
              [this](std::string_view) { return WaitCheck(); }),
          rank_(rank),
          device_(device) {}

    // The stream (a member) is released after the communicator.
    ~NcclKvPairChannel() override {
        (void)SetDevice(device_);
        if (comm_.failure().ok() && AbortRequested().ok()) {
            const Status done =
                comm_.Finalize(Clock::now() + std::chrono::milliseconds(kFinalizeTimeoutMs));
            if (!done.ok()) spdlog::warn("NCCL KV pair rank {}: {}", rank_, done.ToString());
        }
        comm_.Abort();
    }

    Status Init(const std::string& unique_id, StreamHandle stream, Clock::time_point deadline) {
        KV_RETURN_IF_ERROR(SetDevice(device_));
        if (stream != nullptr) {
            stream_ = stream;
        } else {
            KV_ASSIGN_OR_RETURN(own_stream_, DeviceStream::Create());
            stream_ = own_stream_.get();
        }
        KV_RETURN_IF_ERROR(comm_.StartInit(2, rank_, unique_id));
        return comm_.PollComm("ncclCommInitRankConfig", deadline);
    }

    Status Send(const void* src, size_t bytes, Clock::time_point deadline) override {
        if (rank_ != 0) return InvalidArgument("NCCL KV pair: Send on rank 1 (the receiver)");
        return Transfer(true, const_cast<void*>(src), bytes, deadline);
    }

    Status Recv(void* dst, size_t bytes, Clock::time_point deadline) override {
        if (rank_ != 1) return InvalidArgument("NCCL KV pair: Recv on rank 0 (the sender)");
        return Transfer(false, dst, bytes, deadline);
    }

    void Abort(const Status& why) override {
        std::lock_guard lock(abort_mu_);
        if (abort_why_.ok()) {
            abort_why_ = Aborted("NCCL KV pair rank " + std::to_string(rank_) +
                                 " aborted: " + why.ToString());
        }
        abort_requested_.store(true);
    }

    int rank() const override { return rank_; }

  private:
    static constexpr int64_t kFinalizeTimeoutMs = 10'000;

    // Every poll of a wait: an Abort, or the owner cancelling.
    Status WaitCheck() {
        KV_RETURN_IF_ERROR(AbortRequested());
        if (cancelled_ && cancelled_()) {
            return Aborted("NCCL KV pair rank " + std::to_string(rank_) +
                           ": cancelled (re-planned again, or the worker closing its KV pairs)");
        }
        return Status::Ok();
    }

    Status AbortRequested() {
        if (!abort_requested_.load()) return Status::Ok();
        std::lock_guard lock(abort_mu_);
        return abort_why_;
    }

    Status Transfer(bool send, void* buffer, size_t bytes, Clock::time_point deadline) {
        const std::string_view what = send ? "ncclSend" : "ncclRecv";
        if (!comm_.failure().ok()) return comm_.failure();
        // An Abort between calls fails the communicator here, on the owner thread.
        KV_RETURN_IF_ERROR(comm_.Fail(AbortRequested()));
        if (bytes > 0 && buffer == nullptr) {
            return InvalidArgument(std::string(what) + ": null buffer for " +
                                   std::to_string(bytes) + " bytes");
        }
        KV_RETURN_IF_ERROR(SetDevice(device_));
        const int peer = 1 - rank_;
        KV_RETURN_IF_ERROR(comm_.Fail(NcclStatus(ncclGroupStart(), "ncclGroupStart")));
        const ncclResult_t issued =
            send ? ncclSend(buffer, bytes, ncclUint8, peer, comm_.get(), stream_)
                 : ncclRecv(buffer, bytes, ncclUint8, peer, comm_.get(), stream_);
        const ncclResult_t ended = ncclGroupEnd();
        KV_RETURN_IF_ERROR(comm_.CheckIssued(issued, what));
        KV_RETURN_IF_ERROR(comm_.CheckIssued(ended, "ncclGroupEnd"));
        return comm_.WaitStream(what, stream_, deadline);
    }

    const std::function<bool()> cancelled_;  // declared before comm_, which polls it
    DeviceStream own_stream_;                // declared before comm_, so that it outlives it
    NcclComm comm_;
    const int rank_;
    const int device_;
    StreamHandle stream_ = nullptr;
    std::atomic<bool> abort_requested_{false};
    std::mutex abort_mu_;
    Status abort_why_;  // guarded by abort_mu_
};

}  // namespace

Result<std::unique_ptr<KvPairChannel>> MakeNcclKvPairChannel(
    const NcclKvPairChannelConfig& config) {
    if (config.nccl_unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
        return InvalidArgument("NCCL KV pair: unique id of " +
                               std::to_string(config.nccl_unique_id.size()) + " bytes, expected " +
                               std::to_string(NCCL_UNIQUE_ID_BYTES));
    }
    if (config.rank != 0 && config.rank != 1) {
        return InvalidArgument("NCCL KV pair: rank=" + std::to_string(config.rank) +
                               " must be 0 or 1");
    }
    if (config.init_timeout_ms <= 0) {
        return InvalidArgument("NCCL KV pair: init_timeout_ms=" +
                               std::to_string(config.init_timeout_ms) + " must be > 0");
    }
    const int devices = DeviceCount();
    if (config.cuda_device < 0 || config.cuda_device >= devices) {
        return Unavailable("NCCL KV pair: CUDA device " + std::to_string(config.cuda_device) +
                           " does not exist (" + std::to_string(devices) + " visible)");
    }
    auto channel =
        std::make_unique<NcclKvPairChannel>(config.rank, config.cuda_device, config.cancelled);
    KV_RETURN_IF_ERROR(channel->Init(
        config.nccl_unique_id, config.stream,
        KvPairChannel::Clock::now() + std::chrono::milliseconds(config.init_timeout_ms)));
    return std::unique_ptr<KvPairChannel>(std::move(channel));
}

}  // namespace kvshard
