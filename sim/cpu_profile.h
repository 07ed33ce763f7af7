// CpuProfile: the step cost of kvshard's CPU engine as a linear fit to measured steps (a serving
// step log or `kvshard bench-engine` output), which CostModel::CreateWithProfile charges instead
// of the roofline. docs/simulate.md "The CPU profile" gives the terms and the estimator.
//
// Thread-safety: plain values and free functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard::sim {

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
    // Prefill chunks that start after a context (start_pos > 0) which their sequence did not
    // compute in the previous step: a suffix after a prefix-cache hit (not a prompt's next chunk,
    // which follows its previous one). They make the step of kind kCached.
    int64_t cached_chunks = 0;
    // 1 when the step runs two or more rows (prefill tokens + decoding sequences) through the
    // matmuls, 0 for a lone decode row (or unknown: absent from a profile file). The CPU engine
    // multiplies a lone row by its batch-1 kernels on interleaved weight copies and any other
    // step by the multi-row kernels on the stored layout (kernels/cpu_matmul.cc), which cost a
    // fixed extra per step (docs/simulate.md run S: 1 sequence 3.0 ms, 2 sequences 5.8, 3-4 7.0).
    int64_t multi_row = 0;
    // For a decode-only step, its place among the decode-only steps since its instance's last
    // step with a prefill chunk (1 for the first); 0 for a step with a prefill chunk, or
    // unknown. A decode step is slower the sooner it follows a prefill (which every busy period
    // starts with): run S's lone decodes ran 1.6x the warm ones right after it, 1.3x 4-7 steps
    // later, 1.05x 16-31 steps later.
    int64_t decodes_since_prefill = 0;
    // 1 when the step runs a prefill chunk, 0 when it does not (or unknown: absent from a profile
    // file). A step with a prefill chunk costs a constant over its tokens' terms that a decode
    // step does not (run S's calibration: small prefills ran 1.17x and prompts of 300 tokens or
    // more 0.92x a fit without it; docs/simulate.md run T).
    int64_t prefill_step = 0;
};

// The kinds of step a profile is corrected per: decode only (no prefill token), prefill only (no
// decoding sequence), mixed (prefill chunks and decodes), and cached (a prefill chunk after a
// cached context, cached_chunks > 0, with or without decodes: a suffix after a prefix-cache hit,
// 1.15-1.25x the linear terms in docs/simulate.md runs N-P where a prompt's next chunk fits them).
enum class StepKind { kDecode, kPrefill, kMixed, kCached };
inline constexpr int kNumStepKinds = 4;
StepKind KindOf(const CpuProfilePoint& point);
std::string_view StepKindName(StepKind kind);  // "decode", "prefill", "mixed", "cached"

// t = a + b x prefill_tokens + c x decode_seqs + d x kv_tokens + e x prefill_pairs
//     + g x cached_chunks + h x multi_row + w x WarmUp(decodes_since_prefill)
//     + k x prefill_step + f x arrivals,
// every coefficient >= 0, where WarmUp(n) = exp(-(n - 1) / warm_tau) for n >= 1, else 0.
struct CpuProfile {
    double a = 0;  // seconds per step
    double b = 0;  // seconds per prefill token
    double c = 0;  // seconds per decoding sequence
    double d = 0;  // seconds per KV token read
    double e = 0;  // seconds per (query, key) pair of a prefill chunk
    // Seconds a request arriving during a step adds to it (the front end's CPU work). Not part
    // of Seconds(): the simulator adds it to the step in flight when a request arrives.
    double f = 0;
    // Seconds per prefill chunk after a cached context (CpuProfilePoint::cached_chunks): runs
    // N-P measured such a suffix at a constant 6-8 ms over the other terms whatever its length.
    double g = 0;
    // Seconds per step of two or more rows (CpuProfilePoint::multi_row).
    double h = 0;
    // Seconds the first decode-only step after a prefill takes over a warm one, decaying by
    // exp(-1 / warm_tau) per decode step after it (CpuProfilePoint::decodes_since_prefill).
    // warm_tau (decode steps) is chosen by the fit from kWarmTaus; 0 when no point has the field.
    double w = 0;
    double warm_tau = 0;
    // Seconds per step with a prefill chunk (CpuProfilePoint::prefill_step).
    double k = 0;
    int64_t num_points = 0;
    int64_t num_outliers = 0;  // points the robust fit gave weight 0 (see FitCpuProfile)
    double rms_error_s = 0;    // of the fit over all its points, outliers included
    // Per StepKind: how many of the points are of that kind, and the factor its steps' linear
    // prediction is multiplied by: the median over its points of measured / linear prediction,
    // each point counted once per token it produced (1 when a kind has no points). How far the
    // linear fit alone is from each kind's median step.
    int64_t kind_points[kNumStepKinds] = {};
    double kind_scale[kNumStepKinds] = {1, 1, 1, 1};
    // Per StepKind: measured / predicted (Predict, kind_scale applied) of each of its points the
    // robust fit kept, sorted: how the measured steps spread around the prediction. A simulation
    // with SimulationOptions::profile_spread multiplies each decode-only step's time by one of
    // the decode kind's, drawn at random, so that they spread as the machine's did (a
    // deterministic profile puts every lone decode step of a context at one value, where the
    // machine's spread +-10%: an ITL median between two modes falls on that spread;
    // docs/simulate.md, run W). Empty when the kind has no kept point. Scale-free: Scaled keeps
    // them.
    std::vector<double> kind_spread[kNumStepKinds] = {};

