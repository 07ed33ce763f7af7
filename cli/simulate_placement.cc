#include "cli/simulate_placement.h"

#include <algorithm>
#include <sstream>

namespace kvshard::cli {

Result<std::vector<PoolConfig>> ParsePlacement(const std::string& text) {
    std::vector<PoolConfig> pools;
    std::stringstream in(text);
    std::string item;
    while (std::getline(in, item, ',')) {
        const size_t eq = item.find('='), x = item.find('x', eq == std::string::npos ? 0 : eq);
        if (eq == std::string::npos || x == std::string::npos)
            return InvalidArgument("--placement: '" + item + "' is not ROLE=COUNTxTP");
        PoolConfig p;
        const std::string role = item.substr(0, eq);
        if (role == "mixed") {
            p.role = PoolRole::kMixed;
        } else if (role == "prefill") {
            p.role = PoolRole::kPrefill;
        } else if (role == "decode") {
            p.role = PoolRole::kDecode;
        } else {
            return InvalidArgument("--placement: role '" + role + "' is not mixed, prefill or decode");
        }
        int count = 0, tp = 0;
        try {
            count = std::stoi(item.substr(eq + 1, x - eq - 1));
            tp = std::stoi(item.substr(x + 1));
        } catch (const std::exception&) {
            return InvalidArgument("--placement: '" + item + "' is not ROLE=COUNTxTP");
        }
        if (count < 1 || tp < 1)
            return InvalidArgument("--placement: '" + item + "': count and tp must be positive");
        p.name = role;
        for (const PoolConfig& q : pools) {
            if (q.name == p.name) return InvalidArgument("--placement: role '" + role + "' given twice");
        }
        p.instances.assign(static_cast<size_t>(count), InstanceConfig{tp, {}});
        pools.push_back(p);
    }
    if (pools.empty()) return InvalidArgument("--placement is empty");
    const bool mixed = std::any_of(pools.begin(), pools.end(), [](auto& p) { return p.role == PoolRole::kMixed; });
    const bool prefill = std::any_of(pools.begin(), pools.end(), [](auto& p) { return p.role == PoolRole::kPrefill; });
    const bool decode = std::any_of(pools.begin(), pools.end(), [](auto& p) { return p.role == PoolRole::kDecode; });
    if (mixed ? (prefill || decode) : !(prefill && decode))
        return InvalidArgument("--placement: either mixed pools only, or a prefill and a decode pool");
    return pools;
}

std::string PlacementText(const std::vector<PoolConfig>& pools) {
    std::string s;
    for (const PoolConfig& p : pools) {
        if (!s.empty()) s += ",";
        s += std::string(PoolRoleName(p.role)) + "=" + std::to_string(p.instances.size()) + "x" +
             std::to_string(p.instances.empty() ? 0 : p.instances[0].tp);
    }
    return s;
}

std::vector<std::vector<PoolConfig>> Placements(int64_t gpus, int max_tp) {
    std::vector<int> tps;
    for (int t = 1; t <= max_tp; t *= 2) tps.push_back(t);
    auto pool = [](PoolRole role, int64_t n, int tp) {
        PoolConfig p;
        p.name = std::string(PoolRoleName(role));
        p.role = role;
        p.instances.assign(static_cast<size_t>(n), InstanceConfig{tp, {}});
        return p;
    };
    std::vector<std::vector<PoolConfig>> out;
    for (int t : tps) {
        if (gpus % t == 0) out.push_back({pool(PoolRole::kMixed, gpus / t, t)});
    }
    for (int tp_p : tps) {
        for (int tp_d : tps) {
            for (int64_t np = 1; np * tp_p < gpus; ++np) {
                const int64_t rest = gpus - np * tp_p;
                if (rest % tp_d != 0) continue;
                out.push_back({pool(PoolRole::kPrefill, np, tp_p),
                               pool(PoolRole::kDecode, rest / tp_d, tp_d)});
            }
        }
    }
    return out;
}

}  // namespace kvshard::cli
