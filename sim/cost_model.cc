#include "sim/cost_model.h"

#include <algorithm>
#include <cmath>

#include "kv/capacity_planner.h"

namespace kvshard::sim {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of the parameters ComputeWeightFootprint keeps 16-bit (embedding, head, norms).
int64_t OtherBytesPerParam(kv::WeightDtype dtype) {
    return dtype == kv::WeightDtype::kFp32 ? 4 : 2;
}

// Causal (query, key) pairs of a chunk of q queries at positions start .. start + q - 1 when each
// query sees at most `window` keys (itself included): sum over k = start+1 .. start+q of
// min(window, k).
double CausalPairs(int64_t start, int64_t q, int64_t window) {
    const double a = static_cast<double>(start + 1);
    const double b = static_cast<double>(start + q);
    const double w = static_cast<double>(window);
    auto sum = [](double lo, double hi) { return (lo + hi) * (hi - lo + 1) / 2; };
    if (b <= w) return sum(a, b);
    if (a > w) return w * (b - a + 1);
    return sum(a, w) + w * (b - w);
}

kv::PlannerInput PlannerFor(const ArchConfig& arch, kv::WeightDtype weights, KvDtype kv, int64_t tp,
                            const Accelerator& acc) {
    kv::PlannerInput in;
    in.tp = tp;
    in.num_gpus = tp;
    in.kv_dtype = kv;
    in.weight_dtype = weights;
    in.gpu_memory_bytes = acc.memory_bytes;
    // The context only shapes the per-sequence figures, which the simulator does not use.
    in.context_tokens = arch.max_position > 0 ? 0 : 4096;
    return in;
}

}  // namespace

Result<CostModel> CostModel::Build(const ArchConfig& arch, kv::WeightDtype weights,
                                   KvDtype kv_dtype, int64_t tp, const Accelerator& acc) {
    KV_RETURN_IF_ERROR(ValidateAccelerator(acc, "accelerator " + acc.name));
    if (arch.num_layers <= 0 || arch.hidden_size <= 0 || arch.num_heads <= 0) {
        return InvalidArgument(arch.path + ": layers, hidden size and heads must be positive");
    }
    if (arch.NumMoeLayers() > 0) {
        // Counting every routed expert would overstate an A3B model's step tenfold.
        return Unimplemented(arch.path +
                             ": mixture-of-experts models are not modelled yet (the cost needs "
                             "the experts each token activates, which ArchConfig does not read)");
    }
    KV_ASSIGN_OR_RETURN(const kv::WeightFootprint w, kv::ComputeWeightFootprint(arch, tp, weights));
    KV_ASSIGN_OR_RETURN(const kv::CapacityPlan plan,
                        kv::PlanCapacity(arch, PlannerFor(arch, weights, kv_dtype, tp, acc)));
    CostModel m;
    m.arch_ = arch;
    m.weight_dtype_ = weights;
    m.kv_dtype_ = kv_dtype;
    m.tp_ = tp;
    m.accelerator_ = acc;
    m.hidden_ = arch.hidden_size;
    m.num_layers_ = arch.num_layers;
    m.num_sliding_layers_ = arch.sliding_window > 0 ? arch.NumSlidingLayers() : 0;
    m.sliding_window_ = arch.sliding_window;

    // Weights: the embedding is a gather (no FLOPs, a few rows read); the head is read only
    // when a row samples, so both are kept out of the per-step linear layers.
    const int64_t other = OtherBytesPerParam(weights);
    m.head_rows_per_gpu_ = CeilDiv(arch.vocab_size, tp);
    const int64_t vocab_params_per_gpu =
        m.head_rows_per_gpu_ * arch.hidden_size *
        ((w.params.embedding > 0 ? 1 : 0) + (w.params.lm_head > 0 ? 1 : 0));
    m.weight_bytes_per_gpu_ = w.bytes_per_gpu;
    m.linear_params_per_gpu_ = w.params_per_gpu - vocab_params_per_gpu;
    m.linear_bytes_per_gpu_ = w.bytes_per_gpu - other * vocab_params_per_gpu;
    m.head_bytes_per_gpu_ = m.head_rows_per_gpu_ * arch.hidden_size * other;  // tied or not

    m.kv_bytes_per_token_ = plan.kv_bytes_per_token;
    m.kv_bytes_per_token_per_gpu_ = plan.kv_bytes_per_token_per_gpu;
    m.kv_bytes_per_token_per_layer_per_gpu_ =
        static_cast<double>(plan.kv_bytes_per_token_per_gpu) / static_cast<double>(arch.num_layers);

    // Attention FLOPs per (query, key) pair per layer: QK^T and PV, 2 FLOPs per multiply-add.
    const double heads_per_gpu = static_cast<double>(arch.num_heads / tp);
    double d_qk = static_cast<double>(arch.head_dim);
    double d_v = static_cast<double>(arch.head_dim);
    if (arch.attention == AttentionKind::kMultiLatent) {
        // Absorbed MLA (as decode kernels run it): scores over the latent plus the RoPE key,
        // values are the latent.
        d_qk = static_cast<double>(arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim);
        d_v = static_cast<double>(arch.mla.kv_lora_rank);
    }
    m.attention_flops_per_pair_per_layer_ = 2 * heads_per_gpu * (d_qk + d_v);

    // FP8 weights run FP8 GEMMs where the GPU has them; int4 and FP8 without FP8 tensor cores
    // dequantize to BF16; fp32 is counted at the BF16 rate (kvshard's GPU path computes in BF16).
    const bool fp8 = weights == kv::WeightDtype::kFp8 && acc.fp8_flops > 0;
    m.flops_per_s_ = (fp8 ? acc.fp8_flops : acc.bf16_flops) * acc.flops_efficiency;
    m.bytes_per_s_ = acc.memory_bandwidth * acc.bandwidth_efficiency;
    const bool one_node = tp <= acc.gpus_per_node;
    m.collective_bytes_per_s_ =
        (one_node ? acc.intra_node_bandwidth : acc.network_bandwidth) * acc.allreduce_efficiency;
    m.collective_hop_s_ = one_node ? acc.intra_node_latency_s : acc.network_latency_s;
    return m;
}

