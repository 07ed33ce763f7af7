#include "cli/serve_devices.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>

#include "cli/kv_pair_replan.h"
#include "common/build_config.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/paged_attention.h"
#include "kv/kv_cache_groups.h"
#include "kv/kv_geometry.h"
#include "worker/decode_buckets.h"
#include "worker/kv_handoff_nccl_pairs.h"
#include "worker/kv_handoff_pairs.h"
#include "worker/kv_handoff_path.h"
#include "worker/shard.h"
#include "worker/weights.h"

namespace kvshard::cli {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// cuBLAS's and cuBLASLt's handles and the kernels' modules, loaded into the context after the
// device query measured its free memory.
constexpr int64_t kModuleMarginBytes = 256 * kMiB;

int64_t Aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

kv::KvCacheGroups GroupsOf(const ModelSpec& spec) {
    Result<kv::KvCacheGroups> g = kv::MakeKvCacheGroups(kv::LayerWindows(spec));
    KV_CHECK(g.ok()) << g.status().ToString();
    return std::move(*g);
}

int64_t LayersPerBlock(const ModelSpec& spec) { return GroupsOf(spec).layers_per_group; }

}  // namespace

int64_t KvBlockBytes(const ModelSpec& spec, KvDtype storage, int64_t block_size, int tp) {
    // The widest rank by kv/'s one rule; a tp the model cannot shard is refused later, by the
    // workers, so size for all heads meanwhile.
    const Result<int64_t> widest = kv::MaxLocalKvHeads(spec.num_heads, spec.num_kv_heads, tp);
    const int64_t local_kv = widest.ok() ? *widest : spec.num_kv_heads;
    // A block holds one KV cache group's layers (all of them without sliding windows).
    return LayersPerBlock(spec) *
           cpu::PagedLayerBytes(storage, block_size, local_kv, spec.head_dim);
}

int64_t GpuRankReserveBytes(const ModelSpec& spec, const RunnerOptions& runner, int64_t max_context,
                            int tp) {
    const int64_t rows = std::max<int64_t>(1, runner.max_step_tokens);
    const int64_t seqs = std::max<int64_t>(1, runner.max_step_seqs);
    // The widest rank: ceil of every split.
    const int64_t heads = (spec.num_heads + tp - 1) / tp;
    const int64_t kv_heads = std::min<int64_t>(
        spec.num_kv_heads, (spec.num_kv_heads + tp - 1) / tp + (tp > 1 ? 1 : 0));
    const int64_t q_dim = heads * spec.head_dim;
    const int64_t qkv_dim = q_dim + 2 * kv_heads * spec.head_dim;
    const int64_t ffn = (spec.ffn_size + tp - 1) / tp + ShardLayout::kColumnAlign;
    const int64_t vocab = (spec.vocab_size + tp - 1) / tp;
    const int64_t logits = tp == 1 ? spec.vocab_size : vocab * (1 + tp);
    // ModelRunner::EnsureWorkspace: x, xn, partial (hidden), qkv, att, gate_up, act per token.
    const int64_t workspace =
        4 * (rows * (3 * spec.hidden_size + qkv_dim + q_dim + 3 * ffn) + seqs * logits);
    // Slots, table starts and tables repeat per KV cache group.
    const int64_t groups = GroupsOf(spec).num_groups();
    const int64_t table_entries =
        groups * seqs * ((max_context + runner.block_size - 1) / runner.block_size);
    const int64_t inputs =
        rows * (4 + 4 + 8 * groups) + seqs * (4 * (3 + groups)) + table_entries * 4;
    const int64_t activation_copy =
        std::max<int64_t>(static_cast<int64_t>(cuda::CudaBackend::kInitialActivationBytes),
                          rows * std::max({spec.hidden_size, q_dim, ffn}) * 2);
    return Aligned(workspace) + Aligned(inputs) + cuda::CudaBackend::kFixedBytes -
           static_cast<int64_t>(cuda::CudaBackend::kInitialActivationBytes) + activation_copy +
           kModuleMarginBytes;
}

