#include "config/device_plan.h"

#include <cstdio>
#include <map>
#include <set>

namespace kvshard {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::string Mib(int64_t bytes) { return std::to_string(bytes / kMiB) + " MiB"; }

std::string InstanceKey(const std::vector<PoolConfig>& pools, size_t p, size_t i) {
    return "pools[" + std::to_string(p) + "] (" + pools[p].name + ").instances[" +
           std::to_string(i) + "]";
}

std::string Ordinals(const std::vector<GpuInfo>& gpus) {
    std::string s;
    for (const GpuInfo& g : gpus) s += (s.empty() ? "" : ", ") + std::to_string(g.ordinal);
    return s.empty() ? "none" : s;
}

// Decode graphs at tp > 1 hold the instance's all-reduces, which only the nccl collective queues
// on the stream a capture records (config/collective_path.h; worker/model_runner_graphs.cc
// CheckCudaGraphs refuses the rest again on each rank).
Status CheckGraphCollectives(const std::vector<PoolConfig>& pools, const DevicePlan& plan,
                             const DevicePlanInputs& in) {
    for (size_t p = 0; p < pools.size(); ++p) {
        for (size_t i = 0; i < pools[p].instances.size(); ++i) {
            const int tp = pools[p].instances[i].tp;
            if (tp <= 1) continue;
            std::vector<int> gpus;
            for (int r = 0; r < tp; ++r) {
                const RankPlacement* rp = plan.Find(static_cast<int>(p), static_cast<int>(i), r);
                if (rp != nullptr) gpus.push_back(rp->gpu);
            }
            const CollectivePath path =
                DecideCollectivePath({.on_gpus = true,
                                      .tp = tp,
                                      .devices = gpus,
                                      .nccl_available = in.built_with_cuda,
                                      .force_staged = in.force_staged_collectives});
            if (path == CollectivePath::kNccl) continue;
            const std::string at = "cuda_graphs: true with " + InstanceKey(pools, p, i) + ": ";
            const std::string why = ", so their all-reduces are " +
                                    std::string(CollectivePathName(path)) +
                                    " (they wait on the host) and cannot be captured in a graph";
            if (in.force_staged_collectives) {
                return InvalidArgument(at + "its " + std::to_string(tp) +
                                       " ranks stage their collectives (--stage-collectives)" +
                                       why);
            }
            std::map<int, int> on;
            for (int g : gpus) ++on[g];
            for (const auto& [gpu, n] : on) {
                if (n > 1) {
                    return InvalidArgument(at + std::to_string(n) + " of its " +
                                           std::to_string(tp) + " ranks share GPU " +
                                           std::to_string(gpu) + why +
                                           " (give each rank a GPU of its own in devices)");
                }
            }
            // Not reached while plan.cuda implies a CUDA (and so NCCL) build; kept so that a
            // new reason for the staged path is refused, not captured.
            return InvalidArgument(at + "its " + std::to_string(tp) +
                                   " ranks cannot form an NCCL group" + why);
        }
    }
    return Status::Ok();
}

}  // namespace

Result<bool> ResolveCudaBackend(ServeBackend backend, bool built_with_cuda, int device_count,
                                const std::string& no_device_reason) {
    switch (backend) {
        case ServeBackend::kCpu:
            return false;
        case ServeBackend::kCuda:
            if (!built_with_cuda) {
                return InvalidArgument("backend: cuda: this kvshard was built without CUDA");
            }
            if (device_count <= 0) {
                return InvalidArgument(
                    "backend: cuda: no CUDA device found (0 devices" +
                    (no_device_reason.empty() ? std::string() : "; " + no_device_reason) + ")");
            }
            return true;
        case ServeBackend::kAuto:
            return built_with_cuda && device_count > 0;
    }
    return false;
}

int64_t CudaGraphNodesPerLayer(int tp) {
    return kCudaGraphKernelsPerLayer + (tp > 1 ? kCudaGraphAllReducesPerLayer : 0);
}

int64_t CudaGraphBytes(int64_t num_layers, int64_t num_buckets, int tp) {
    return num_buckets * (CudaGraphNodesPerLayer(tp) * num_layers + kCudaGraphFixedNodes) *
           kCudaGraphBytesPerNode;
}

