#include "comm/kv_nccl_pairs.h"

#include <set>
#include <utility>

#include "comm/wire_fields.h"

namespace kvshard {

std::string EncodeKvNcclPairs(const std::vector<KvNcclPairAssignment>& pairs) {
    std::string out;
    wire::Writer w(&out);
    w.Count(pairs.size());
    for (const KvNcclPairAssignment& p : pairs) {
        w.String(p.peer_instance);
        w.Fixed(p.peer_rank);
        w.Fixed(p.nccl_rank);
        w.Fixed(p.head_begin);
        w.Fixed(p.head_end);
        w.String(p.nccl_unique_id);
    }
    return out;
}

Result<std::vector<KvNcclPairAssignment>> DecodeKvNcclPairs(std::string_view bytes) {
    const std::string what = std::string(kKvNcclPairsSetting) + ": ";
    wire::Reader r(bytes);
    // The smallest pair: an empty name, four fields, an id's count (the id is checked below).
    constexpr size_t kMinPairBytes = 4 + 4 + 4 + 8 + 8 + 4;
    const uint32_t n = r.Count("kv_nccl_pairs.count", kMinPairBytes,
                               static_cast<uint32_t>(kMaxKvNcclPairsPerRank));
    std::vector<KvNcclPairAssignment> out;
    out.reserve(n);
    std::set<std::pair<std::string, int32_t>> peers;
    for (uint32_t i = 0; i < n && r.status().ok(); ++i) {
        KvNcclPairAssignment p;
        p.peer_instance = r.String("kv_nccl_pairs.peer_instance");
        p.peer_rank = r.Fixed<int32_t>("kv_nccl_pairs.peer_rank");
        p.nccl_rank = r.Fixed<int32_t>("kv_nccl_pairs.nccl_rank");
        p.head_begin = r.Fixed<int64_t>("kv_nccl_pairs.head_begin");
        p.head_end = r.Fixed<int64_t>("kv_nccl_pairs.head_end");
        p.nccl_unique_id = r.String("kv_nccl_pairs.nccl_unique_id");
        if (!r.status().ok()) break;
        const std::string pair = what + "pair " + std::to_string(i) + ": ";
        if (p.peer_instance.empty() || p.peer_instance.size() > kMaxKvNcclInstanceName) {
            return InvalidArgument(pair + "peer instance name of " +
                                   std::to_string(p.peer_instance.size()) + " bytes, must be 1.." +
                                   std::to_string(kMaxKvNcclInstanceName));
        }
        if (p.peer_rank < 0 || p.peer_rank >= kMaxKvNcclPeerRank) {
            return InvalidArgument(pair + "peer rank " + std::to_string(p.peer_rank) +
                                   " outside [0, " + std::to_string(kMaxKvNcclPeerRank) + ")");
        }
        if (p.nccl_rank != 0 && p.nccl_rank != 1) {
            return InvalidArgument(pair + "nccl rank " + std::to_string(p.nccl_rank) +
                                   " must be 0 (sender) or 1 (receiver)");
        }
        if (p.head_begin < 0 || p.head_begin >= p.head_end || p.head_end > kMaxKvNcclHeads) {
            return InvalidArgument(pair + "heads [" + std::to_string(p.head_begin) + ", " +
                                   std::to_string(p.head_end) +
                                   ") must be a non-empty range within [0, " +
                                   std::to_string(kMaxKvNcclHeads) + ")");
        }
        if (p.nccl_unique_id.size() != kKvNcclUniqueIdBytes) {
            return InvalidArgument(pair + "NCCL unique id of " +
                                   std::to_string(p.nccl_unique_id.size()) + " bytes, expected " +
                                   std::to_string(kKvNcclUniqueIdBytes));
        }
        if (!peers.emplace(p.peer_instance, p.peer_rank).second) {
            return InvalidArgument(pair + "a second pair with instance '" + p.peer_instance +
                                   "' rank " + std::to_string(p.peer_rank));
        }
        out.push_back(std::move(p));
    }
    r.Finish();
    if (!r.status().ok()) return DataLoss(what + r.status().message());
    return out;
}

}  // namespace kvshard
