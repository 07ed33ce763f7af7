#include "config/engine_config.h"

#include <limits>
#include <string>

#include "common/kv_types.h"

namespace kvshard {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

Status SchedulerConfig::Validate() const {
    if (max_num_seqs <= 0) {
        return InvalidArgument("scheduler.max_num_seqs must be positive, got " + Str(max_num_seqs));
    }
    if (max_num_batched_tokens < max_num_seqs) {
        return InvalidArgument("scheduler.max_num_batched_tokens (" + Str(max_num_batched_tokens) +
                               ") must be >= scheduler.max_num_seqs (" + Str(max_num_seqs) +
                               "): every running sequence needs one token per step");
    }
    if (max_waiting_requests < 0) {
        return InvalidArgument("scheduler.max_waiting_requests must be >= 0, got " +
                               Str(max_waiting_requests));
    }
    return Status::Ok();
}

Status BlockManagerConfig::Validate() const {
    if (num_blocks <= 0 || num_blocks > std::numeric_limits<kv::BlockId>::max()) {
        return InvalidArgument("num_blocks must be in [1, " +
                               Str(std::numeric_limits<kv::BlockId>::max()) + "], got " +
                               Str(num_blocks));
    }
    if (block_size <= 0 || block_size > (int64_t{1} << 20)) {
        return InvalidArgument("block_size must be in [1, 1048576], got " + Str(block_size));
    }
    if (!(watermark >= 0.0 && watermark < 1.0)) {
        return InvalidArgument("watermark must be in [0, 1), got " + std::to_string(watermark));
    }
    if (!(max_pinned_fraction >= 0.0 && max_pinned_fraction <= 1.0)) {
        return InvalidArgument("max_pinned_fraction must be in [0, 1], got " +
                               std::to_string(max_pinned_fraction));
    }
    if (min_pinned_tokens < 0) {
        return InvalidArgument("min_pinned_tokens must be >= 0, got " + Str(min_pinned_tokens));
    }
    if (static_cast<int64_t>(group_windows.size()) > kv::kMaxKvCacheGroups) {
        return InvalidArgument("group_windows has " +
                               Str(static_cast<int64_t>(group_windows.size())) +
                               " groups, more than " + Str(kv::kMaxKvCacheGroups));
    }
    for (size_t g = 0; g < group_windows.size(); ++g) {
        if (group_windows[g] < 0) {
            return InvalidArgument("group_windows[" + Str(static_cast<int64_t>(g)) +
                                   "] must be >= 0 (0: full attention), got " +
                                   Str(group_windows[g]));
        }
    }
    return Status::Ok();
}

std::string_view KvHandoffPathName(KvHandoffPath path) {
    switch (path) {
        case KvHandoffPath::kHostStaged:
            return "host-staged";
        case KvHandoffPath::kPeerCopy:
            return "peer";
        case KvHandoffPath::kNccl:
            return "nccl";
    }
    return "?";
}

Result<KvHandoffPath> ParseKvHandoffPath(std::string_view name) {
    for (KvHandoffPath p :
         {KvHandoffPath::kHostStaged, KvHandoffPath::kPeerCopy, KvHandoffPath::kNccl}) {
        if (name == KvHandoffPathName(p)) return p;
    }
    return InvalidArgument("'" + std::string(name) +
                           "' is not a KV handoff path (auto, host-staged, peer, nccl)");
}

std::string_view PoolRoleName(PoolRole role) {
    switch (role) {
        case PoolRole::kMixed:
            return "mixed";
        case PoolRole::kPrefill:
            return "prefill";
        case PoolRole::kDecode:
            return "decode";
    }
    return "mixed";
}

}  // namespace kvshard
