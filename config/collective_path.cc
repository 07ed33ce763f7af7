#include "config/collective_path.h"

#include <set>

namespace kvshard {

std::string_view CollectivePathName(CollectivePath path) {
    switch (path) {
        case CollectivePath::kHost:
            return "host";
        case CollectivePath::kStaged:
            return "host-staged";
        case CollectivePath::kNccl:
            return "nccl";
    }
    return "unknown";
}

bool RanksHaveOwnGpus(const std::vector<int>& devices, int tp) {
    const std::set<int> distinct(devices.begin(), devices.end());
    return tp > 1 && devices.size() == static_cast<size_t>(tp) && distinct.size() == devices.size();
}

CollectivePath DecideCollectivePath(const CollectivePathFacts& facts) {
    if (facts.force_staged) return CollectivePath::kStaged;
    if (!facts.on_gpus) return CollectivePath::kHost;
    return RanksHaveOwnGpus(facts.devices, facts.tp) && facts.nccl_available
               ? CollectivePath::kNccl
               : CollectivePath::kStaged;
}

}  // namespace kvshard
