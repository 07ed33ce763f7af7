#include "sim/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kvshard::sim {
namespace {

std::string Str(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
}

// splitmix64: decorrelates seeds that differ in a few bits (0, 1, 2, ...).
uint64_t Mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// Independent streams of one workload seed: lengths and arrivals do not perturb each other.
constexpr uint64_t kLengthStream = 1;
constexpr uint64_t kArrivalStream = 2;
constexpr uint64_t kPrefixStream = 3;

uint64_t StreamSeed(uint64_t seed, uint64_t stream) { return Mix(seed ^ Mix(stream)); }

// loadgen/dataset.cc's UniformAround.
int64_t UniformAround(int64_t center, double ratio, std::mt19937_64& rng) {
    const auto lo = static_cast<int64_t>(std::floor(static_cast<double>(center) * (1.0 - ratio)));
    const auto hi = static_cast<int64_t>(std::ceil(static_cast<double>(center) * (1.0 + ratio)));
    return std::uniform_int_distribution<int64_t>(std::max<int64_t>(lo, 1),
                                                  std::max<int64_t>(hi, 1))(rng);
}

Status Positive(const char* what, int64_t v) {
    if (v >= 1) return Status::Ok();
    return InvalidArgument(std::string(what) + " must be >= 1, got " + std::to_string(v));
}

}  // namespace

LengthDist LengthDist::Fixed(int64_t v) {
    LengthDist d;
    d.kind = Kind::kFixed;
    d.value = v;
    return d;
}

LengthDist LengthDist::Uniform(int64_t lo, int64_t hi) {
    LengthDist d;
    d.kind = Kind::kUniform;
    d.lo = lo;
    d.hi = hi;
    return d;
}

LengthDist LengthDist::LogNormalMedian(double median, double sigma, int64_t min, int64_t max) {
    LengthDist d;
    d.kind = Kind::kLogNormal;
    d.median = median;
    d.sigma = sigma;
    d.min = min;
    d.max = max;
    return d;
}

LengthDist LengthDist::LogNormalMean(double mean, double sigma, int64_t min, int64_t max) {
    LengthDist d = LogNormalMedian(0, sigma, min, max);
    d.mean = mean;
    return d;
}

Status LengthDist::Validate(const std::string& what) const {
    if (min < 1 || max < min) {
        return InvalidArgument(what + ": clip range [" + std::to_string(min) + ", " +
                               std::to_string(max) + "] must have 1 <= min <= max");
    }
    switch (kind) {
        case Kind::kFixed:
            if (value < 1)
                return InvalidArgument(what + ": length must be >= 1, got " +
                                       std::to_string(value));
            return Status::Ok();
        case Kind::kUniform:
            if (lo < 1 || hi < lo) {
                return InvalidArgument(what + ": uniform [" + std::to_string(lo) + ", " +
                                       std::to_string(hi) + "] must have 1 <= lo <= hi");
            }
            return Status::Ok();
        case Kind::kLogNormal:
            if (!(sigma >= 0 && std::isfinite(sigma))) {
                return InvalidArgument(what + ": sigma must be >= 0, got " + Str(sigma));
            }
            if ((median > 0) == (mean > 0) || !std::isfinite(median) || !std::isfinite(mean)) {
                return InvalidArgument(what + ": give exactly one of a positive median or mean");
            }
            return Status::Ok();
    }
    return Status::Ok();
}

int64_t LengthDist::Sample(std::mt19937_64& rng) const {
    int64_t v = 1;
    switch (kind) {
        case Kind::kFixed:
            v = value;
            break;
        case Kind::kUniform:
            v = std::uniform_int_distribution<int64_t>(lo, hi)(rng);
            break;
        case Kind::kLogNormal: {
            const double m = median > 0 ? median : mean * std::exp(-sigma * sigma / 2);
            std::lognormal_distribution<double> dist(std::log(m), sigma);
            const double x = dist(rng);
            v = x >= 9e18 ? max : static_cast<int64_t>(std::llround(x));
            break;
        }
    }
    return std::clamp<int64_t>(v, std::max<int64_t>(min, 1), max);
}

Result<ArrivalSpec::Kind> ParseArrivalKind(std::string_view name) {
    if (name == "poisson") return ArrivalSpec::Kind::kPoisson;
    if (name == "bursty" || name == "gamma") return ArrivalSpec::Kind::kBursty;
    if (name == "inf") return ArrivalSpec::Kind::kInfinite;
    return InvalidArgument("unknown arrival process '" + std::string(name) +
                           "' (expected poisson, bursty or inf)");
}

