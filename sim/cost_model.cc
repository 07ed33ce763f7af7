#include "sim/cost_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

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

StepCost CostModel::Cost(const StepPlan& plan, Link kv_link) const {
    StepCost c;
    int64_t sampled = 0;
    int64_t decode_seqs = 0;
    int64_t kv_tokens = 0;
    int64_t prefill_pairs = 0;
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
        c.overhead_s = p.a;
        c.gemm_s = p.b * static_cast<double>(c.num_prefill_tokens) +
                   p.c * static_cast<double>(decode_seqs);
        c.attention_s =
            p.d * static_cast<double>(kv_tokens) + p.e * static_cast<double>(prefill_pairs);
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

// ---- CPU profile ----

Result<CpuProfile> FitCpuProfile(const std::vector<CpuProfilePoint>& points) {
    if (points.empty()) return InvalidArgument("CPU profile: no points to fit");
    constexpr int kTerms = 6;
    const size_t n = points.size();
    std::vector<std::array<double, kTerms>> x(n);
    std::vector<double> y(n);
    for (size_t i = 0; i < n; ++i) {
        const CpuProfilePoint& p = points[i];
        if (p.prefill_tokens < 0 || p.decode_seqs < 0 || p.kv_tokens < 0 || p.prefill_pairs < 0 ||
            p.arrivals < 0 ||
            !(p.seconds >= 0 && std::isfinite(p.seconds))) {
            return InvalidArgument("CPU profile: point " + std::to_string(i) +
                                   " has a negative or non-finite value");
        }
        x[i] = {1.0, static_cast<double>(p.prefill_tokens), static_cast<double>(p.decode_seqs),
                static_cast<double>(p.kv_tokens), static_cast<double>(p.prefill_pairs),
                static_cast<double>(p.arrivals)};
        y[i] = p.seconds;
    }
    // Relative least squares: each point's row is divided by its measured time, so a 20 ms decode
    // step counts as much as a 2 s prefill (plain least squares fits the prefill points and leaves
    // decode steps, which set the inter-token latency, to the constant term).
    const std::vector<double> y_seconds = y;
    for (size_t i = 0; i < n; ++i) {
        if (!(y[i] > 0)) continue;
        for (double& v : x[i]) v /= y[i];
        y[i] = 1.0;
    }
    // Columns scaled to a unit maximum so that the elimination's pivot test is scale-free.
    std::array<double, kTerms> scale{};
    for (int j = 0; j < kTerms; ++j) {
        for (size_t i = 0; i < n; ++i) scale[j] = std::max(scale[j], std::fabs(x[i][j]));
    }
    // Weighted NNLS by enumeration: the optimum is the least-squares fit on its set of positive
    // terms, and every feasible subset fit is a feasible point, so the best feasible subset is the
    // optimum. Fails (infinite sse) when no subset can be fitted.
    std::vector<double> w(n, 1.0);
    auto solve = [&](std::array<double, kTerms>& best) {
        double best_sse = std::numeric_limits<double>::infinity();
        for (int mask = 1; mask < (1 << kTerms); ++mask) {
            int cols[kTerms];
            int k = 0;
            bool usable = true;
            for (int j = 0; j < kTerms; ++j) {
                if (!(mask & (1 << j))) continue;
                if (scale[j] == 0) usable = false;
                cols[k++] = j;
            }
            if (!usable) continue;
            // Normal equations (k x k) of the scaled columns.
            double m[kTerms][kTerms + 1] = {};
            double weight_sum = 0;
            for (size_t i = 0; i < n; ++i) {
                weight_sum += w[i];
                for (int r = 0; r < k; ++r) {
                    const double xr = w[i] * x[i][cols[r]] / scale[cols[r]];
                    for (int t = 0; t < k; ++t) m[r][t] += xr * x[i][cols[t]] / scale[cols[t]];
                    m[r][k] += xr * y[i];
                }
            }
            bool singular = false;
            for (int col = 0; col < k && !singular; ++col) {
                int pivot = col;
                for (int r = col + 1; r < k; ++r) {
                    if (std::fabs(m[r][col]) > std::fabs(m[pivot][col])) pivot = r;
                }
                if (std::fabs(m[pivot][col]) < 1e-9 * weight_sum) {
                    singular = true;
                    break;
                }
                for (int t = 0; t <= k; ++t) std::swap(m[col][t], m[pivot][t]);
                for (int r = 0; r < k; ++r) {
                    if (r == col) continue;
                    const double f = m[r][col] / m[col][col];
                    for (int t = col; t <= k; ++t) m[r][t] -= f * m[col][t];
                }
            }
            if (singular) continue;
            std::array<double, kTerms> coef{};
            bool feasible = true;
            for (int r = 0; r < k; ++r) {
                coef[cols[r]] = m[r][k] / m[r][r] / scale[cols[r]];
                if (coef[cols[r]] < 0) feasible = false;
            }
            if (!feasible) continue;
            double sse = 0;
            for (size_t i = 0; i < n; ++i) {
                double pred = 0;
                for (int j = 0; j < kTerms; ++j) pred += coef[j] * x[i][j];
                sse += w[i] * (pred - y[i]) * (pred - y[i]);
            }
            if (sse < best_sse) {
                best_sse = sse;
                best = coef;
            }
        }
        return best_sse;
    };
    std::array<double, kTerms> best{};
    if (!std::isfinite(solve(best))) {
        return InvalidArgument("CPU profile: the " + std::to_string(n) +
                               " points admit no non-negative fit");
    }
    // Outlier-robust: iteratively reweighted least squares with Tukey's bisquare on the relative
    // residuals, from the plain fit. A step caught in a stall of the machine (2-100x its usual
    // time) gets weight 0 instead of pulling every coefficient up. The scale is the residuals'
    // median absolute value / 0.6745 (a normal's sigma), the cutoff 4.685 of it (95% efficiency
    // for normal errors); a fit that leaves most residuals at 0 (exact points) stops at once.
    // Below kMinRobustPoints the plain fit stands: a median of a handful of residuals is no scale.
    constexpr size_t kMinRobustPoints = 20;
    int64_t outliers = 0;
    for (int iteration = 0; iteration < 30 && n >= kMinRobustPoints; ++iteration) {
        std::vector<double> abs_residual(n);
        for (size_t i = 0; i < n; ++i) {
            double pred = 0;
            for (int j = 0; j < kTerms; ++j) pred += best[j] * x[i][j];
            abs_residual[i] = std::fabs(pred - y[i]);
        }
        std::vector<double> sorted = abs_residual;
        std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(n / 2),
                         sorted.end());
        const double sigma = sorted[n / 2] / 0.6745;
        if (!(sigma > 1e-9)) break;
        outliers = 0;
        for (size_t i = 0; i < n; ++i) {
            const double u = abs_residual[i] / (4.685 * sigma);
            w[i] = u < 1 ? (1 - u * u) * (1 - u * u) : 0.0;
            if (w[i] == 0) outliers++;
        }
        std::array<double, kTerms> next{};
        if (!std::isfinite(solve(next))) break;  // too few inliers left: keep the last fit
        double change = 0, size = 0;
        for (int j = 0; j < kTerms; ++j) {
            change = std::max(change, std::fabs(next[j] - best[j]) * scale[j]);
            size = std::max(size, std::fabs(next[j]) * scale[j]);
        }
        best = next;
        if (change <= 1e-7 * size) break;
    }
    CpuProfile p;
    p.a = best[0];
    p.b = best[1];
    p.c = best[2];
    p.d = best[3];
    p.e = best[4];
    p.f = best[5];
    p.num_points = static_cast<int64_t>(n);
    p.num_outliers = outliers;
    double sse_seconds = 0;
    for (size_t i = 0; i < n; ++i) {
        const CpuProfilePoint& q = points[i];
        const double e =
            p.Seconds(q.prefill_tokens, q.decode_seqs, q.kv_tokens, q.prefill_pairs) +
            p.f * static_cast<double>(q.arrivals) - y_seconds[i];
        sse_seconds += e * e;
    }
    p.rms_error_s = std::sqrt(sse_seconds / static_cast<double>(n));
    return p;
}