Result<CostModel> CostModel::Create(const ArchConfig& arch, kv::WeightDtype weights, KvDtype kv,
                                    int64_t tp, const Accelerator& accelerator) {
    if (accelerator.needs_profile) {
        return InvalidArgument("accelerator " + accelerator.name +
                               " has no roofline numbers: give a measured CPU profile");
    }
    return Build(arch, weights, kv, tp, accelerator);
}

Result<CostModel> CostModel::CreateWithProfile(const ArchConfig& arch, kv::WeightDtype weights,
                                               KvDtype kv, int64_t tp,
                                               const Accelerator& accelerator,
                                               const CpuProfile& profile) {
    KV_ASSIGN_OR_RETURN(CostModel m, Build(arch, weights, kv, tp, accelerator));
    m.profile_ = profile;
    return m;
}

double CostModel::RingSeconds(double bytes, int64_t passes) const {
    // A ring all-reduce is a reduce-scatter then an all-gather (passes = 2); an all-gather alone
    // is one pass. Each pass is tp - 1 hops moving (tp - 1) / tp of the bytes per GPU.
    if (tp_ <= 1 || collective_bytes_per_s_ <= 0) return 0;
    const double hops = static_cast<double>(passes * (tp_ - 1));
    return hops * collective_hop_s_ +
           hops / static_cast<double>(tp_) * bytes / collective_bytes_per_s_;
}

double CostModel::AttentionSeconds(int64_t start_pos, int64_t q_len) const {
    const int64_t context = start_pos + q_len;
    const double global_layers = static_cast<double>(num_layers_ - num_sliding_layers_);
    const double sliding_layers = static_cast<double>(num_sliding_layers_);
    double pairs = global_layers * CausalPairs(start_pos, q_len, context);
    double keys_read = global_layers * static_cast<double>(context);
    if (num_sliding_layers_ > 0) {
        pairs += sliding_layers * CausalPairs(start_pos, q_len, sliding_window_);
        // The chunk's queries together see the last window - 1 keys before it and the chunk.
        keys_read +=
            sliding_layers * static_cast<double>(std::min(context, sliding_window_ + q_len - 1));
    }
    const double flops = pairs * attention_flops_per_pair_per_layer_;
    const double bytes = keys_read * kv_bytes_per_token_per_layer_per_gpu_;
    return std::max(flops / flops_per_s_, bytes / bytes_per_s_);
}

double CostModel::KvTransferSeconds(int64_t num_tokens, Link link) const {
    const Accelerator& a = accelerator_;
    const double bandwidth =
        (link == Link::kIntraNode ? a.intra_node_bandwidth : a.network_bandwidth) *
        a.allreduce_efficiency * static_cast<double>(tp_);
    if (num_tokens <= 0 || bandwidth <= 0) return 0;  // the cpu kind: links not modelled
    const double latency = link == Link::kIntraNode ? a.intra_node_latency_s : a.network_latency_s;
    return latency +
           static_cast<double>(num_tokens) * static_cast<double>(kv_bytes_per_token_) / bandwidth;
}