int64_t KvPairReserveBytes(const ModelSpec& spec, const RunnerOptions& runner, int64_t max_context,
                           PoolRole role, int tp) {
    switch (role) {
        case PoolRole::kPrefill:
            return kKvPairMaxOfferBytes;
        case PoolRole::kDecode: {
            // One receive of a whole prompt from a pair that sends all of this rank's heads
            // (the widest pair), every KV cache group's block-layers, in its size class.
            const int64_t block_size = std::max<int64_t>(1, runner.block_size);
            const int64_t blocks =
                (std::max<int64_t>(1, max_context) + block_size - 1) / block_size;
            const int64_t bytes = blocks * KvBlockBytes(spec, runner.kv_storage, block_size, tp) *
                                  GroupsOf(spec).num_groups();
            return KvPairBufferClass(bytes);
        }
        case PoolRole::kMixed:
            return 0;
    }
    return 0;
}

Result<DevicePlan> PlanServeDevices(const ServerConfig& c, const std::vector<PoolConfig>& pools,
                                    const ModelFile& model, const RunnerOptions& runner,
                                    int64_t max_context, bool built_with_cuda,
                                    const DeviceQuery& devices, bool force_staged_collectives) {
    DevicePlanInputs in;
    in.backend = c.backend;
    in.built_with_cuda = built_with_cuda;
    in.gpus = devices.devices;
    in.no_device_reason = devices.error;
    in.gpu_memory_utilization = c.kv_cache.gpu_memory_utilization;
    in.fixed_kv_blocks = c.kv_cache.num_blocks;
    in.cuda_graphs = c.cuda_graphs;
    in.force_staged_collectives = force_staged_collectives;
    KV_ASSIGN_OR_RETURN(bool cuda, ResolveCudaBackend(in.backend, built_with_cuda,
                                                      static_cast<int>(in.gpus.size()),
                                                      in.no_device_reason));
    std::map<int, int64_t> weight_bytes;  // by tp
    if (cuda) {
        for (const PoolConfig& p : pools) {
            for (const InstanceConfig& i : p.instances) {
                if (weight_bytes.count(i.tp) != 0) continue;
                // Rank 0 holds the most of every uneven split.
                KV_ASSIGN_OR_RETURN(
                    weight_bytes[i.tp],
                    ResidentWeightBytes(model, BackendKind::kCuda,
                                        {.shard = {.rank = 0, .tp = i.tp},
                                         .format = runner.weight_format}));
            }
        }
    }
    const ModelSpec& spec = model.spec();
    in.weight_bytes_per_rank = [&weight_bytes](int tp) { return weight_bytes.at(tp); };
    in.kv_bytes_per_block = [&](int tp) {
        return KvBlockBytes(spec, runner.kv_storage, runner.block_size, tp);
    };
    const bool pair_path = c.kv_transfer.path == KvHandoffPath::kNccl;
    in.reserve_bytes_per_rank = [&](PoolRole role, int tp) {
        return GpuRankReserveBytes(spec, runner, max_context, tp) +
               (pair_path ? KvPairReserveBytes(spec, runner, max_context, role, tp) : 0);
    };
    // One graph per decode bucket of the step's sequence limit (worker/decode_buckets.h).
    in.graph_bytes_per_rank = [&](int tp) {
        return CudaGraphBytes(
            spec.num_layers,
            static_cast<int64_t>(DecodeBuckets(std::max<int64_t>(1, runner.max_step_seqs)).size()),
            tp);
    };
    return PlanDevices(pools, in);
}

void ApplyDevicePlan(const DevicePlan& plan, int pool, int instance, RunnerOptions* runner) {
    if (!plan.cuda) return;
    const RankPlacement* rp = plan.Find(pool, instance, 0);
    if (rp == nullptr) return;
    runner->backend.kind = BackendKind::kCuda;
    runner->backend.device = rp->gpu;
    runner->num_kv_blocks = rp->kv_blocks;
}

