// The NCCL KvPairChannel (comm/kv_pair_channel.h): one pair of the NCCL point-to-point KV
// handoff as a two-rank non-blocking communicator (ncclConfig_t::blocking = 0) on this rank's
// GPU, created from the pair's unique id (comm/kv_nccl_pairs.h). Send and Recv issue one
// ncclSend / ncclRecv inside ncclGroupStart/End and poll ncclCommGetAsyncError and the stream
// (comm/nccl_comm.h) until done, the deadline, or Abort: on any of those the communicator is
// aborted (ncclCommAbort), so a lost peer costs the deadline, never a hang.
//
// Built only with KVSHARD_WITH_CUDA (comm/nccl_kv_pair_channel.cc); the header includes neither
// CUDA nor NCCL.
//
// Thread-safety: KvPairChannel's — one thread calls Send/Recv; Abort from any thread takes
// effect at that thread's next poll (or its next call), on that thread.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "comm/kv_pair_channel.h"
#include "common/device.h"
#include "common/status.h"

namespace kvshard {

struct NcclKvPairChannelConfig {
    std::string nccl_unique_id;  // the pair's (KvNcclPairAssignment::nccl_unique_id)
    int rank = 0;                // 0 sends (prefill), 1 receives (decode)
    int cuda_device = 0;
    // How long creating the communicator may wait for the peer.
    int64_t init_timeout_ms = 60'000;
    // The stream the transfers run on (the decode step's, for a receiver), on `cuda_device`;
    // nullptr for one of the channel's own. Send/Recv return once it ran them.
    StreamHandle stream = nullptr;
    // Polled while the channel waits (its join, its transfers); true ends the wait as an Abort
    // would (Aborted, the communicator aborted). Set by the worker's pair path when a later
    // re-plan supersedes the join or the rank closes its pairs: a join otherwise waits
    // init_timeout_ms for a peer that may never come.
    std::function<bool()> cancelled;
};

// Both ranks of the pair call it concurrently. InvalidArgument for a bad id or rank,
// Unavailable when the device does not exist, DeadlineExceeded when the peer did not join in
// time (NCCL itself refuses two ranks of one communicator on one GPU).
Result<std::unique_ptr<KvPairChannel>> MakeNcclKvPairChannel(const NcclKvPairChannelConfig& config);

}  // namespace kvshard