    // The warm-up term's variable for a step (see CpuProfile::w).
    double WarmUp(int64_t decodes_since_prefill) const {
        if (decodes_since_prefill < 1 || !(warm_tau > 0)) return 0;
        return std::exp(-static_cast<double>(decodes_since_prefill - 1) / warm_tau);
    }
    // The linear terms alone (no kind's scale, no f).
    double Linear(const CpuProfilePoint& p) const {
        return a + b * static_cast<double>(p.prefill_tokens) +
               c * static_cast<double>(p.decode_seqs) + d * static_cast<double>(p.kv_tokens) +
               e * static_cast<double>(p.prefill_pairs) + g * static_cast<double>(p.cached_chunks) +
               h * static_cast<double>(p.multi_row) + w * WarmUp(p.decodes_since_prefill) +
               k * static_cast<double>(p.prefill_step);
    }
    // The linear terms (without f) times the scale of the point's kind (KindOf).
    double Seconds(const CpuProfilePoint& p) const {
        return kind_scale[static_cast<int>(KindOf(p))] * Linear(p);
    }
    // The point's predicted seconds, its arrivals included.
    double Predict(const CpuProfilePoint& p) const {
        return Seconds(p) + f * static_cast<double>(p.arrivals);
    }
    // Every coefficient times `factor` (> 0): the same machine running `factor` times slower.
    CpuProfile Scaled(double factor) const;
};

// The decay lengths (decode steps) the fit tries for the warm-up term; it keeps the one whose
// fit has the smallest median absolute relative error over all points.
inline constexpr double kWarmTaus[] = {2, 4, 8, 12, 16, 24, 32};

// The step's decodes_since_prefill (CpuProfilePoint) from its instance's previous step's:
// 0 for a step with a prefill chunk, `previous` + 1 for a decode-only step, `previous` for an
// empty one. The step log (coordinator/step_log.cc) and the simulator count alike.
int64_t NextDecodesSincePrefill(int64_t prefill_tokens, int64_t decode_seqs, int64_t previous);

// Fits the profile so that it predicts the median step of each kind, which is what the validated
// figures (TTFT and ITL medians) are made of:
// (1) non-negative least squares of the relative error (each row divided by its measured
//     seconds, so a 20 ms decode step weighs as much as a 2 s prefill; exact: every subset of the
//     terms is solved and the best feasible one kept);
// (2) made outlier-robust by iterative reweighting (Tukey's bisquare on the relative residuals,
//     cutoff 4.685 x their median absolute value / 0.6745): steps the machine stalled get
//     weight 0 and are counted in num_outliers (with 20 points or more; fewer keep the plain fit);
// (3) per StepKind, kind_scale: the median of measured / predicted over the kind's points that
//     (2) kept, each
//     counted once per token it produced (max(1, decode_seqs)). Least squares of the relative
//     error predicts below the median of a right-skewed step time (a step is sometimes much
//     slower than usual, never much faster), and a fit shared by the kinds leaves each its own
//     bias; after (3) the median residual of every kind is 0 on the fitted points.
// When a point has decodes_since_prefill > 0, (1)-(3) run once per warm_tau of kWarmTaus and the
// fit with the smallest median absolute relative error (measured / predicted - 1) over all
// points is kept.
// InvalidArgument when there are no points, a point is negative or not finite, or no subset of
// terms can be fitted.
Result<CpuProfile> FitCpuProfile(const std::vector<CpuProfilePoint>& points);

// Reads measured points from JSON text: any number of JSON values (one document or JSON lines),
// each one of
//   {"prefill_tokens": 512, "decode_seqs": 0, "kv_tokens": 512, "seconds": 0.21}   one point
//     (optional "prefill_pairs", "arrivals", "cached_chunks", "multi_row",
//     "decodes_since_prefill" and "prefill_step", 0 when absent; other
//     fields, as a step log's, are ignored)
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

}  // namespace kvshard::sim