Result<DevicePlan> PlanDevices(const std::vector<PoolConfig>& pools, const DevicePlanInputs& in) {
    DevicePlan plan;
    KV_ASSIGN_OR_RETURN(plan.cuda,
                        ResolveCudaBackend(in.backend, in.built_with_cuda,
                                           static_cast<int>(in.gpus.size()), in.no_device_reason));
    if (in.cuda_graphs && !plan.cuda) {
        return InvalidArgument(
            "cuda_graphs: true with backend: " + std::string(ServeBackendName(in.backend)) +
            " (the workers run on the CPU): CUDA graphs are captured on "
            "the cuda backend only");
    }
    if (!plan.cuda) {
        for (size_t p = 0; p < pools.size(); ++p) {
            for (size_t i = 0; i < pools[p].instances.size(); ++i) {
                for (const std::string& d : pools[p].instances[i].devices) {
                    if (d != "cpu") {
                        plan.warnings.push_back(InstanceKey(pools, p, i) + ".devices: GPU " + d +
                                                " ignored: the workers run on the CPU (backend: " +
                                                std::string(ServeBackendName(in.backend)) + ")");
                        break;
                    }
                }
            }
        }
        return plan;
    }
    if (!(in.gpu_memory_utilization > 0 && in.gpu_memory_utilization <= 1)) {
        return InvalidArgument("kv_cache.gpu_memory_utilization: " +
                               std::to_string(in.gpu_memory_utilization) + ": must be in (0, 1]");
    }
    std::map<int, const GpuInfo*> by_ordinal;
    for (const GpuInfo& g : in.gpus) by_ordinal[g.ordinal] = &g;
    // Place every rank first: the memory of a device is shared by the ranks placed on it.
    int next_free = 0;
    for (size_t p = 0; p < pools.size(); ++p) {
        for (size_t i = 0; i < pools[p].instances.size(); ++i) {
            const InstanceConfig& inst = pools[p].instances[i];
            const std::string key = InstanceKey(pools, p, i);
            // Ranks share a GPU (and stage their all-reduces through the host) only where
            // `devices` says so; placed automatically, each rank gets a GPU of its own.
            if (inst.devices.empty() && inst.tp > static_cast<int>(in.gpus.size())) {
                return InvalidArgument(key + ".tp: " + std::to_string(inst.tp) +
                                       " is larger than the " + std::to_string(in.gpus.size()) +
                                       " GPUs present (" + Ordinals(in.gpus) +
                                       "); list the same GPU more than once in devices to share "
                                       "one");
            }
            for (int r = 0; r < inst.tp; ++r) {
                RankPlacement rp{.pool = static_cast<int>(p), .instance = static_cast<int>(i), .rank = r};
                if (inst.devices.empty()) {
                    rp.gpu = in.gpus[static_cast<size_t>(next_free++) % in.gpus.size()].ordinal;
                } else {
                    const std::string& d = inst.devices[static_cast<size_t>(r)];
                    const std::string at = key + ".devices[" + std::to_string(r) + "]";
                    if (d == "cpu") {
                        return InvalidArgument(at + ": cpu with backend: cuda (give every rank of "
                                               "a GPU instance a GPU ordinal)");
                    }
                    const int ordinal = std::stoi(d);  // pool_config.cc checked it is a number
                    if (by_ordinal.count(ordinal) == 0) {
                        return InvalidArgument(at + ": GPU " + d + " does not exist (" +
                                               std::to_string(in.gpus.size()) + " devices: " +
                                               Ordinals(in.gpus) + ")");
                    }
                    rp.gpu = ordinal;
                }
                const GpuInfo& g = *by_ordinal.at(rp.gpu);
                if (g.cc_major < 8) {
                    return InvalidArgument(key + ": GPU " + std::to_string(g.ordinal) + " (" +
                                           g.name + ") has compute capability " +
                                           std::to_string(g.cc_major) + "." +
                                           std::to_string(g.cc_minor) +
                                           "; the CUDA backend needs 8.0 or newer");
                }
                plan.ranks.push_back(rp);
            }
        }
    }
    if (in.cuda_graphs) KV_RETURN_IF_ERROR(CheckGraphCollectives(pools, plan, in));
    std::map<int, int> ranks_on;
    for (const RankPlacement& rp : plan.ranks) ++ranks_on[rp.gpu];
    for (RankPlacement& rp : plan.ranks) {
        const GpuInfo& g = *by_ordinal.at(rp.gpu);
        const int tp = pools[static_cast<size_t>(rp.pool)].instances[static_cast<size_t>(rp.instance)].tp;
        rp.ranks_on_gpu = ranks_on[rp.gpu];
        rp.free_bytes = g.free_bytes;
        rp.usable_bytes = static_cast<int64_t>(static_cast<double>(g.free_bytes) *
                                               in.gpu_memory_utilization) /
                          rp.ranks_on_gpu;
        rp.weight_bytes = in.weight_bytes_per_rank ? in.weight_bytes_per_rank(tp) : 0;
        const PoolRole role = pools[static_cast<size_t>(rp.pool)].role;
        rp.reserve_bytes = in.reserve_bytes_per_rank ? in.reserve_bytes_per_rank(role, tp) : 0;
        rp.graph_bytes =
            in.cuda_graphs && in.graph_bytes_per_rank ? in.graph_bytes_per_rank(tp) : 0;
        const int64_t block = in.kv_bytes_per_block ? in.kv_bytes_per_block(tp) : 0;
        const std::string key = InstanceKey(pools, static_cast<size_t>(rp.pool),
                                            static_cast<size_t>(rp.instance)) +
                                " rank " + std::to_string(rp.rank) + " on GPU " +
                                std::to_string(rp.gpu);
        char util[32];
        std::snprintf(util, sizeof util, "%.2f", in.gpu_memory_utilization);
        const std::string share = Mib(rp.free_bytes) + " free × kv_cache.gpu_memory_utilization " +
                                  util + (rp.ranks_on_gpu > 1
                                              ? " ÷ " + std::to_string(rp.ranks_on_gpu) + " ranks"
                                              : std::string()) +
                                  " = " + Mib(rp.usable_bytes);
        const int64_t left =
            rp.usable_bytes - rp.weight_bytes - rp.reserve_bytes - rp.graph_bytes;
        const std::string graphs =
            rp.graph_bytes > 0 ? " + CUDA graphs " + Mib(rp.graph_bytes) : std::string();
        if (left < 0) {
            return InvalidArgument(key + ": weights " + Mib(rp.weight_bytes) + " + buffers " +
                                   Mib(rp.reserve_bytes) + graphs + " do not fit in " + share);
        }
        rp.kv_blocks = block > 0 ? left / block : 0;
        if (rp.kv_blocks < 1) {
            return InvalidArgument(key + ": weights " + Mib(rp.weight_bytes) + " + buffers " +
                                   Mib(rp.reserve_bytes) + graphs + " leave " + Mib(left) +
                                   " of " + share +
                                   ": no room for one KV block of " + std::to_string(block) +
                                   " bytes");
        }
        if (in.fixed_kv_blocks > 0) {
            if (in.fixed_kv_blocks > rp.kv_blocks) {
                return InvalidArgument("kv_cache.num_blocks: " + std::to_string(in.fixed_kv_blocks) +
                                       " blocks do not fit " + key + ": " + Mib(left) + " left of " +
                                       share + " hold " + std::to_string(rp.kv_blocks));
            }
            rp.kv_blocks = in.fixed_kv_blocks;
        }
        rp.kv_bytes = rp.kv_blocks * block;
    }
    for (const PoolConfig& p : pools) {
        if (p.role == PoolRole::kMixed) continue;
        plan.kv_handoff =
            "KV handoff between pools: host-staged (the sending GPU's blocks copied to host "
            "memory, sent over the instances' KV transport, copied into the receiving GPU's blocks)";
        break;
    }
    return plan;
}