namespace {

using nlohmann::json;

Result<double> JsonNumber(const json& j, const char* key, const std::string& where) {
    if (!j.contains(key)) return InvalidArgument(where + ": field '" + key + "': missing");
    const json& v = j.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>())) {
        return InvalidArgument(where + ": field '" + key + "': expected a number");
    }
    return v.get<double>();
}

Result<int64_t> JsonCount(const json& j, const char* key, const std::string& where) {
    KV_ASSIGN_OR_RETURN(const double v, JsonNumber(j, key, where));
    if (v < 0 || v != std::floor(v) || v > 9e18) {
        return InvalidArgument(where + ": field '" + key + "': expected a count >= 0");
    }
    return static_cast<int64_t>(v);
}

Status AddBenchEngineRow(const json& row, const std::string& where,
                         std::vector<CpuProfilePoint>& out) {
    KV_ASSIGN_OR_RETURN(const int64_t batch, JsonCount(row, "batch", where));
    KV_ASSIGN_OR_RETURN(const int64_t prompt, JsonCount(row, "prompt_tokens", where));
    KV_ASSIGN_OR_RETURN(const int64_t decode, JsonCount(row, "decode_tokens", where));
    KV_ASSIGN_OR_RETURN(const double prefill_tps,
                        JsonNumber(row, "prefill_tokens_per_second", where));
    KV_ASSIGN_OR_RETURN(const double decode_tps,
                        JsonNumber(row, "decode_tokens_per_second", where));
    if (batch < 1 || prompt < 1 || prefill_tps <= 0 || decode_tps <= 0) {
        return InvalidArgument(where + ": batch, prompt_tokens and tok/s must be positive");
    }
    // One prefill step of batch x prompt tokens.
    out.push_back({.prefill_tokens = batch * prompt,
                   .decode_seqs = 0,
                   .kv_tokens = batch * prompt,
                   .seconds = static_cast<double>(batch * prompt) / prefill_tps,
                   .prefill_pairs = batch * (prompt * (prompt + 1) / 2)});
    // Decode steps: batch sequences at contexts prompt + 1 .. prompt + decode_tokens.
    if (decode >= 1) {
        out.push_back({.prefill_tokens = 0,
                       .decode_seqs = batch,
                       .kv_tokens = batch * (prompt + (decode + 1) / 2),
                       .seconds = static_cast<double>(batch) / decode_tps});
    }
    return Status::Ok();
}

