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
// The CPU path replaces all of it with a linear fit to measured steps (CpuProfile).
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
};

// Where a KV transfer goes: the other instance is on the same node (NVLink) or not (network).
enum class Link { kIntraNode, kNetwork };

// One measured step of kvshard's CPU engine.
struct CpuProfilePoint {
    int64_t prefill_tokens = 0;  // tokens of sequences that are prefilling
    int64_t decode_seqs = 0;     // sequences decoding one token
    int64_t kv_tokens = 0;       // sum over the step's sequences of their context after the step
    double seconds = 0;
    // The causal (query, key) pairs of the prefilling sequences' chunks: q x start_pos +
    // q (q + 1) / 2 each. A chunk after a long context (a prompt's second chunk, a suffix after
    // a cached prefix) attends to all of it, which kv_tokens counts once per sequence.
    int64_t prefill_pairs = 0;
    // Requests a client sent while the step ran (its cycle): the serving front end's CPU work
    // for them (HTTP, tokenization) shares the cores with the step. A step log does not know
    // them; scripts/validate-simulate counts them from the clients' traces (docs/simulate.md).
    int64_t arrivals = 0;
};

// t = a + b x prefill_tokens + c x decode_seqs + d x kv_tokens + e x prefill_pairs
//     + f x arrivals, every coefficient >= 0.
struct CpuProfile {
    double a = 0;  // seconds per step
    double b = 0;  // seconds per prefill token
    double c = 0;  // seconds per decoding sequence
    double d = 0;  // seconds per KV token read
    double e = 0;  // seconds per (query, key) pair of a prefill chunk
    // Seconds a request arriving during a step adds to it (the front end's CPU work). Not part
    // of Seconds(): the simulator adds it to the step in flight when a request arrives.
    double f = 0;
    int64_t num_points = 0;
    int64_t num_outliers = 0;  // points the robust fit gave weight 0 (see FitCpuProfile)
    double rms_error_s = 0;    // of the fit over all its points, outliers included

    double Seconds(int64_t prefill_tokens, int64_t decode_seqs, int64_t kv_tokens,
                   int64_t prefill_pairs = 0) const {
        return a + b * static_cast<double>(prefill_tokens) + c * static_cast<double>(decode_seqs) +
               d * static_cast<double>(kv_tokens) + e * static_cast<double>(prefill_pairs);
    }
};

// Non-negative least squares of the relative error over the points (each row divided by its
// measured seconds; exact: every subset of the five terms is solved and the best feasible one
// kept), made outlier-robust by iterative reweighting (Tukey's bisquare on the relative
// residuals, cutoff 4.685 x their median absolute value / 0.6745): steps the machine stalled
// get weight 0 and are counted in num_outliers (with 20 points or more; fewer keep the plain
// fit). InvalidArgument when there are no points, a point is negative
// or not finite, or no subset of terms can be fitted.
Result<CpuProfile> FitCpuProfile(const std::vector<CpuProfilePoint>& points);

// Reads measured points from JSON text: any number of JSON values (one document or JSON lines),
// each one of
//   {"prefill_tokens": 512, "decode_seqs": 0, "kv_tokens": 512, "seconds": 0.21}   one point
//     (optional "prefill_pairs" and "arrivals", 0 when absent; other fields, as a step log's,
//     are ignored)
//   {"points": [ ...points... ]}
//   the output of `kvshard bench-engine --json` ({"engine": "kvshard", "results": [...]}): each
//   row gives a prefill point (batch x prompt_tokens tokens, batch x p (p + 1) / 2 pairs,
//   seconds = tokens / prefill tok/s)
//   and a decode point (batch sequences at the mean context prompt + (decode_tokens + 1) / 2,
//   seconds = batch / decode tok/s)
//   a JSON array of any of these.
// InvalidArgument naming `path` and the field otherwise.
Result<std::vector<CpuProfilePoint>> ParseCpuProfilePoints(std::string_view json_text,
                                                           const std::string& path);
// Reads and fits a profile file. NotFound for a missing file.
Result<CpuProfile> LoadCpuProfile(const std::string& path);

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
    StepCost Cost(const StepPlan& plan, Link kv_link = Link::kIntraNode) const;
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
