// What the attention kernels share: the two prefill kernels (kernels/cuda/prefill_attention.cu,
// fp32 FMA, and kernels/cuda/prefill_attention_tc.cu, tensor cores) their arguments, which the
// paged decode kernel's (backend_kernels.cu AttnArgs) extend, and all three the GQA-group
// bookkeeping each block does (which query heads read a KV head). Device code only.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cuda/kv_tile.cuh"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

struct PrefillArgs {
    const float* q;
    int64_t q_stride;
    KvArgs kv;
    int64_t num_seqs;
    const int32_t* query_starts;
    const int32_t* context_lens;
    const int32_t* block_table_starts;
    const int32_t* block_tables;
    float* out;
    int64_t num_heads;
    const int32_t* kv_head_of_q;  // null: h / (num_heads / num_kv_heads)
    float scale;                  // 1 / sqrt(head_dim)
    int64_t window;
};

inline PrefillArgs MakePrefillArgs(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                                   const cpu::PagedAttentionBatch& batch, float* out,
                                   int64_t num_heads, const int32_t* kv_head_of_q) {
    return {q,
            q_stride,
            ToArgs(kv),
            batch.num_seqs,
            batch.query_starts,
            batch.context_lens,
            batch.block_table_starts,
            batch.block_tables,
            out,
            num_heads,
            kv_head_of_q,
            1.0f / sqrtf(static_cast<float>(kv.head_dim)),
            batch.window};
}

// The KV head query head h reads.
__device__ inline int64_t KvHeadOfQuery(const PrefillArgs& a, int64_t h) {
    return a.kv_head_of_q != nullptr ? a.kv_head_of_q[h] : h / (a.num_heads / a.kv.num_kv_heads);
}

// The size of the widest GQA group (kv_head_of_q may give groups of unequal sizes), which plans
// the tiles. counts: num_kv_heads ints of scratch. Called by one thread.
__device__ inline int WidestGroup(const PrefillArgs& a, int* counts) {
    for (int64_t g = 0; g < a.kv.num_kv_heads; ++g) counts[g] = 0;
    int widest = 0;
    for (int64_t h = 0; h < a.num_heads; ++h) {
        const int c = ++counts[KvHeadOfQuery(a, h)];
        widest = c > widest ? c : widest;
    }
    return widest;
}

// The query heads reading `kv_head`, in order, into group[]; returns how many. Called by one
// thread.
__device__ inline int GroupHeads(const PrefillArgs& a, int64_t kv_head, int* group) {
    int g = 0;
    for (int64_t h = 0; h < a.num_heads; ++h) {
        if (KvHeadOfQuery(a, h) == kv_head) group[g++] = static_cast<int>(h);
    }
    return g;
}

}  // namespace kvshard::cuda
