// SocketKvPairChannel: a KvPairChannel (comm/kv_pair_channel.h) over one TCP connection between
// two worker processes — a TEST transport for the wiring of the NCCL point-to-point KV handoff
// (kv_transfer.path: nccl) on machines without two GPUs, so that serve, the worker processes and
// their steps run the whole pair path with only the channel differing. Serve selects it only
// with the test knob KVSHARD_KV_PAIR_LINK=socket (docs/config.md kv_transfer.path); it is never a
// product path and never chosen by auto.
//
// Bootstrap: the pair's id (KvNcclPairAssignment::nccl_unique_id, kKvNcclUniqueIdBytes bytes)
// is made by NewSocketKvPairId on the coordinator: "kvpair-socket <host>:<port> <random hex>",
// zero-padded, naming a port that was free when it was made. Rank 1 (the receiver) listens there
// when its channel is made and accepts at its first Recv; rank 0 (the sender) connects at its
// first Send, retrying until that Send's deadline. So making a channel never waits for the peer
// (a worker's start does not depend on the other pool's), and both first calls are bounded by
// their deadlines. The connection opens with a hello (magic "KVPL" and the whole id); the
// receiver drops a connection whose hello is not its id and keeps listening.
//
// Frames: each Send is one frame, magic "KVPD", u64 byte count (little-endian), the bytes. The
// receiver reads the header and refuses (DataLoss, failing the channel) a count other than the
// Recv's: it never allocates or reads more than the caller's buffer.
//
// Failure: as the contract says, the first error (a timeout, the peer closing or resetting the
// connection, a bad frame, Abort) fails the channel for good; Abort closes the socket, so the
// peer's call in progress fails at once (an NCCL peer would wait for its deadline).
//
// Fault knob, for tests only: KVSHARD_KV_PAIR_SOCKET_FAIL_SENDS="N[,M...]" fails the Nth send
// (counted from 1 over every socket pair channel of the process) as a reset connection would:
// the channel fails for good and its peer's receive fails at once. The integration tests fail a
// pair this way without a re-form (the coordinator then re-plans it). A value that is not such a
// list fails every send, naming the variable.
//
// Thread-safety: the KvPairChannel contract's (one caller at a time; Abort from any thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "comm/kv_pair_channel.h"
#include "common/status.h"

namespace kvshard {

inline constexpr std::string_view kSocketKvPairIdPrefix = "kvpair-socket ";
inline constexpr std::string_view kSocketKvPairFailSendsVariable =
    "KVSHARD_KV_PAIR_SOCKET_FAIL_SENDS";

// A fresh pair id on `host` (an address this machine can listen on): its port is one the
// kernel handed out for `host` and released. Unavailable when no port could be had.
Result<std::string> NewSocketKvPairId(const std::string& host);

// Whether `id` is one NewSocketKvPairId made (and not, e.g., an NCCL unique id).
bool IsSocketKvPairId(const std::string& id);

// The channel of `rank` (0 sends, 1 receives) of the pair `id`. Rank 1 listens at once:
// Unavailable naming the address when it cannot. InvalidArgument for a rank other than 0 or 1
// or an id that is not a socket pair id.
Result<std::unique_ptr<KvPairChannel>> MakeSocketKvPairChannel(const std::string& id, int rank);

}  // namespace kvshard