Result<std::vector<double>> MakeArrivals(const ArrivalSpec& spec, int64_t n, uint64_t seed) {
    if (n < 0) return InvalidArgument("number of requests must be >= 0, got " + std::to_string(n));
    std::vector<double> out(static_cast<size_t>(n), 0.0);
    if (spec.kind == ArrivalSpec::Kind::kInfinite) return out;
    if (!(spec.rate > 0 && std::isfinite(spec.rate))) {
        return InvalidArgument("request rate must be positive (req/s), got " + Str(spec.rate));
    }
    std::mt19937_64 rng(seed);
    double t = 0;
    if (spec.kind == ArrivalSpec::Kind::kPoisson) {
        std::exponential_distribution<double> gap(spec.rate);
        for (double& a : out) a = t += gap(rng);
        return out;
    }
    if (!(spec.burstiness > 0 && std::isfinite(spec.burstiness))) {
        return InvalidArgument("burstiness must be positive, got " + Str(spec.burstiness));
    }
    // Gamma with shape k and scale theta has mean k theta: theta = 1 / (rate k).
    std::gamma_distribution<double> gap(spec.burstiness, 1.0 / (spec.rate * spec.burstiness));
    for (double& a : out) a = t += gap(rng);
    return out;
}

Result<std::vector<SimRequest>> MakeWorkload(const LengthWorkload& w) {
    KV_RETURN_IF_ERROR(Positive("number of requests", w.num_requests));
    KV_RETURN_IF_ERROR(w.prompt.Validate("prompt length"));
    KV_RETURN_IF_ERROR(w.output.Validate("output length"));
    KV_ASSIGN_OR_RETURN(
        const std::vector<double> arrivals,
        MakeArrivals(w.arrivals, w.num_requests, StreamSeed(w.seed, kArrivalStream)));
    std::mt19937_64 rng(StreamSeed(w.seed, kLengthStream));
    std::vector<SimRequest> out(static_cast<size_t>(w.num_requests));
    for (size_t i = 0; i < out.size(); ++i) {
        out[i].arrival_s = arrivals[i];
        out[i].prompt_len = w.prompt.Sample(rng);
        out[i].output_len = w.output.Sample(rng);
    }
    return out;
}

Result<DatasetKind> ParseDatasetKind(std::string_view name) {
    if (name == "random") return DatasetKind::kRandom;
    if (name == "shared-prefix") return DatasetKind::kSharedPrefix;
    if (name == "chat") return DatasetKind::kChat;
    return InvalidArgument("unknown dataset '" + std::string(name) +
                           "' (expected random, shared-prefix or chat)");
}

Result<std::vector<SimRequest>> MakeWorkload(const DatasetWorkload& o) {
    // The checks of loadgen's MakeDataset, with its flag names.
    KV_RETURN_IF_ERROR(Positive("--num-requests", o.num_requests));
    KV_RETURN_IF_ERROR(Positive("--output-len", o.output_len));
    if (o.kind == DatasetKind::kSharedPrefix) {
        KV_RETURN_IF_ERROR(Positive("--num-groups", o.num_groups));
        KV_RETURN_IF_ERROR(Positive("--prefix-len", o.prefix_len));
        KV_RETURN_IF_ERROR(Positive("--suffix-len", o.suffix_len));
    } else {
        KV_RETURN_IF_ERROR(Positive("--input-len", o.input_len));
    }
    if (!(o.range_ratio >= 0.0 && o.range_ratio < 1.0)) {
        return InvalidArgument("--range-ratio must be in [0, 1), got " + Str(o.range_ratio));
    }
    KV_ASSIGN_OR_RETURN(
        const std::vector<double> arrivals,
        MakeArrivals(o.arrivals, o.num_requests, StreamSeed(o.seed, kArrivalStream)));
    std::mt19937_64 rng(StreamSeed(o.seed, kLengthStream));
    const LengthDist chat_prompt = LengthDist::LogNormalMedian(
        static_cast<double>(o.input_len), 0.8, 4, std::max<int64_t>(4, 8 * o.input_len));
    const LengthDist chat_output = LengthDist::LogNormalMedian(
        static_cast<double>(o.output_len), 0.6, 1, std::max<int64_t>(1, 8 * o.output_len));
    std::vector<SimRequest> out(static_cast<size_t>(o.num_requests));
    for (size_t i = 0; i < out.size(); ++i) {
        SimRequest& r = out[i];
        r.arrival_s = arrivals[i];
        switch (o.kind) {
            case DatasetKind::kRandom:
                r.prompt_len = UniformAround(o.input_len, o.range_ratio, rng);
                r.output_len = UniformAround(o.output_len, o.range_ratio, rng);
                break;
            case DatasetKind::kSharedPrefix:
                r.prefix_group = static_cast<int64_t>(i) % o.num_groups;
                r.prefix_len = o.prefix_len;
                r.prompt_len = o.prefix_len + o.suffix_len;
                r.output_len = o.output_len;
                break;
            case DatasetKind::kChat:
                r.prompt_len = chat_prompt.Sample(rng);
                r.output_len = chat_output.Sample(rng);
                break;
        }
    }
    return out;
}

// ---- traces ----