std::vector<int> RankGpus(const DevicePlan& plan, int pool, int instance) {
    std::vector<int> gpus;
    if (!plan.cuda) return gpus;
    for (int rank = 0;; ++rank) {
        const RankPlacement* rp = plan.Find(pool, instance, rank);
        if (rp == nullptr) return gpus;
        gpus.push_back(rp->gpu);
    }
}

Result<std::optional<KvHandoffPath>> ServeKvHandoffPath(
    const ServerConfig& c, const std::vector<PoolConfig>& pools, const DevicePlan& plan,
    const std::function<bool(int to, int from)>& can_access_peer, bool socket_pair_link) {
    KvHandoffPathFacts facts;
    facts.requested = c.kv_transfer.path;
    facts.backend = plan.cuda ? BackendKind::kCuda : BackendKind::kCpu;
    facts.embedded = c.workers.mode == WorkersMode::kEmbedded;
    // Both backends implement PeerCopy (kernels/backend.h): cuda with cudaMemcpyPeerAsync, the
    // CPU with memcpy.
    facts.backend_has_peer_copies = true;
    facts.can_access_peer = can_access_peer;
    // Worker processes the coordinator launches itself (one per rank) run on this machine.
    facts.one_node = c.workers.mode == WorkersMode::kProcesses &&
                     c.workers.launcher == WorkersLauncher::kDirect;
    facts.nccl_built = KVSHARD_WITH_CUDA != 0;
    facts.socket_pair_link = socket_pair_link;
    bool disaggregated = false;
    for (size_t p = 0; p < pools.size(); ++p) {
        if (pools[p].role == PoolRole::kMixed) continue;
        disaggregated = true;
        std::vector<int>& gpus =
            pools[p].role == PoolRole::kPrefill ? facts.src_gpus : facts.dst_gpus;
        for (size_t i = 0; i < pools[p].instances.size(); ++i) {
            for (int gpu : RankGpus(plan, static_cast<int>(p), static_cast<int>(i)))
                gpus.push_back(gpu);
        }
    }
    if (!disaggregated) return std::optional<KvHandoffPath>();
    KV_ASSIGN_OR_RETURN(KvHandoffPath path, ChooseKvHandoffPath(facts));
    return std::optional<KvHandoffPath>(path);
}

Result<bool> SocketPairLinkFromEnvironment() {
    const char* env = std::getenv("KVSHARD_KV_PAIR_LINK");
    if (env == nullptr || *env == '\0') return false;
    if (std::string_view(env) == "socket") return true;
    return InvalidArgument("KVSHARD_KV_PAIR_LINK: '" + std::string(env) +
                           "' is not socket (the only test link; leave it unset to serve)");
}

Result<std::vector<std::vector<std::vector<std::pair<std::string, std::string>>>>>
KvPairRankSettings(const ModelSpec& spec, const std::vector<KvPairInstance>& instances,
                   KvPairLink link, const std::string& host, int64_t timeout_ms) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<KvPairPlan> plan,
                        KvPairPlan::Create(spec, instances, link, host, timeout_ms));
    std::vector<std::vector<std::vector<std::pair<std::string, std::string>>>> out;
    for (size_t i = 0; i < instances.size(); ++i) out.push_back(plan->RankSettings(i));
    return out;
}

std::string KvPairLinkNote(KvPairLink link) {
    switch (link) {
        case KvPairLink::kSocket:
            return "the pairs over TCP sockets (KVSHARD_KV_PAIR_LINK=socket, tests only), not NCCL";
        case KvPairLink::kNccl:
            return "the pairs over NCCL point-to-point between the GPUs, each pair's KV staged in "
                   "device memory; this path is wired but has never run on a GPU in kvshard's "
                   "tests (use host-staged if it misbehaves)";
    }
    return "";
}

}  // namespace kvshard::cli
