#include "loadgen/trace_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

namespace kvshard::loadgen {

using nlohmann::json;

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

}  // namespace kvshard::loadgen
