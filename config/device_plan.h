// Where every worker of the serving config runs and how large its KV pool is (issue 13, item 4):
// `backend:` resolved (auto: cuda when this kvshard is built with CUDA and a device is present),
// each rank of each instance placed on its GPU (pools[].instances[].devices, or the next free
// ordinals when none are given), and on a GPU the KV pool sized from the device's free memory ×
// kv_cache.gpu_memory_utilization, less the rank's weights and its fixed buffers, shared evenly by
// the ranks placed on that device. Pure: the device query is passed in (tests inject it), and the
// plan is made before any weight is read.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/device.h"
#include "common/status.h"
#include "config/collective_path.h"
#include "config/server_config.h"

namespace kvshard {

// One device as the CUDA runtime reports it (common/device.h QueryDevices).
using GpuInfo = DeviceInfo;

struct DevicePlanInputs {
    ServeBackend backend = ServeBackend::kCpu;
    bool built_with_cuda = false;
    std::vector<GpuInfo> gpus;  // every device found (empty: none, or a build without CUDA)
    std::string no_device_reason;  // why `gpus` is empty (DeviceQuery::error), for the message
    double gpu_memory_utilization = 0.9;
    int64_t fixed_kv_blocks = 0;  // kv_cache.num_blocks; 0: from the free memory
    // Per rank of an instance of tensor-parallel size tp: its weight bytes, one KV block's bytes
    // (every layer), and the device buffers beside them (activations, workspaces; by the rank's
    // pool role too, since a prefill and a decode rank of the KV pair path hold different
    // handoff buffers).
    std::function<int64_t(int tp)> weight_bytes_per_rank;
    std::function<int64_t(int tp)> kv_bytes_per_block;
    std::function<int64_t(PoolRole role, int tp)> reserve_bytes_per_rank;
    // cuda_graphs: true (ServerConfig::cuda_graphs): refused on the CPU, and at tp > 1 unless
    // the instance's collective is nccl (config/collective_path.h: every rank on a GPU of its
    // own, NCCL built, not staged); on a GPU each rank's decode graphs (graph_bytes_per_rank,
    // e.g. CudaGraphBytes) are counted beside its buffers.
    bool cuda_graphs = false;
    // Every tp > 1 instance stages its collectives through the host (serve's
    // --stage-collectives), which graphs cannot hold.
    bool force_staged_collectives = false;
    std::function<int64_t(int tp)> graph_bytes_per_rank;
};

// The device memory the decode graphs of one rank are estimated to hold: `num_buckets` graphs
// (worker/decode_buckets.h) of CudaGraphNodesPerLayer(tp) nodes per layer of `num_layers`, plus
// kCudaGraphFixedNodes, at kCudaGraphBytesPerNode each. The graphs use the runner's fixed
// buffers (no memory of their own for activations), so what they hold is the instantiated
// executable's per-node state; the per-node figure is from a measurement of graphs of empty
// kernels (about 33 MB more for 500 nodes more, CUDA 11.2), rounded up. docs/cuda.md.
//
// The kernels of one decode layer, as ModelRunner::QueueStep queues them on the CUDA backend
// (bf16 weights, a Llama layer: no biases, q/k norms or post norms; checked against the runner's
// op sequence by tests/worker/graph_nodes_test.cc):
//   QKV product: the bf16 copy of the activations + the cuBLASLt GEMM     2
//   RoPE + KV write (fused)                                               1
//   split-KV decode attention + the merge of its splits                   2
//   output product                                                        2
//   residual add + RMSNorm                                                1
//   gate|up product                                                       2
//   SiLU·mul                                                              1
//   down product                                                          2
//   residual add + RMSNorm (the last layer: the residual add alone)       1
inline constexpr int64_t kCudaGraphKernelsPerLayer = 14;
// At tp > 1 a layer's graph also holds its two NCCL all-reduces (row-parallel output and down).
inline constexpr int64_t kCudaGraphAllReducesPerLayer = 2;
// Outside the layers: the embedding, its all-reduce at tp > 1, the first RMSNorm, the gather of
// the last rows and the final norm (4 or 5), rounded up.
inline constexpr int64_t kCudaGraphFixedNodes = 8;
inline constexpr int64_t kCudaGraphBytesPerNode = int64_t{64} << 10;
int64_t CudaGraphNodesPerLayer(int tp);
int64_t CudaGraphBytes(int64_t num_layers, int64_t num_buckets, int tp);

struct RankPlacement {
    int pool = 0, instance = 0, rank = 0;
    int gpu = -1;  // -1: the CPU
    int ranks_on_gpu = 0;
    int64_t free_bytes = 0;    // the device's free memory
    int64_t usable_bytes = 0;  // free × utilization ÷ ranks on the device
    int64_t weight_bytes = 0, reserve_bytes = 0, kv_bytes = 0;
    int64_t graph_bytes = 0;  // the decode graphs' estimate (cuda_graphs: true), else 0
    int64_t kv_blocks = 0;
};

struct DevicePlan {
    bool cuda = false;  // the resolved backend: cuda, else cpu
    std::vector<RankPlacement> ranks;  // pool by pool, instance by instance, rank by rank (cuda)
    std::vector<std::string> warnings;  // e.g. devices ignored by the CPU backend
    // How KV moves from prefill to decode pools on GPUs (one line), or "" (no such pools, or
    // the CPU).
    std::string kv_handoff;
    // One line per GPU rank with the numbers `kvshard plan` prints for a pool, then kv_handoff.
    std::vector<std::string> Describe(const std::vector<PoolConfig>& pools) const;
    // The placement of rank `rank` of instance `instance` of pool `pool`; nullptr on the CPU.
    const RankPlacement* Find(int pool, int instance, int rank) const;
};

// Whether `backend` resolves to cuda (true) or cpu (false) with `device_count` devices.
// InvalidArgument for backend: cuda in a build without CUDA or with no device (`no_device_reason`,
// when given, says what the runtime reported).
Result<bool> ResolveCudaBackend(ServeBackend backend, bool built_with_cuda, int device_count,
                                const std::string& no_device_reason = "");

// InvalidArgument, one line naming the setting and the numbers: backend cuda in a build without
// CUDA or with no device; a devices entry "cpu" with backend cuda; a devices entry naming a missing
// GPU; tp larger than the GPUs present when no devices are given (an instance's devices may name
// one GPU more than once: those ranks share it, and its memory); compute capability below 8.0; a
// rank's weights and buffers over its share of free × gpu_memory_utilization, or room for no KV
// block, or fewer than kv_cache.num_blocks; cuda_graphs: true on the CPU, or with an instance of tp
// above 1 whose all-reduces are not nccl (its ranks share a GPU, or stage their collectives):
// graphs at tp > 1 capture NCCL's all-reduces on each rank's stream, and only NCCL's.
Result<DevicePlan> PlanDevices(const std::vector<PoolConfig>& pools, const DevicePlanInputs& in);

}  // namespace kvshard
