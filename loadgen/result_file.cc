#include "loadgen/result_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loadgen/bench_report.h"

namespace kvshard::loadgen {

using nlohmann::json;

namespace {

json CountOrNull(int64_t n) { return n >= 0 ? json(n) : json(nullptr); }

}  // namespace

std::string ResultLine(size_t index, const BenchPrompt& prompt, const RequestOutcome& o) {
    json itl = json::array();
    for (double gap : o.itl_s) itl.push_back(gap * 1e3);
    // TTFT is measured at the first chunk with text; a request that failed before one has none.
    const bool has_ttft = o.ok || o.ttft_s > 0;
    json line = {
        {"index", index},
        {"ok", o.ok},
        {"error", o.ok ? json(nullptr) : json(o.error)},
        {"start_ms", o.start_s * 1e3},
        {"prompt_tokens", CountOrNull(o.prompt_tokens)},
        {"dataset_prompt_tokens", CountOrNull(prompt.prompt_tokens)},
        {"max_tokens", prompt.output_len},
        {"output_tokens", o.output_tokens},
        {"ttft_ms", has_ttft ? json(o.ttft_s * 1e3) : json(nullptr)},
        {"itl_ms", std::move(itl)},
        {"tpot_ms",
         o.ok && o.output_tokens > 1 ? json(TimePerOutputToken(o) * 1e3) : json(nullptr)},
        {"e2el_ms", o.e2e_s * 1e3},
        {"cached_tokens", CountOrNull(o.cached_tokens)},
    };
    return line.dump(-1, ' ', false, json::error_handler_t::replace);
}

Status WriteResultFile(const std::string& path, const std::vector<BenchPrompt>& prompts,
                       const BenchRun& run) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) {
        return InvalidArgument("--result-file " + path + ": cannot write (" + std::strerror(errno) +
                               ")");
    }
    for (size_t i = 0; i < run.outcomes.size() && i < prompts.size(); ++i) {
        out << ResultLine(i, prompts[i], run.outcomes[i]) << '\n';
    }
    out.flush();
    if (!out) return InvalidArgument("--result-file " + path + ": write failed");
    return Status::Ok();
}

}  // namespace kvshard::loadgen
