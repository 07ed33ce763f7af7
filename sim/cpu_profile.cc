#include "sim/cpu_profile.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <utility>

namespace kvshard::sim {

StepKind KindOf(const CpuProfilePoint& point) {
    if (point.prefill_tokens == 0) return StepKind::kDecode;
    if (point.cached_chunks > 0) return StepKind::kCached;
    return point.decode_seqs == 0 ? StepKind::kPrefill : StepKind::kMixed;
}

int64_t NextDecodesSincePrefill(int64_t prefill_tokens, int64_t decode_seqs, int64_t previous) {
    if (prefill_tokens > 0) return 0;
    return decode_seqs > 0 ? previous + 1 : previous;
}

std::string_view StepKindName(StepKind kind) {
    switch (kind) {
        case StepKind::kDecode: return "decode";
        case StepKind::kPrefill: return "prefill";
        case StepKind::kMixed: return "mixed";
        case StepKind::kCached: return "cached";
    }
    return "?";
}

CpuProfile CpuProfile::Scaled(double factor) const {
    CpuProfile p = *this;
    p.a *= factor;
    p.b *= factor;
    p.c *= factor;
    p.d *= factor;
    p.e *= factor;
    p.f *= factor;
    p.g *= factor;
    p.h *= factor;
    p.w *= factor;
    p.k *= factor;
    return p;
}

namespace {

constexpr int kTerms = 10;
using Row = std::array<double, kTerms>;

// `warm` computes the warm-up term's variable (CpuProfile::WarmUp at the tau being tried).
Row Terms(const CpuProfilePoint& p, const CpuProfile& warm) {
    return {1.0,
            static_cast<double>(p.prefill_tokens),
            static_cast<double>(p.decode_seqs),
            static_cast<double>(p.kv_tokens),
            static_cast<double>(p.prefill_pairs),
            static_cast<double>(p.arrivals),
            static_cast<double>(p.cached_chunks),
            static_cast<double>(p.multi_row),
            warm.WarmUp(p.decodes_since_prefill),
            static_cast<double>(p.prefill_step)};
}

double Dot(const Row& coef, const Row& row) {
    double s = 0;
    for (int j = 0; j < kTerms; ++j) s += coef[j] * row[j];
    return s;
}

double Median(std::vector<double> v) {
    if (v.empty()) return 0;
    const size_t mid = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
    if (v.size() % 2 == 1) return v[mid];
    const double upper = v[mid];
    return (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

// The weighted median of (value, weight) pairs: the smallest value at which the weight at or
// below it reaches half of the total.
double WeightedMedian(std::vector<std::pair<double, double>> v) {
    std::sort(v.begin(), v.end());
    double total = 0;
    for (const auto& [value, weight] : v) total += weight;
    double below = 0;
    for (const auto& [value, weight] : v) {
        below += weight;
        if (below >= total / 2) return value;
    }
    return v.back().first;
}

// Weighted non-negative least squares of y on the rows x, by enumeration: the optimum is the
// least-squares fit on its set of positive terms, and every feasible subset fit is a feasible
// point, so the best feasible subset is the optimum. Columns are scaled to a unit maximum so that
// the elimination's pivot test is scale-free. The normal equations of all terms are summed once
// and each subset solves its own rows and columns of them (2^kTerms subsets over thousands of
// steps). Returns the weighted sse of `best`, infinite when no subset can be fitted.
double SolveNnls(const std::vector<Row>& x, const std::vector<double>& y,
                 const std::vector<double>& w, Row& best) {
    const size_t n = x.size();
    Row scale{};
    for (int j = 0; j < kTerms; ++j) {
        for (size_t i = 0; i < n; ++i) scale[j] = std::max(scale[j], std::fabs(x[i][j]));
    }
    double gram[kTerms][kTerms] = {};
    double xty[kTerms] = {};
    double yty = 0;
    double weight_sum = 0;
    for (size_t i = 0; i < n; ++i) {
        if (w[i] == 0) continue;
        weight_sum += w[i];
        yty += w[i] * y[i] * y[i];
        for (int r = 0; r < kTerms; ++r) {
            if (scale[r] == 0) continue;
            const double xr = w[i] * x[i][r] / scale[r];
            xty[r] += xr * y[i];
            for (int t = 0; t < kTerms; ++t) {
                if (scale[t] != 0) gram[r][t] += xr * x[i][t] / scale[t];
            }
        }
    }
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
        for (int r = 0; r < k; ++r) {
            for (int t = 0; t < k; ++t) m[r][t] = gram[cols[r]][cols[t]];
            m[r][k] = xty[cols[r]];
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
        double scaled[kTerms] = {};  // the solution in scaled columns
        bool feasible = true;
        for (int r = 0; r < k; ++r) {
            scaled[r] = m[r][k] / m[r][r];
            if (scaled[r] < 0) feasible = false;
        }
        if (!feasible) continue;
        // sse = y'Wy - 2 c'X'Wy + c'X'WXc, from the sums above.
        double sse = yty;
        for (int r = 0; r < k; ++r) {
            sse -= 2 * scaled[r] * xty[cols[r]];
            for (int t = 0; t < k; ++t) sse += scaled[r] * scaled[t] * gram[cols[r]][cols[t]];
        }
        if (sse < best_sse) {
            best_sse = sse;
            best = Row{};
            for (int r = 0; r < k; ++r) best[cols[r]] = scaled[r] / scale[cols[r]];
        }
    }
    return best_sse;
}

// (1)-(3) of FitCpuProfile with the warm-up term's variable at `warm_tau` (0: the term is 0).
// The points are valid. InvalidArgument when no subset of terms can be fitted.
Result<CpuProfile> FitAtWarmTau(const std::vector<CpuProfilePoint>& points, double warm_tau) {
    const size_t n = points.size();
    CpuProfile p;
    p.warm_tau = warm_tau;
    std::vector<Row> raw(n);
    std::vector<double> seconds(n);
    for (size_t i = 0; i < n; ++i) {
        raw[i] = Terms(points[i], p);
        seconds[i] = points[i].seconds;
    }
    // (1) Relative least squares: each point's row divided by its measured time, so a 20 ms
    // decode step counts as much as a 2 s prefill (plain least squares fits the prefill points
    // and leaves decode steps, which set the inter-token latency, to the constant term).
    std::vector<Row> x = raw;
    std::vector<double> y = seconds;
    std::vector<double> w(n, 1.0);
    for (size_t i = 0; i < n; ++i) {
        if (!(y[i] > 0)) continue;
        for (double& v : x[i]) v /= y[i];
        y[i] = 1.0;
    }
    Row best{};
    if (!std::isfinite(SolveNnls(x, y, w, best))) {
        return InvalidArgument("CPU profile: the " + std::to_string(n) +
                               " points admit no non-negative fit");
    }
    // (2) Outlier-robust: iteratively reweighted least squares with Tukey's bisquare on the
    // relative residuals, from (1). A step caught in a stall of the machine (2-100x its usual
    // time) gets weight 0 instead of pulling every coefficient up. The scale is the residuals'
    // median absolute value / 0.6745 (a normal's sigma), the cutoff 4.685 of it (95% efficiency
    // for normal errors); a fit that leaves most residuals at 0 (exact points) stops at once.
    // Below kMinRobustPoints the plain fit stands: a median of a handful of residuals is no scale.
    constexpr size_t kMinRobustPoints = 20;
    int64_t outliers = 0;
    for (int iteration = 0; iteration < 30 && n >= kMinRobustPoints; ++iteration) {
        std::vector<double> abs_residual(n);
        for (size_t i = 0; i < n; ++i) abs_residual[i] = std::fabs(Dot(best, x[i]) - y[i]);
        const double sigma = Median(abs_residual) / 0.6745;
        if (!(sigma > 1e-9)) break;
        outliers = 0;
        for (size_t i = 0; i < n; ++i) {
            const double u = abs_residual[i] / (4.685 * sigma);
            w[i] = u < 1 ? (1 - u * u) * (1 - u * u) : 0.0;
            if (w[i] == 0) outliers++;
        }
        Row next{};
        if (!std::isfinite(SolveNnls(x, y, w, next))) break;  // too few inliers: keep the last
        // Settled when no term's contribution (coefficient x its column's largest value) moves.
        double change = 0, size = 0;
        for (int j = 0; j < kTerms; ++j) {
            double column = 0;
            for (size_t i = 0; i < n; ++i) column = std::max(column, std::fabs(x[i][j]));
            change = std::max(change, std::fabs(next[j] - best[j]) * column);
            size = std::max(size, std::fabs(next[j]) * column);
        }
        best = next;
        if (change <= 1e-7 * size) break;
    }
    p.a = best[0];
    p.b = best[1];
    p.c = best[2];
    p.d = best[3];
    p.e = best[4];
    p.f = best[5];
    p.g = best[6];
    p.h = best[7];
    p.w = best[8];
    p.k = best[9];
    p.num_points = static_cast<int64_t>(n);
    p.num_outliers = outliers;
    // (3) The median per kind of step: least squares of the relative error predicts below the
    // median of a right-skewed step time (it fits 1 / seconds, whose tail is the short steps), and
    // a linear fit shared by all kinds leaves each kind its own bias. Each kind's prediction is
    // multiplied by the median over its points of measured / predicted, each point counted once
    // per token it produced (max(1, decode_seqs)): the validated ITL is a median over tokens. Over
    // the points (2) kept (weight > 0): a stall moves no coefficient and no median either.
    std::vector<std::pair<double, double>> ratios[kNumStepKinds];  // (ratio, tokens)
    for (size_t i = 0; i < n; ++i) {
        const CpuProfilePoint& q = points[i];
        const int kind = static_cast<int>(KindOf(q));
        p.kind_points[kind]++;
        const double predicted = p.Predict(q);  // every kind_scale is still 1
        if (predicted > 0 && w[i] > 0) {
            ratios[kind].push_back(
                {seconds[i] / predicted, static_cast<double>(std::max<int64_t>(1, q.decode_seqs))});
        }
    }
    for (int k = 0; k < kNumStepKinds; ++k) {
        if (ratios[k].empty()) continue;
        p.kind_scale[k] = WeightedMedian(ratios[k]);
        for (const auto& ratio_tokens : ratios[k])
            p.kind_spread[k].push_back(ratio_tokens.first / p.kind_scale[k]);
        std::sort(p.kind_spread[k].begin(), p.kind_spread[k].end());
    }
    double sse_seconds = 0;
    for (size_t i = 0; i < n; ++i) {
        const double e = p.Predict(points[i]) - seconds[i];
        sse_seconds += e * e;
    }
    p.rms_error_s = std::sqrt(sse_seconds / static_cast<double>(n));
    return p;
}

// The median over the points of |measured / predicted - 1| (a point predicted at 0 counts as
// an error of 1): how the fits at different warm_tau are compared.
double MedianRelativeError(const CpuProfile& p, const std::vector<CpuProfilePoint>& points) {
    std::vector<double> errors;
    errors.reserve(points.size());
    for (const CpuProfilePoint& q : points) {
        const double predicted = p.Predict(q);
        errors.push_back(predicted > 0 ? std::fabs(q.seconds / predicted - 1) : 1.0);
    }
    return Median(std::move(errors));
}

}  // namespace

Result<CpuProfile> FitCpuProfile(const std::vector<CpuProfilePoint>& points) {
    if (points.empty()) return InvalidArgument("CPU profile: no points to fit");
    bool has_warm_up = false;
    for (size_t i = 0; i < points.size(); ++i) {
        const CpuProfilePoint& p = points[i];
        if (p.prefill_tokens < 0 || p.decode_seqs < 0 || p.kv_tokens < 0 || p.prefill_pairs < 0 ||
            p.arrivals < 0 || p.cached_chunks < 0 || p.multi_row < 0 ||
            p.decodes_since_prefill < 0 || p.prefill_step < 0 || p.prefill_step > 1 ||
            !(p.seconds >= 0 && std::isfinite(p.seconds))) {
            return InvalidArgument("CPU profile: point " + std::to_string(i) +
                                   " has a negative or non-finite value");
        }
        has_warm_up = has_warm_up || p.decodes_since_prefill > 0;
    }
    if (!has_warm_up) return FitAtWarmTau(points, 0);
    // The warm-up's decay length is not linear in the fit: each of kWarmTaus is fitted and the
    // one that predicts the points best (median relative error) is kept.
    std::optional<CpuProfile> best;
    double best_error = std::numeric_limits<double>::infinity();
    for (const double tau : kWarmTaus) {
        KV_ASSIGN_OR_RETURN(CpuProfile p, FitAtWarmTau(points, tau));
        const double error = MedianRelativeError(p, points);
        if (error < best_error) {
            best_error = error;
            best = p;
        }
    }
    if (best->w == 0) best->warm_tau = 0;  // no warm-up in the points: no length either
    return *best;
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
    if (v.contains("cached_chunks")) {
        KV_ASSIGN_OR_RETURN(p.cached_chunks, JsonCount(v, "cached_chunks", where));
    }
    if (v.contains("multi_row")) {
        KV_ASSIGN_OR_RETURN(p.multi_row, JsonCount(v, "multi_row", where));
        if (p.multi_row > 1) return InvalidArgument(where + ": field 'multi_row': expected 0 or 1");
    }
    if (v.contains("decodes_since_prefill")) {
        KV_ASSIGN_OR_RETURN(p.decodes_since_prefill, JsonCount(v, "decodes_since_prefill", where));
    }
    if (v.contains("prefill_step")) {
        KV_ASSIGN_OR_RETURN(p.prefill_step, JsonCount(v, "prefill_step", where));
        if (p.prefill_step > 1) {
            return InvalidArgument(where + ": field 'prefill_step': expected 0 or 1");
        }
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
