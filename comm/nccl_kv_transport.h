// NcclKvChannel: moves KV bytes between two paired GPU ranks with ncclSend/ncclRecv — the GPU
// counterpart of comm/kv_transport.h, for a prefill rank and a decode rank that share an NCCL
// communicator. It moves raw device bytes only: which blocks and heads they hold, and in what
// order, is agreed beforehand (e.g. the KvPieceHeader sent over a KvTransport), and both sides
// must call with the same byte count.
//
// Built only with KVSHARD_WITH_CUDA (comm/nccl_kv_transport.cc); the header includes neither CUDA
// nor NCCL, so host code can include it: streams are the device layer's StreamHandle
// (common/device.h), communicators `ncclComm*` (an ncclComm_t) through a declared tag.
//
// Failure: every call polls ncclCommGetAsyncError and the stream until done or the deadline;
// on a timeout or an NCCL error the communicator is aborted (ncclCommAbort), which releases GPU
// work stuck waiting for a lost peer, and every later call returns that first error.
//
// Thread-safety: one thread at a time per channel (NCCL communicators are not thread-safe).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "common/device.h"
#include "common/status.h"

// ncclComm_t is `ncclComm*`; declaring the tag keeps this header free of NCCL includes.
struct ncclComm;

namespace kvshard {

struct NcclKvChannelConfig {
    // Shared by both ranks: NewNcclUniqueId() (comm/collective.h) on one, passed to the other.
    std::string nccl_unique_id;
    int rank = 0;  // 0 or 1
    int cuda_device = 0;
    // How long creating the communicator may wait for the peer.
    int64_t init_timeout_ms = 60'000;
};

class NcclKvChannel {
  public:
    class Impl;

    // Creates a two-rank non-blocking communicator; both ranks call it concurrently. Unavailable
    // when the device does not exist, DeadlineExceeded when the peer did not join in time.
    static Result<std::unique_ptr<NcclKvChannel>> Create(const NcclKvChannelConfig& config);

    // Takes over `nccl_comm` (its device is `cuda_device`): the channel destroys it, or aborts
    // it after a failure. It may be blocking or not.
    static Result<std::unique_ptr<NcclKvChannel>> Adopt(ncclComm* nccl_comm, int cuda_device);

    // Finalizes and destroys the communicator (aborting it when that does not finish promptly).
    ~NcclKvChannel();
    NcclKvChannel(const NcclKvChannel&) = delete;
    NcclKvChannel& operator=(const NcclKvChannel&) = delete;

    // Sends `bytes` from device memory to rank `peer`, which must RecvBlocks the same count.
    // `stream`: a stream on the channel's device, or nullptr for the channel's own. Returns once
    // the stream ran it.
    Status SendBlocks(const void* device_src, size_t bytes, int peer, StreamHandle stream,
                      std::chrono::steady_clock::time_point deadline);
    // Receives `bytes` from rank `peer` into device memory.
    Status RecvBlocks(void* device_dst, size_t bytes, int peer, StreamHandle stream,
                      std::chrono::steady_clock::time_point deadline);

    int rank() const;
    int size() const;

  private:
    explicit NcclKvChannel(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard
