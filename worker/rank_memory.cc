#include "worker/rank_memory.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>

namespace kvshard {

std::string RankMemory::ToString() const {
    constexpr double kMiB = 1024.0 * 1024.0;
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "weights %.1f MiB, KV pool %.1f MiB, process RSS %.1f MiB (%.1f MiB anonymous, "
                  "%.1f MiB file-backed)",
                  static_cast<double>(weight_bytes) / kMiB,
                  static_cast<double>(kv_pool_bytes) / kMiB, static_cast<double>(rss_bytes) / kMiB,
                  static_cast<double>(rss_anonymous_bytes()) / kMiB,
                  static_cast<double>(rss_file_bytes) / kMiB);
    return buf;
}

RankMemory MeasureRankMemory(const ModelRunner& runner) {
    RankMemory m;
    m.weight_bytes = static_cast<int64_t>(runner.weight_bytes());
    m.kv_pool_bytes = runner.pool() != nullptr ? runner.pool()->num_bytes() : 0;
    std::ifstream statm("/proc/self/statm");
    int64_t size_pages = 0, resident_pages = 0, shared_pages = 0;
    if (statm >> size_pages >> resident_pages >> shared_pages) {
        const int64_t page = sysconf(_SC_PAGESIZE);
        m.rss_bytes = resident_pages * page;
        m.rss_file_bytes = shared_pages * page;
    }
    return m;
}

Result<std::vector<RankMemory>> GatherRankMemory(const RankMemory& mine, Collective* collective) {
    if (collective == nullptr) return std::vector<RankMemory>{mine};
    // Four int64 fields sent as the bits of eight floats (AllGather copies, never adds).
    constexpr int64_t kFields = 4;
    const int64_t mine_fields[kFields] = {mine.weight_bytes, mine.kv_pool_bytes, mine.rss_bytes,
                                          mine.rss_file_bytes};
    float send[2 * kFields];
    std::memcpy(send, mine_fields, sizeof(send));
    std::vector<float> recv(static_cast<size_t>(collective->size() * 2 * kFields));
    KV_RETURN_IF_ERROR(collective->AllGather(send, 2 * kFields, recv.data()));
    std::vector<RankMemory> all(static_cast<size_t>(collective->size()));
    for (size_t r = 0; r < all.size(); ++r) {
        int64_t f[kFields];
        std::memcpy(f, &recv[r * 2 * kFields], sizeof(f));
        all[r] = {
            .weight_bytes = f[0], .kv_pool_bytes = f[1], .rss_bytes = f[2], .rss_file_bytes = f[3]};
    }
    return all;
}

}  // namespace kvshard