Status AddValue(const json& v, const std::string& where, std::vector<CpuProfilePoint>& out) {
    if (v.is_array()) {
        for (size_t i = 0; i < v.size(); ++i) {
            KV_RETURN_IF_ERROR(AddValue(v[i], where + "[" + std::to_string(i) + "]", out));
        }
        return Status::Ok();
    }
    if (!v.is_object()) return InvalidArgument(where + ": expected an object");
    if (v.contains("results")) {
        const json& rows = v.at("results");
        if (!rows.is_array()) return InvalidArgument(where + ": field 'results': expected a list");
        for (size_t i = 0; i < rows.size(); ++i) {
            KV_RETURN_IF_ERROR(
                AddBenchEngineRow(rows[i], where + ".results[" + std::to_string(i) + "]", out));
        }
        return Status::Ok();
    }
    if (v.contains("points")) {
        const json& pts = v.at("points");
        if (!pts.is_array()) return InvalidArgument(where + ": field 'points': expected a list");
        return AddValue(pts, where + ".points", out);
    }
    CpuProfilePoint p;
    KV_ASSIGN_OR_RETURN(p.prefill_tokens, JsonCount(v, "prefill_tokens", where));
    KV_ASSIGN_OR_RETURN(p.decode_seqs, JsonCount(v, "decode_seqs", where));
    KV_ASSIGN_OR_RETURN(p.kv_tokens, JsonCount(v, "kv_tokens", where));
    if (v.contains("prefill_pairs")) {
        KV_ASSIGN_OR_RETURN(p.prefill_pairs, JsonCount(v, "prefill_pairs", where));
    }
    if (v.contains("arrivals")) {
        KV_ASSIGN_OR_RETURN(p.arrivals, JsonCount(v, "arrivals", where));
    }
    KV_ASSIGN_OR_RETURN(p.seconds, JsonNumber(v, "seconds", where));
    if (p.seconds < 0) return InvalidArgument(where + ": field 'seconds': must be >= 0");
    out.push_back(p);
    return Status::Ok();
}

}  // namespace

Result<std::vector<CpuProfilePoint>> ParseCpuProfilePoints(std::string_view json_text,
                                                           const std::string& path) {
    std::vector<CpuProfilePoint> points;
    // JSON lines, or one multi-line document: values are parsed one after another, each from its
    // line first (linear in the file: a step log has thousands of lines), else from the rest of
    // the file.
    const std::string_view text = json_text;
    size_t pos = 0;
    int64_t line = 1;  // of pos, for messages
    size_t counted_to = 0;
    while (true) {
        pos = text.find_first_not_of(" \t\r\n", pos);
        if (pos == std::string_view::npos) break;
        line += std::count(text.begin() + static_cast<long>(counted_to),
                           text.begin() + static_cast<long>(pos), '\n');
        counted_to = pos;
        const std::string where = path + ":" + std::to_string(line);
        const size_t end = std::min(text.find('\n', pos), text.size());
        json v = json::parse(text.begin() + static_cast<long>(pos),
                             text.begin() + static_cast<long>(end), nullptr, false);
        if (!v.is_discarded()) {
            pos = end;
        } else {
            v = json::parse(text.begin() + static_cast<long>(pos), text.end(), nullptr, false);
            if (v.is_discarded()) return InvalidArgument(where + ": not valid JSON");
            pos = text.size();
        }
        KV_RETURN_IF_ERROR(AddValue(v, where, points));
    }
    if (points.empty()) return InvalidArgument(path + ": no profile points");
    return points;
}

Result<CpuProfile> LoadCpuProfile(const std::string& path) {
    std::ifstream in(path);
    if (!in) return NotFound(path + ": cannot open the CPU profile");
    std::stringstream text;
    text << in.rdbuf();
    KV_ASSIGN_OR_RETURN(const std::vector<CpuProfilePoint> points,
                        ParseCpuProfilePoints(text.str(), path));
    Result<CpuProfile> p = FitCpuProfile(points);
    if (!p.ok()) return p.status().WithContext(path);
    return p;
}

}  // namespace kvshard::sim
