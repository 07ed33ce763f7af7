// The pairs of the NCCL point-to-point KV handoff (kv_transfer.path: nccl): every (prefill rank,
// decode rank) pair of a prefill instance and a decode instance that exchanges KV heads — the
// messages of KvReshardPlan (worker/kv_handoff.h), so a pair exists exactly where a re-sharded
// handoff moves heads — each with a fresh NCCL unique id for its two-rank communicator, rank 0
// the sender and rank 1 the receiver. KvNcclPairsOfRank is what one rank's RegisterAck carries
// (comm/kv_nccl_pairs.h); the registry hands it out (RemoteInstanceOptions::rank_settings).
//
// The ids come from `new_id` (NewNcclUniqueId in CUDA builds; tests pass fake ones), so the plan
// is host code, tested on the CPU.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "comm/kv_nccl_pairs.h"
#include "common/status.h"
#include "config/model_spec.h"
#include "worker/shard.h"

namespace kvshard {

struct KvNcclInstance {
    std::string name;
    int tp = 1;
};

struct KvNcclPair {
    std::string prefill_instance;
    int src_rank = 0;
    std::string decode_instance;
    int dst_rank = 0;
    IndexRange heads;  // global KV heads the pair exchanges
    std::string nccl_unique_id;
    friend bool operator==(const KvNcclPair&, const KvNcclPair&) = default;
};

// Every pair of every (prefill instance, decode instance), in the order of the instances given
// and, within one, KvReshardPlan's (src_rank, then dst_rank). InvalidArgument for a tp the spec
// cannot split (KvReshardPlan's), a duplicate instance name, or a rank that would be in more than
// kMaxKvNcclPairsPerRank pairs (naming kv_transfer.path); new_id's error as it is.
Result<std::vector<KvNcclPair>> PlanKvNcclPairs(const ModelSpec& spec,
                                                const std::vector<KvNcclInstance>& prefill,
                                                const std::vector<KvNcclInstance>& decode,
                                                const std::function<Result<std::string>()>& new_id);

// The pairs rank `rank` of instance `instance` is in, as it sees them (nccl_rank 0 on the
// prefill side, 1 on the decode side), in plan order: the order both ranks of every pair create
// their communicators in.
std::vector<KvNcclPairAssignment> KvNcclPairsOfRank(const std::vector<KvNcclPair>& pairs,
                                                    const std::string& instance, int rank);

}  // namespace kvshard
