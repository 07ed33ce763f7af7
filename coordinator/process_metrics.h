// What the process uses, read from Linux's /proc, for the process_* metrics that Prometheus
// clients export (the names and units prometheus_client's process collector writes:
// process_resident_memory_bytes, process_virtual_memory_bytes, process_cpu_seconds_total,
// process_open_fds, process_max_fds, process_start_time_seconds).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvshard {

struct ProcessStats {
    double resident_memory_bytes = 0;
    double virtual_memory_bytes = 0;
    double cpu_seconds = 0;         // user + system
    double start_time_seconds = 0;  // since the Unix epoch
    double open_fds = 0;
    double max_fds = 0;  // the soft limit on open files
};

// Parses the text of /proc/<pid>/stat (utime, stime, starttime, vsize, rss) given the machine's
// boot time (`btime` of /proc/stat, Unix seconds), clock ticks per second and page size. The
// command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'.
// InvalidArgument naming what is missing when the text is not a stat line.
Result<ProcessStats> ParseProcStat(const std::string& stat, double boot_time_seconds,
                                   double ticks_per_second, double page_size_bytes);

// This process's stats now: /proc/self/stat, /proc/stat, /proc/self/fd and RLIMIT_NOFILE.
// Unavailable where there is no /proc (then no process_* metrics are written).
Result<ProcessStats> ReadProcessStats();

}  // namespace kvshard