const RankPlacement* DevicePlan::Find(int pool, int instance, int rank) const {
    for (const RankPlacement& rp : ranks) {
        if (rp.pool == pool && rp.instance == instance && rp.rank == rank) return &rp;
    }
    return nullptr;
}

std::vector<std::string> DevicePlan::Describe(const std::vector<PoolConfig>& pools) const {
    std::vector<std::string> lines;
    for (const RankPlacement& rp : ranks) {
        if (rp.gpu < 0) continue;
        lines.push_back("pool " + pools[static_cast<size_t>(rp.pool)].name + " instance " +
                        std::to_string(rp.instance) + " rank " + std::to_string(rp.rank) +
                        ": GPU " + std::to_string(rp.gpu) + ", " + Mib(rp.free_bytes) +
                        " free, " + Mib(rp.usable_bytes) + " usable, weights " +
                        Mib(rp.weight_bytes) + ", buffers " + Mib(rp.reserve_bytes) + ", KV " +
                        std::to_string(rp.kv_blocks) + " blocks (" + Mib(rp.kv_bytes) + ")" +
                        (rp.graph_bytes > 0 ? ", CUDA graphs " + Mib(rp.graph_bytes) : ""));
    }
    if (!kv_handoff.empty()) lines.push_back(kv_handoff);
    return lines;
}

}  // namespace kvshard