namespace {

using nlohmann::json;

// The value of `key` or of its alias; nullptr when neither is present.
const json* Field(const json& j, const char* key, const char* alias) {
    if (j.contains(key)) return &j.at(key);
    if (alias != nullptr && j.contains(alias)) return &j.at(alias);
    return nullptr;
}

Status Bad(const std::string& where, const char* key, const std::string& why) {
    return InvalidArgument(where + ": field '" + key + "': " + why);
}

Result<int64_t> Count(const json& j, const char* key, const char* alias, const std::string& where,
                      bool required, int64_t fallback, int64_t min) {
    const json* v = Field(j, key, alias);
    if (v == nullptr) {
        if (required) return Bad(where, key, "missing");
        return fallback;
    }
    if (!v->is_number_integer()) {
        if (v->is_number_float() && v->get<double>() == std::floor(v->get<double>()) &&
            std::fabs(v->get<double>()) < 9e15) {
            const auto n = static_cast<int64_t>(v->get<double>());
            if (n < min) return Bad(where, key, "must be >= " + std::to_string(min));
            return n;
        }
        return Bad(where, key, "expected an integer, got " + v->dump());
    }
    const int64_t n = v->get<int64_t>();
    if (n < min)
        return Bad(where, key, "must be >= " + std::to_string(min) + ", got " + std::to_string(n));
    return n;
}

}  // namespace

Result<std::vector<SimRequest>> ParseTrace(std::string_view text, const std::string& path) {
    std::vector<SimRequest> out;
    size_t begin = 0;
    int64_t line = 0;
    while (begin <= text.size()) {
        size_t end = text.find('\n', begin);
        if (end == std::string_view::npos) end = text.size();
        ++line;
        const std::string_view raw = text.substr(begin, end - begin);
        begin = end + 1;
        if (raw.find_first_not_of(" \t\r") == std::string_view::npos) {
            if (end == text.size()) break;
            continue;
        }
        const std::string where = path + ":" + std::to_string(line);
        const json j = json::parse(raw, nullptr, false);
        if (j.is_discarded()) return InvalidArgument(where + ": not valid JSON");
        if (!j.is_object()) return InvalidArgument(where + ": expected a JSON object");
        SimRequest r;
        const json* t = Field(j, "arrival_s", "timestamp");
        if (t == nullptr) return Bad(where, "arrival_s", "missing (or 'timestamp')");
        if (!t->is_number() || !std::isfinite(t->get<double>()) || t->get<double>() < 0) {
            return Bad(where, "arrival_s", "expected seconds >= 0, got " + t->dump());
        }
        r.arrival_s = t->get<double>();
        KV_ASSIGN_OR_RETURN(r.prompt_len,
                            Count(j, "prompt_len", "input_length", where, true, 0, 1));
        KV_ASSIGN_OR_RETURN(r.output_len,
                            Count(j, "output_len", "output_length", where, true, 0, 1));
        KV_ASSIGN_OR_RETURN(r.prefix_group,
                            Count(j, "prefix_group", nullptr, where, false, -1, -1));
        KV_ASSIGN_OR_RETURN(r.prefix_len, Count(j, "prefix_len", nullptr, where, false, 0, 0));
        if (r.prefix_len > r.prompt_len) {
            return Bad(where, "prefix_len",
                       std::to_string(r.prefix_len) + " exceeds prompt_len " +
                           std::to_string(r.prompt_len));
        }
        if (r.prefix_len > 0 && r.prefix_group < 0) {
            return Bad(where, "prefix_group", "missing: prefix_len needs a group");
        }
        out.push_back(r);
        if (end == text.size()) break;
    }
    std::stable_sort(out.begin(), out.end(), [](const SimRequest& a, const SimRequest& b) {
        return a.arrival_s < b.arrival_s;
    });
    return out;
}

Result<std::vector<SimRequest>> ReadTrace(const std::string& path) {
    std::ifstream in(path);
    if (!in) return NotFound(path + ": cannot open the trace");
    std::stringstream text;
    text << in.rdbuf();
    return ParseTrace(text.str(), path);
}

std::vector<int32_t> PromptTokens(const SimRequest& request, int64_t vocab_size, uint64_t seed) {
    KV_CHECK(vocab_size >= 1) << "vocab_size " << vocab_size;
    std::vector<int32_t> ids(static_cast<size_t>(std::max<int64_t>(request.prompt_len, 0)));
    std::uniform_int_distribution<int64_t> pick(0, vocab_size - 1);
    size_t i = 0;
    if (request.prefix_group >= 0) {
        const size_t shared = std::min(ids.size(), static_cast<size_t>(request.prefix_len));
        std::mt19937_64 group(
            StreamSeed(static_cast<uint64_t>(request.prefix_group), kPrefixStream));
        for (; i < shared; ++i) ids[i] = static_cast<int32_t>(pick(group));
    }
    std::mt19937_64 own(Mix(seed));
    for (; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(pick(own));
    return ids;
}

}  // namespace kvshard::sim