StepCost CostModel::Cost(const StepPlan& plan, Link kv_link,
                         const std::vector<int64_t>& previous_seq_ids,
                         int64_t decodes_since_prefill) const {
    StepCost c;
    int64_t sampled = 0;
    int64_t decode_seqs = 0;
    int64_t kv_tokens = 0;
    int64_t prefill_pairs = 0;
    int64_t cached_chunks = 0;  // prefill chunks after a cached context (CpuProfilePoint)
    double attention = 0;
    for (const ScheduledSequence& s : plan.sequences) {
        const auto q = static_cast<int64_t>(s.token_ids.size());
        if (q == 0) continue;
        c.num_tokens += q;
        if (q == 1 && s.start_pos > 0) {
            c.num_decode_tokens += 1;
            ++decode_seqs;
        } else {
            c.num_prefill_tokens += q;
            prefill_pairs += q * s.start_pos + q * (q + 1) / 2;
            cached_chunks +=
                s.start_pos > 0 && !std::binary_search(previous_seq_ids.begin(),
                                                       previous_seq_ids.end(), s.seq_id)
                    ? 1
                    : 0;
        }
        sampled += s.sample ? 1 : 0;
        kv_tokens += s.start_pos + q;
        if (!profile_) attention += AttentionSeconds(s.start_pos, q);
    }
    double layerwise_s = 0;
    double after_s = 0;
    for (const KvSendOp& send : plan.kv_sends) {
        const double t = KvTransferSeconds(send.num_tokens, kv_link);
        (send.layerwise ? layerwise_s : after_s) += t;
    }
    c.kv_transfer_s = layerwise_s + after_s;

    if (profile_) {
        const CpuProfile& p = *profile_;
        // The kind's median correction (CpuProfile::kind_scale) scales every linear term; the
        // kind as the step log's point of the same plan has it (coordinator/step_log.cc).
        const StepKind kind = KindOf({.prefill_tokens = c.num_prefill_tokens,
                                      .decode_seqs = decode_seqs,
                                      .cached_chunks = cached_chunks});
        const double scale = p.kind_scale[static_cast<int>(kind)];
        c.kind = kind;
        // A step of two or more rows (h), a decode step's warm-up after a prefill (w) and a step
        // with a prefill chunk (k), as the step log counts them (CpuProfilePoint::multi_row,
        // decodes_since_prefill, prefill_step).
        const int64_t multi_row = c.num_prefill_tokens + decode_seqs >= 2 ? 1 : 0;
        const double prefill_step = c.num_prefill_tokens > 0 ? p.k : 0.0;
        const double warm_up =
            c.num_prefill_tokens == 0 ? p.w * p.WarmUp(decodes_since_prefill) : 0.0;
        c.overhead_s = scale * (p.a + p.g * static_cast<double>(cached_chunks) +
                                p.h * static_cast<double>(multi_row) + warm_up + prefill_step);
        c.gemm_s = scale * (p.b * static_cast<double>(c.num_prefill_tokens) +
                            p.c * static_cast<double>(decode_seqs));
        c.attention_s = scale * (p.d * static_cast<double>(kv_tokens) +
                                 p.e * static_cast<double>(prefill_pairs));
        const double forward = c.num_tokens > 0 ? c.gemm_s + c.attention_s : 0;
        c.total_s = c.overhead_s + std::max(forward, layerwise_s) + after_s;
        return c;
    }

    const auto tokens = static_cast<double>(c.num_tokens);
    if (c.num_tokens > 0) {
        c.gemm_s = std::max(2 * tokens * static_cast<double>(linear_params_per_gpu_) / flops_per_s_,
                            static_cast<double>(linear_bytes_per_gpu_) / bytes_per_s_);
        // Two all-reduces per layer of the step's hidden states (bf16).
        c.allreduce_s = static_cast<double>(2 * num_layers_) *
                        RingSeconds(tokens * static_cast<double>(hidden_) * 2, 2);
    }
    if (sampled > 0) {
        const double rows = static_cast<double>(sampled);
        c.lm_head_s =
            std::max(2 * rows * static_cast<double>(head_rows_per_gpu_ * hidden_) / flops_per_s_,
                     static_cast<double>(head_bytes_per_gpu_) / bytes_per_s_);
        // The vocab-parallel head's logits gathered (fp32) for sampling.
        c.allreduce_s += RingSeconds(rows * static_cast<double>(head_rows_per_gpu_ * tp_) * 4, 1);
    }
    c.attention_s = attention;
    c.overhead_s = accelerator_.step_overhead_s;
    const double forward = c.gemm_s + c.attention_s + c.lm_head_s + c.allreduce_s;
    c.total_s = c.overhead_s + std::max(forward, layerwise_s) + after_s;
    return c;
}

int64_t CostModel::NumKvBlocks(int64_t block_size, double memory_utilization) const {
    kv::PlannerInput in = PlannerFor(arch_, weight_dtype_, kv_dtype_, tp_, accelerator_);
    in.block_size = block_size;
    in.memory_utilization = memory_utilization;
    Result<kv::CapacityPlan> plan = kv::PlanCapacity(arch_, in);
    KV_CHECK(plan.ok()) << plan.status().ToString();
    return plan->kv_blocks_per_gpu;
}

}  // namespace kvshard::sim
