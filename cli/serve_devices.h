// The devices of `kvshard serve` (issue 13, item 4): `backend:` resolved against the devices this
// machine has, and on GPUs every worker placed on its pool's `devices:` ordinal with a KV pool
// sized from the device's free memory × kv_cache.gpu_memory_utilization, less the rank's resident
// weights (ResidentWeightBytes: the CUDA backend's forms, from the file's tensor table) and its
// buffers (GpuRankReserveBytes). The device query is passed in, so tests plan against fake GPUs;
// everything here runs before any weight is read.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/device.h"
#include "common/status.h"
#include "config/device_plan.h"
#include "config/server_config.h"
#include "model/model_file.h"
#include "worker/kv_handoff_pairs.h"
#include "worker/model_runner.h"

namespace kvshard::cli {

// Bytes of one KV block (the layers of one KV cache group: every layer without sliding windows,
// kv/kv_cache_groups.h) on the rank of an instance of size tp that holds the most KV
// heads, in `storage`.
int64_t KvBlockBytes(const ModelSpec& spec, KvDtype storage, int64_t block_size, int tp);

// Device memory a GPU rank of an instance of size tp uses beside its weights and KV pool: the
// runner's workspace and step inputs sized for `runner`'s step (ModelRunner::EnsureWorkspace), the
// CUDA backend's own buffers (CudaBackend::kFixedBytes, the activation copy grown to the step's
// widest product) and a margin for cuBLAS and the kernels' modules.
int64_t GpuRankReserveBytes(const ModelSpec& spec, const RunnerOptions& runner, int64_t max_context,
                            int tp);

// Device memory the KV pair path (kv_transfer.path: nccl) holds on a GPU rank beside its pool:
// a prefill rank's offers up to their bound (kKvPairMaxOfferBytes, worker/
// kv_handoff_pairs_buffers.h); a decode rank's receive buffer, at most one prompt of max_context
// tokens in its KV heads, rounded up to its size class; 0 for a rank of a mixed pool.
int64_t KvPairReserveBytes(const ModelSpec& spec, const RunnerOptions& runner, int64_t max_context,
                           PoolRole role, int tp);

// The plan of every rank of `pools` for config `c` (its backend, kv_cache.gpu_memory_utilization,
// kv_cache.num_blocks, weight_format, cuda_graphs): on the CPU, the warnings about GPU devices
// the CPU ignores; on cuda, PlanDevices' placement and one-line refusals.
// `runner` is an instance's runner options before placement (step sizes, KV storage). With
// kv_transfer.path: nccl each rank's buffers count its KvPairReserveBytes too.
// `force_staged_collectives`: serve's --stage-collectives (every tp > 1 instance stages its
// all-reduces through the host, so cuda_graphs: true is refused with it at tp > 1).
Result<DevicePlan> PlanServeDevices(const ServerConfig& c, const std::vector<PoolConfig>& pools,
                                    const ModelFile& model, const RunnerOptions& runner,
                                    int64_t max_context, bool built_with_cuda,
                                    const DeviceQuery& devices,
                                    bool force_staged_collectives = false);

// Puts instance `instance` of pool `pool` where `plan` placed it: on cuda, the backend on its GPU
// and the plan's KV block count; unchanged on the CPU.
void ApplyDevicePlan(const DevicePlan& plan, int pool, int instance, RunnerOptions* runner);

// The GPU of each rank of instance `instance` of pool `pool`, rank by rank (an ordinal repeats
// where ranks share a GPU); empty on the CPU.
std::vector<int> RankGpus(const DevicePlan& plan, int pool, int instance);

// The KV handoff path between the prefill and decode pools of `pools` (ChooseKvHandoffPath,
// worker/kv_handoff_path.h) from kv_transfer.path, workers.mode and `plan`'s GPUs (on cuda: every
// pair of a prefill rank's GPU and a decode rank's GPU asked `can_access_peer(to, from)`); empty
// when no pool is a prefill or decode pool. InvalidArgument naming kv_transfer.path when the
// requested path cannot serve this config.
// `socket_pair_link`: the test knob (SocketPairLinkFromEnvironment).
Result<std::optional<KvHandoffPath>> ServeKvHandoffPath(
    const ServerConfig& c, const std::vector<PoolConfig>& pools, const DevicePlan& plan,
    const std::function<bool(int to, int from)>& can_access_peer, bool socket_pair_link = false);

// The KV pair path's test knob, KVSHARD_KV_PAIR_LINK (tests only: never set it to serve): unset
// or empty is false, "socket" true (kv_transfer.path: nccl then runs its pairs over TCP between
// CPU worker processes of this machine); anything else InvalidArgument naming the variable.
Result<bool> SocketPairLinkFromEnvironment();

// One instance as the KV pair path plans it.
struct KvPairInstance {
    std::string name;
    int tp = 1;
    PoolRole role = PoolRole::kMixed;
};

// The settings the pair path adds to each rank of each instance (RemoteInstanceOptions::
// rank_settings; outer: `instances` in order, inner: ranks; empty for a mixed instance): its
// pairs (PlanKvNcclPairs between every prefill and every decode instance), the link and
// `timeout_ms` for every send and receive. Each pair's id is made for `link`: nccl, a fresh NCCL
// unique id (NewNcclUniqueId, comm/collective.h, as the registry makes a tp group's); socket, a
// fresh socket pair id on `host` (NewSocketKvPairId). PlanKvNcclPairs' errors; the id maker's
// (Unavailable when no port could be had; Unimplemented for nccl in a build without CUDA).
Result<std::vector<std::vector<std::vector<std::pair<std::string, std::string>>>>>
KvPairRankSettings(const ModelSpec& spec, const std::vector<KvPairInstance>& instances,
                   KvPairLink link, const std::string& host, int64_t timeout_ms);

// serve's startup line for the KV pair path on `link` (appended to the device plan's handoff
// line): socket, a test link; nccl, wired on GPUs but never run on one in kvshard's tests.
std::string KvPairLinkNote(KvPairLink link);

}  // namespace kvshard::cli
