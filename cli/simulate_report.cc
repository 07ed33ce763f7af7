#include "cli/simulate_report.h"

#include <cstdio>

namespace kvshard::cli {

std::string SimulationText(const sim::SimulationResult& r) {
    char line[256];
    std::string s = "---------------- Simulation ----------------\n";
    auto add = [&](const char* name, const std::string& value) {
        std::snprintf(line, sizeof line, "%-40s %s\n", name, value.c_str());
        s += line;
    };
    auto num = [](double v, int digits) {
        char b[64];
        std::snprintf(b, sizeof b, "%.*f", digits, v);
        return std::string(b);
    };
    add("GPUs:", std::to_string(r.gpus));
    add("KV blocks per instance:", std::to_string(r.kv_blocks_per_instance));
    add("Steps:", std::to_string(r.num_steps));
    add("KV usage mean / max (%):", num(100 * r.kv_usage_mean, 1) + " / " + num(100 * r.kv_usage_max, 1));
    add("Preemptions:", std::to_string(r.num_preemptions));
    add("Most requests waiting:", std::to_string(r.max_queued));
    add("Requests refused (queue full, 429):", std::to_string(r.num_refused));
    add("Requests timed out (504):", std::to_string(r.num_timed_out));
    add("Pin hits / expired / refused:", std::to_string(r.pin_hits) + " / " +
                                             std::to_string(r.pins_expired) + " / " +
                                             std::to_string(r.pins_refused));
    add("Most KV blocks pinned:", std::to_string(r.pinned_blocks_max));
    add("KV handoffs:", std::to_string(r.num_handoffs));
    add("KV handoff bytes (GB):", num(double(r.handoff_bytes) / 1e9, 3));
    for (const sim::PoolUsage& p : r.pools) {
        const std::string name = "Pool " + p.pool + " (" + p.role + ", " + std::to_string(p.instances) +
                                 " x " + std::to_string(p.instances > 0 ? p.gpus / p.instances : 0) +
                                 " GPUs) busy (%):";
        add(name.c_str(), num(100 * p.busy_fraction, 1));
    }
    add("Simulated / wall time (s):", num(r.simulated_seconds, 2) + " / " + num(r.wall_seconds, 2));
    s += "==================================================\n";
    return s;
}

nlohmann::json SimulationJson(const sim::SimulationResult& r) {
    nlohmann::json pools = nlohmann::json::array();
    for (const sim::PoolUsage& p : r.pools) {
        pools.push_back({{"pool", p.pool}, {"role", p.role}, {"instances", p.instances},
                         {"gpus", p.gpus}, {"steps", p.steps}, {"busy_fraction", p.busy_fraction}});
    }
    return {{"gpus", r.gpus},
            {"kv_blocks_per_instance", r.kv_blocks_per_instance},
            {"steps", r.num_steps},
            {"kv_usage_mean", r.kv_usage_mean},
            {"kv_usage_max", r.kv_usage_max},
            {"preemptions", r.num_preemptions},
            {"max_waiting", r.max_queued},
            {"refused", r.num_refused},
            {"timed_out", r.num_timed_out},
            {"pin_hits", r.pin_hits},
            {"pins_expired", r.pins_expired},
            {"pins_refused", r.pins_refused},
            {"pinned_blocks_max", r.pinned_blocks_max},
            {"kv_handoffs", r.num_handoffs},
            {"kv_handoff_bytes", r.handoff_bytes},
            {"pools", pools},
            {"simulated_seconds", r.simulated_seconds},
            {"wall_seconds", r.wall_seconds}};
}

std::string ProfileText(const std::string& path, const sim::CpuProfile& p) {
    char line[1024];
    std::snprintf(line, sizeof line,
                  "profile %s: step s = %.4g + %.4g x prefill tokens + %.4g x decode seqs + "
                  "%.4g x KV tokens + %.4g x prefill pairs + %.4g x cached chunks + %.4g x "
                  "multi-row steps + %.4g x warm-up (tau %g decode steps) + %.4g x prefill "
                  "steps, + %.4g per "
                  "request arriving during it (%lld points, %lld outliers given weight 0, rms "
                  "error %.3g s)\n",
                  path.c_str(), p.a, p.b, p.c, p.d, p.e, p.g, p.h, p.w, p.warm_tau, p.k, p.f,
                  static_cast<long long>(p.num_points), static_cast<long long>(p.num_outliers),
                  p.rms_error_s);
    std::string out = line;
    out += "profile " + path + ": per kind of step, the linear fit times the median measured / "
           "fitted: ";
    bool first = true;
    for (int k = 0; k < sim::kNumStepKinds; ++k) {
        if (p.kind_points[k] == 0) continue;
        char part[96];
        std::snprintf(part, sizeof part, "%s%s %.4f (%lld)", first ? "" : ", ",
                      std::string(sim::StepKindName(static_cast<sim::StepKind>(k))).c_str(),
                      p.kind_scale[k], static_cast<long long>(p.kind_points[k]));
        out += part;
        first = false;
    }
    return out + "\n";
}

}  // namespace kvshard::cli
