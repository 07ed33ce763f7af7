// CostModel: how long one step of one instance (tp GPUs running one copy of a model) takes, from
// the step's actual plan: which sequences compute how many tokens at which context, which rows
// sample, which KV is sent. The simulator's executor advances its virtual clock by Cost(plan).
//
// Roofline terms per step (formulas and sources in docs/simulate.md):
//   gemm        max(2 x tokens x linear params per GPU / (FLOP/s x eff),
//                   linear weight bytes per GPU / (HBM B/s x eff))     embedding excluded
//   lm_head     the same for the vocab-parallel head over the sampled rows only
//   attention   per sequence max(2 x pairs x heads per GPU x (d_qk + d_v) x layers / (FLOP/s x
//   eff),
//                                KV bytes read / (HBM B/s x eff)); pairs = causal (query, key)
//               pairs of the chunk; a sliding layer reads min(window, context) keys
//   allreduce   2 per layer, ring: 2(tp-1) x hop latency + 2(tp-1)/tp x tokens x hidden x 2 B /
//               (link B/s x eff); plus the head's all-gather; 0 at tp 1
//   kv_transfer the plan's KV sends (KvTransferSeconds); layerwise sends overlap the forward pass
//   overhead    step_overhead_s
//   total       their sum (layerwise sends: max(forward, transfer) instead)
// The CPU path replaces all of it with a fit to measured steps (sim/cpu_profile.h CpuProfile).
//
// Thread-safety: a CostModel is immutable after Create; Cost() is const and allocates nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/step_plan.h"
#include "common/status.h"
#include "config/arch_config.h"
#include "kv/kv_geometry.h"
#include "kv/weight_footprint.h"
#include "sim/accelerator.h"
#include "sim/cpu_profile.h"

namespace kvshard::sim {

struct StepCost {
    double total_s = 0;
    double gemm_s = 0;
    double attention_s = 0;
    double lm_head_s = 0;
    double allreduce_s = 0;
    double kv_transfer_s = 0;
    double overhead_s = 0;
    int64_t num_tokens = 0;          // tokens computed (every sequence's token_ids)
    int64_t num_decode_tokens = 0;   // of sequences computing one token after a non-empty context
    int64_t num_prefill_tokens = 0;  // the rest (prompt chunks)
    StepKind kind = StepKind::kDecode;  // with a CPU profile: the kind whose scale priced it
};

// Where a KV transfer goes: the other instance is on the same node (NVLink) or not (network).
enum class Link { kIntraNode, kNetwork };

class CostModel {
  public:
    // REQUIRES nothing. InvalidArgument when tp does not divide the heads (ComputeWeightFootprint,
    // LocalKvHeads), the accelerator fails ValidateAccelerator, or it needs a profile;
    // Unimplemented for mixture-of-experts models.
    static Result<CostModel> Create(const ArchConfig& arch, kv::WeightDtype weights, KvDtype kv,
                                    int64_t tp, const Accelerator& accelerator);
    // Step times from `profile` instead of the roofline (kvshard's CPU engine, any accelerator;
    // the profile was measured at this tp). The KV sizes still come from the model.
    static Result<CostModel> CreateWithProfile(const ArchConfig& arch, kv::WeightDtype weights,
                                               KvDtype kv, int64_t tp,
                                               const Accelerator& accelerator,
                                               const CpuProfile& profile);

    // The cost of running `plan` on this instance; KV sends go over `kv_link`.
    // `previous_seq_ids` (sorted): the sequences of this instance's step before `plan`, which tell
    // a prefill chunk after a cached context (the profile's kind StepKind::kCached) from a
    // prompt's next chunk, as the step log does (coordinator/step_log.h ShapeOfStep).
    // `decodes_since_prefill`: the step's place among the decode-only steps since the instance's
    // last step with a prefill chunk (NextDecodesSincePrefill; 0 for a step with a prefill
    // chunk), which the profile's warm-up term (CpuProfile::w) reads.
    StepCost Cost(const StepPlan& plan, Link kv_link = Link::kIntraNode,
                  const std::vector<int64_t>& previous_seq_ids = {},
                  int64_t decodes_since_prefill = 0) const;
    // Seconds to move the KV of `num_tokens` tokens from this instance to another over `link`:
    // each of the tp ranks sends its share over its own link in parallel, so
    // hop latency + num_tokens x KvBytesPerToken() / (tp x link B/s x allreduce_efficiency).
    double KvTransferSeconds(int64_t num_tokens, Link link) const;

    // KV bytes of one token, whole model (each KV head once): what a transfer carries.
    int64_t KvBytesPerToken() const { return kv_bytes_per_token_; }
    // KV bytes of one token on one GPU of this instance.
    int64_t KvBytesPerTokenPerGpu() const { return kv_bytes_per_token_per_gpu_; }
    // KV blocks of one instance (the same count on every rank), by kv::PlanCapacity with this
    // accelerator's memory, `memory_utilization` and the planner's default overhead reserve;
    // 0 when the weights do not fit.
    // REQUIRES: block_size >= 1, memory_utilization in (0, 1].
    int64_t NumKvBlocks(int64_t block_size, double memory_utilization) const;

    int64_t tp() const { return tp_; }
    const Accelerator& accelerator() const { return accelerator_; }
    int64_t weight_bytes_per_gpu() const { return weight_bytes_per_gpu_; }
    // Weights read by a step's linear layers on each GPU (no embedding, no head).
    int64_t linear_weight_bytes_per_gpu() const { return linear_bytes_per_gpu_; }
    bool uses_profile() const { return profile_.has_value(); }

  private:
    CostModel() = default;
    static Result<CostModel> Build(const ArchConfig& arch, kv::WeightDtype weights, KvDtype kv,
                                   int64_t tp, const Accelerator& accelerator);
    double AttentionSeconds(int64_t start_pos, int64_t q_len) const;
    double RingSeconds(double bytes, int64_t hops_factor) const;

    ArchConfig arch_;
    kv::WeightDtype weight_dtype_ = kv::WeightDtype::kBf16;
    KvDtype kv_dtype_ = KvDtype::kBf16;
    int64_t tp_ = 1;
    Accelerator accelerator_;
    std::optional<CpuProfile> profile_;

    // Derived once in Build.
    int64_t weight_bytes_per_gpu_ = 0;
    int64_t linear_bytes_per_gpu_ = 0;
    int64_t linear_params_per_gpu_ = 0;
    int64_t head_rows_per_gpu_ = 0;  // ceil(vocab / tp)
    int64_t head_bytes_per_gpu_ = 0;
    int64_t kv_bytes_per_token_ = 0;
    int64_t kv_bytes_per_token_per_gpu_ = 0;
    double kv_bytes_per_token_per_layer_per_gpu_ = 0;
    int64_t num_layers_ = 0;
    int64_t num_sliding_layers_ = 0;
    int64_t sliding_window_ = 0;
    double attention_flops_per_pair_per_layer_ = 0;  // 2 x heads per GPU x (d_qk + d_v)
    double flops_per_s_ = 0;                         // peak x flops_efficiency
    double bytes_per_s_ = 0;                         // peak x bandwidth_efficiency
    double collective_bytes_per_s_ = 0;              // link x allreduce_efficiency
    double collective_hop_s_ = 0;
    int64_t hidden_ = 0;
};

}  // namespace kvshard::sim
