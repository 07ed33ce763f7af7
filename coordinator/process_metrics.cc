#include "coordinator/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace kvshard {

namespace {

Result<std::string> ReadFile(const char* path) {
    std::ifstream in(path);
    if (!in) return Status(StatusCode::kUnavailable, std::string("cannot read ") + path);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

}  // namespace

Result<ProcessStats> ParseProcStat(const std::string& stat, double boot_time_seconds,
                                   double ticks_per_second, double page_size_bytes) {
    const size_t name_end = stat.rfind(')');
    if (name_end == std::string::npos) return InvalidArgument("stat: no ')' after the command");
    // Fields from 3 (state) on; utime is field 14, stime 15, starttime 22, vsize 23, rss 24.
    std::istringstream rest(stat.substr(name_end + 1));
    std::vector<std::string> fields;
    std::string f;
    while (rest >> f && fields.size() < 22) fields.push_back(f);
    if (fields.size() < 22) {
        return InvalidArgument("stat: " + std::to_string(fields.size() + 2) +
                               " fields, expected at least 24");
    }
    auto field = [&](int number) -> Result<double> {
        const std::string& text = fields[static_cast<size_t>(number - 3)];
        try {
            size_t used = 0;
            const double v = std::stod(text, &used);
            if (used == text.size()) return v;
        } catch (const std::exception&) {
        }
        return InvalidArgument("stat: field " + std::to_string(number) + " is not a number: '" +
                               text + "'");
    };
    ProcessStats s;
    KV_ASSIGN_OR_RETURN(double utime, field(14));
    KV_ASSIGN_OR_RETURN(double stime, field(15));
    KV_ASSIGN_OR_RETURN(double start_ticks, field(22));
    KV_ASSIGN_OR_RETURN(s.virtual_memory_bytes, field(23));
    KV_ASSIGN_OR_RETURN(double rss_pages, field(24));
    s.cpu_seconds = (utime + stime) / ticks_per_second;
    s.start_time_seconds = boot_time_seconds + start_ticks / ticks_per_second;
    s.resident_memory_bytes = rss_pages * page_size_bytes;
    return s;
}

Result<ProcessStats> ReadProcessStats() {
    KV_ASSIGN_OR_RETURN(std::string stat, ReadFile("/proc/self/stat"));
    KV_ASSIGN_OR_RETURN(std::string machine, ReadFile("/proc/stat"));
    double boot_time = 0;
    std::istringstream lines(machine);
    for (std::string line; std::getline(lines, line);) {
        if (line.rfind("btime ", 0) == 0) boot_time = std::strtod(line.c_str() + 6, nullptr);
    }
    if (boot_time <= 0) return Status(StatusCode::kUnavailable, "/proc/stat has no btime");
    const long ticks = sysconf(_SC_CLK_TCK);
    const long page = sysconf(_SC_PAGESIZE);
    if (ticks <= 0 || page <= 0) return Status(StatusCode::kUnavailable, "sysconf failed");
    KV_ASSIGN_OR_RETURN(ProcessStats s, ParseProcStat(stat, boot_time, static_cast<double>(ticks),
                                                      static_cast<double>(page)));
    std::error_code ec;
    int64_t fds = 0;
    for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
         it.increment(ec)) {
        fds++;
    }
    if (ec) return Status(StatusCode::kUnavailable, "cannot list /proc/self/fd");
    s.open_fds = static_cast<double>(fds);
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
        s.max_fds = limit.rlim_cur == RLIM_INFINITY ? 0 : static_cast<double>(limit.rlim_cur);
    }
    return s;
}

}  // namespace kvshard
