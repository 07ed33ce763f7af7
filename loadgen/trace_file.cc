#include "loadgen/trace_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "loadgen/bench_report.h"

namespace kvshard::loadgen {

using nlohmann::json;

namespace {

std::vector<double> MillisecondsOf(const std::vector<double>& seconds) {
    std::vector<double> ms;
    ms.reserve(seconds.size());
    for (double s : seconds) ms.push_back(1000 * s);
    return ms;
}

}  // namespace

std::string TraceLine(const TraceLineFields& f) {
    json line = {
        {"arrival_s", f.arrival_s},
        {"prompt_len", f.prompt_len},
        {"output_len", f.output_len},
    };
    if (f.prefix_group >= 0) {
        line["prefix_group"] = f.prefix_group;
        line["prefix_len"] = f.prefix_len;
    }
    if (f.ttft_ms >= 0) line["ttft_ms"] = f.ttft_ms;
    if (f.e2el_ms >= 0) line["e2el_ms"] = f.e2el_ms;
    if (f.itl_median_ms >= 0) line["itl_median_ms"] = f.itl_median_ms;
    if (!f.itl_ms.empty()) line["itl_ms"] = f.itl_ms;
    if (f.sent_clock_s >= 0) line["sent_clock_s"] = f.sent_clock_s;
    return line.dump();
}

Result<std::vector<TraceLineFields>> MakeTrace(const std::vector<BenchPrompt>& prompts,
                                               const BenchRun& run,
                                               const TokenCounter& count_tokens) {
    struct Group {
        int64_t id;
        int64_t tokens;
    };
    std::map<std::string, Group> groups;  // by prefix text
    std::vector<TraceLineFields> lines;
    for (size_t i = 0; i < run.outcomes.size() && i < prompts.size(); ++i) {
        const RequestOutcome& o = run.outcomes[i];
        if (!o.ok) continue;
        if (o.prompt_tokens < 0) {
            return Unavailable("request " + std::to_string(i) +
                               ": the server's usage had no prompt_tokens, which the "
                               "trace needs");
        }
        TraceLineFields f{
            .arrival_s = o.start_s, .prompt_len = o.prompt_tokens, .output_len = o.output_tokens};
        f.ttft_ms = 1000 * o.ttft_s;
        f.e2el_ms = 1000 * o.e2e_s;
        if (!o.itl_s.empty()) f.itl_median_ms = 1000 * Summarize(o.itl_s).median;
        f.itl_ms = MillisecondsOf(o.itl_s);
        if (run.start_clock_s > 0) f.sent_clock_s = run.start_clock_s + o.start_s;
        const std::string& prefix = prompts[i].prefix;
        if (!prefix.empty()) {
            auto it = groups.find(prefix);
            if (it == groups.end()) {
                KV_ASSIGN_OR_RETURN(const int64_t tokens,
                                    count_tokens(prefix, /*add_special_tokens=*/true));
                it = groups.emplace(prefix, Group{static_cast<int64_t>(groups.size()), tokens})
                         .first;
            }
            f.prefix_group = it->second.id;
            // Within the prompt: the server may count the prefix one token differently where it
            // meets the rest, never longer than the prompt.
            f.prefix_len = std::min(it->second.tokens, f.prompt_len);
        }
        lines.push_back(f);
    }
    std::stable_sort(lines.begin(), lines.end(),
                     [](const TraceLineFields& a, const TraceLineFields& b) {
                         return a.arrival_s < b.arrival_s;
                     });
    return lines;
}

Status WriteTraceFile(const std::string& path, const std::vector<TraceLineFields>& lines) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) {
        return InvalidArgument("--trace-out " + path + ": cannot write (" + std::strerror(errno) +
                               ")");
    }
    for (const TraceLineFields& f : lines) out << TraceLine(f) << '\n';
    out.flush();
    if (!out) return InvalidArgument("--trace-out " + path + ": write failed");
    return Status::Ok();
}

std::string PerRequestLine(size_t index, const RequestOutcome& o) {
    json line = {{"request", index},
                 {"arrival_s", o.start_s},
                 {"prompt_len", o.prompt_tokens},
                 {"ok", o.ok},
                 {"output_len", o.output_tokens}};
    if (o.ttft_s > 0) line["ttft_ms"] = 1000 * o.ttft_s;
    if (o.ok) line["e2el_ms"] = 1000 * o.e2e_s;
    if (!o.itl_s.empty()) {
        line["itl_median_ms"] = 1000 * Summarize(o.itl_s).median;
        line["itl_ms"] = MillisecondsOf(o.itl_s);
    }
    if (!o.ok) line["error"] = o.error;
    return line.dump();
}

Status WritePerRequestFile(const std::string& path, const std::vector<RequestOutcome>& outcomes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) {
        return InvalidArgument("--per-request-out " + path + ": cannot write (" +
                               std::strerror(errno) + ")");
    }
    for (size_t i = 0; i < outcomes.size(); ++i) out << PerRequestLine(i, outcomes[i]) << '\n';
    out.flush();
    if (!out) return InvalidArgument("--per-request-out " + path + ": write failed");
    return Status::Ok();
}

}  // namespace kvshard::loadgen
