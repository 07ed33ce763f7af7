// Workloads for the simulator: requests as (arrival time, prompt length, output length, shared
// prefix), from length distributions and arrival processes, from datasets that mirror `kvshard
// bench`'s (loadgen/dataset.h: the same parameters and length rules, counted in tokens), or from a
// trace file. Everything is seeded (std::mt19937_64) and deterministic: the same spec and seed
// give the same requests on every machine with the same standard library.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard::sim {

struct SimRequest {
    double arrival_s = 0;
    int64_t prompt_len = 0;
    int64_t output_len = 0;
    int64_t prefix_group = -1;  // requests of one group share their first prefix_len tokens
    int64_t prefix_len = 0;     // <= prompt_len
    friend bool operator==(const SimRequest&, const SimRequest&) = default;
};

// A distribution of lengths (tokens), clipped to [min, max] and never below 1.
struct LengthDist {
    enum class Kind { kFixed, kUniform, kLogNormal };
    Kind kind = Kind::kFixed;
    int64_t value = 128;  // kFixed
    int64_t lo = 1;       // kUniform: [lo, hi], inclusive
    int64_t hi = 1;
    // kLogNormal: log-normal with this sigma (of the underlying normal) and either its median or
    // its mean (mean = median x exp(sigma^2 / 2)); exactly one of them > 0.
    double median = 0;
    double mean = 0;
    double sigma = 0.5;
    int64_t min = 1;
    int64_t max = int64_t{1} << 40;

    static LengthDist Fixed(int64_t v);
    static LengthDist Uniform(int64_t lo, int64_t hi);
    static LengthDist LogNormalMedian(double median, double sigma, int64_t min, int64_t max);
    static LengthDist LogNormalMean(double mean, double sigma, int64_t min, int64_t max);

    // InvalidArgument naming `what` and the field.
    Status Validate(const std::string& what) const;
    // REQUIRES: Validate() is OK.
    int64_t Sample(std::mt19937_64& rng) const;
};

struct ArrivalSpec {
    enum class Kind {
        kPoisson,   // exponential inter-arrival times, mean 1 / rate
        kBursty,    // gamma inter-arrival times, shape = burstiness, mean 1 / rate (vLLM's
                    // benchmark --burstiness: 1 is Poisson, < 1 burstier, > 1 more regular)
        kInfinite,  // every request at t = 0 ("inf")
    };
    Kind kind = Kind::kPoisson;
    double rate = 1.0;  // requests per second (kPoisson, kBursty)
    double burstiness = 1.0;
};

// "poisson", "bursty", "inf"; InvalidArgument otherwise.
Result<ArrivalSpec::Kind> ParseArrivalKind(std::string_view name);

// `n` arrival times in increasing order; the first request arrives after one inter-arrival time
// (at 0 for kInfinite). InvalidArgument for a rate or burstiness that is not positive.
Result<std::vector<double>> MakeArrivals(const ArrivalSpec& spec, int64_t n, uint64_t seed);

// Requests with lengths drawn from two distributions.
struct LengthWorkload {
    int64_t num_requests = 100;
    LengthDist prompt = LengthDist::Fixed(256);
    LengthDist output = LengthDist::Fixed(128);
    ArrivalSpec arrivals;
    uint64_t seed = 0;
};
Result<std::vector<SimRequest>> MakeWorkload(const LengthWorkload& workload);

// The datasets of loadgen/dataset.h, in tokens (a bench word is about one token):
//   random         prompt uniform in [input_len (1-r), input_len (1+r)] (floor, ceil, >= 1),
//                  output likewise (r = range_ratio)
//   shared-prefix  num_groups groups, round-robin; prompt = prefix_len (shared) + suffix_len;
//                  output output_len
//   chat           log-normal lengths with medians input_len and output_len, sigma 0.8 and 0.6,
//                  clipped to [4, 8 x median] and [1, 8 x median]
enum class DatasetKind { kRandom, kSharedPrefix, kChat };
// "random", "shared-prefix", "chat".
Result<DatasetKind> ParseDatasetKind(std::string_view name);

struct DatasetWorkload {
    DatasetKind kind = DatasetKind::kRandom;
    int64_t num_requests = 100;
    int64_t input_len = 256;
    int64_t output_len = 128;
    double range_ratio = 0.0;
    int64_t num_groups = 4;
    int64_t prefix_len = 512;
    int64_t suffix_len = 32;
    ArrivalSpec arrivals;
    uint64_t seed = 0;
};
// InvalidArgument for out-of-range options (loadgen's rules).
Result<std::vector<SimRequest>> MakeWorkload(const DatasetWorkload& workload);

// A trace: JSON lines, one request each, e.g.
//   {"arrival_s": 0.5, "prompt_len": 812, "output_len": 64, "prefix_group": 2, "prefix_len": 512}
// with the aliases timestamp (for arrival_s), input_length (prompt_len), output_length
// (output_len). Blank lines are skipped. Requests are returned sorted by arrival (stable).
// Errors: NotFound for a missing file; InvalidArgument "<file>:<line>: field '<name>': <problem>".
Result<std::vector<SimRequest>> ReadTrace(const std::string& path);
Result<std::vector<SimRequest>> ParseTrace(std::string_view text, const std::string& path);

// Token ids in [0, vocab_size) for a request's prompt: the first prefix_len ids depend only on
// prefix_group (so every request of a group shares them exactly, whatever its seed), the rest on
// `seed` (give each request its own, e.g. the workload seed mixed with its index; two requests
// with different seeds then match at each later position with probability 1 / vocab_size).
// Requests without a group (prefix_group < 0) take every id from `seed`. REQUIRES: vocab_size >= 1.
std::vector<int32_t> PromptTokens(const SimRequest& request, int64_t vocab_size, uint64_t seed);

}  // namespace kvshard::sim
