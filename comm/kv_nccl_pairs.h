// The communicators of the NCCL point-to-point KV handoff (kv_transfer.path: nccl, issue 13 item
// 6) as the coordinator hands them to a worker rank: one two-rank communicator per (prefill rank,
// decode rank) pair that exchanges KV heads, rank 0 the sender and rank 1 the receiver, each with
// its own NCCL unique id. A rank's pairs travel in its RegisterAck as the setting
// kKvNcclPairsSetting, encoded by EncodeKvNcclPairs (comm/wire_fields.h's fields).
//
// Bounds: what the coordinator says here is what a worker would create (a communicator, its
// buffers and a bootstrap connection per pair), so DecodeKvNcclPairs refuses, with one line
// naming the field, more than kMaxKvNcclPairsPerRank pairs, an id that is not an NCCL unique id's
// kKvNcclUniqueIdBytes bytes, a rank other than 0 or 1, a peer rank or head range outside
// [0, kMaxKvNcclPeerRank) / [0, kMaxKvNcclHeads), an empty head range, an instance name longer
// than kMaxKvNcclInstanceName and two pairs with one peer; DataLoss for bytes that do not
// decode (truncated, a count beyond the bytes, trailing bytes).
//
// Host code only: no CUDA or NCCL here (the ids are bytes; NewNcclUniqueId, comm/collective.h,
// makes them in CUDA builds), so the CPU build compiles and tests it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard {

inline constexpr std::string_view kKvNcclPairsSetting = "kv_nccl_pairs";
inline constexpr size_t kKvNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
inline constexpr size_t kMaxKvNcclPairsPerRank = 256;
inline constexpr int32_t kMaxKvNcclPeerRank = 1'024;
inline constexpr int64_t kMaxKvNcclHeads = 65'536;
inline constexpr size_t kMaxKvNcclInstanceName = 256;

// One pair as one of its two ranks sees it.
struct KvNcclPairAssignment {
    std::string peer_instance;  // the other side's instance
    int32_t peer_rank = 0;      // its rank in that instance
    int32_t nccl_rank = 0;      // this rank's in the pair's communicator: 0 sends, 1 receives
    // The global KV heads the pair exchanges, [head_begin, head_end) (KvReshardPlan).
    int64_t head_begin = 0;
    int64_t head_end = 0;
    std::string nccl_unique_id;  // kKvNcclUniqueIdBytes bytes, shared by both ranks
    friend bool operator==(const KvNcclPairAssignment&, const KvNcclPairAssignment&) = default;
};

std::string EncodeKvNcclPairs(const std::vector<KvNcclPairAssignment>& pairs);
// The pairs, or InvalidArgument naming the setting and the first bound broken (see above), or
// DataLoss for bytes that do not decode.
Result<std::vector<KvNcclPairAssignment>> DecodeKvNcclPairs(std::string_view bytes);

}  // namespace kvshard
