#include "worker/kv_handoff_nccl_pairs.h"

#include <map>
#include <set>
#include <utility>

#include "worker/kv_handoff.h"

namespace kvshard {

Result<std::vector<KvNcclPair>> PlanKvNcclPairs(
    const ModelSpec& spec, const std::vector<KvNcclInstance>& prefill,
    const std::vector<KvNcclInstance>& decode, const std::function<Result<std::string>()>& new_id) {
    std::set<std::string> names;
    for (const std::vector<KvNcclInstance>* side : {&prefill, &decode}) {
        for (const KvNcclInstance& i : *side) {
            if (!names.insert(i.name).second) {
                return InvalidArgument("kv_transfer.path: nccl: instance '" + i.name +
                                       "' named twice");
            }
        }
    }
    std::vector<KvNcclPair> pairs;
    std::map<std::pair<std::string, int>, size_t> per_rank;
    for (const KvNcclInstance& p : prefill) {
        for (const KvNcclInstance& d : decode) {
            KV_ASSIGN_OR_RETURN(std::vector<KvReshardMessage> plan,
                                KvReshardPlan(spec, p.tp, d.tp));
            for (const KvReshardMessage& m : plan) {
                for (const auto& key :
                     {std::pair{p.name, m.src_rank}, std::pair{d.name, m.dst_rank}}) {
                    if (++per_rank[key] > kMaxKvNcclPairsPerRank) {
                        return InvalidArgument(
                            "kv_transfer.path: nccl: instance '" + key.first + "' rank " +
                            std::to_string(key.second) + " would be in more than " +
                            std::to_string(kMaxKvNcclPairsPerRank) +
                            " NCCL pairs (one communicator each); use fewer instances");
                    }
                }
                KV_ASSIGN_OR_RETURN(std::string id, new_id());
                pairs.push_back({.prefill_instance = p.name,
                                 .src_rank = m.src_rank,
                                 .decode_instance = d.name,
                                 .dst_rank = m.dst_rank,
                                 .heads = m.heads,
                                 .nccl_unique_id = std::move(id)});
            }
        }
    }
    return pairs;
}

std::vector<KvNcclPairAssignment> KvNcclPairsOfRank(const std::vector<KvNcclPair>& pairs,
                                                    const std::string& instance, int rank) {
    std::vector<KvNcclPairAssignment> out;
    for (const KvNcclPair& p : pairs) {
        const bool sender = p.prefill_instance == instance && p.src_rank == rank;
        const bool receiver = p.decode_instance == instance && p.dst_rank == rank;
        if (!sender && !receiver) continue;
        out.push_back({.peer_instance = sender ? p.decode_instance : p.prefill_instance,
                       .peer_rank = sender ? p.dst_rank : p.src_rank,
                       .nccl_rank = sender ? 0 : 1,
                       .head_begin = p.heads.begin,
                       .head_end = p.heads.end,
                       .nccl_unique_id = p.nccl_unique_id});
    }
    return out;
}

}  // namespace kvshard
