// Reading the K/V rows of a paged pool (layout in kernels/paged_attention.h) as floats: the read
// side of every storage dtype for cpu::PagedAttentionBatched, a chunk of positions at a time.
#pragma once

#include <cstdint>

#include "kernels/paged_attention.h"

namespace kvshard::cpu {

// Points krows[i] / vrows[i] at the K / V row of position p0 + i of KV head `kv_head` of the
// sequence whose blocks are `block_table`, for i < n. fp32 rows are read in place; bf16 and fp16
// rows are decoded (kernels/kv_quant.h), 8-bit rows dequantized with their scales, into kbuf /
// vbuf (n × head_dim floats each). A negative table entry (a block a sliding window released,
// kv::kNoBlock: wholly before every query's window, so masked) is never dereferenced: its rows
// read as zeros.
void GatherPagedRows(const PagedKvLayer& kv, const int32_t* block_table, int64_t kv_head,
                     int64_t p0, int64_t n, float* kbuf, float* vbuf, const float** krows,
                     const float** vrows);

// Asks the caches for the K and V rows of positions [p0, p1) of KV head `kv_head` (block table as
// above; kv::kNoBlock entries skipped), without waiting for them: a decode tile reads its rows
// once, from DRAM, and a request for all of them up front keeps many misses in flight instead of
// the one or two that the kernel's walk would have outstanding. Reads nothing; changes nothing.
void PrefetchPagedRows(const PagedKvLayer& kv, const int32_t* block_table, int64_t kv_head,
                       int64_t p0, int64_t p1);

}  // namespace kvshard::cpu
