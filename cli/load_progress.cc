#include "cli/load_progress.h"

#include <algorithm>

#include "common/logging.h"

namespace kvshard::cli {

std::string Megabytes(int64_t bytes) { return std::to_string((bytes + 500'000) / 1'000'000); }

LoadProgress::LoadProgress(int64_t total_bytes, Clock::time_point start)
    : total_bytes_(total_bytes), start_(start), last_line_(start) {}

void LoadProgress::Add(int64_t bytes) {
    const int64_t done = done_bytes_.fetch_add(bytes) + bytes;
    if (total_bytes_ <= 0) return;
    const int percent = static_cast<int>(std::min<int64_t>(100, done * 100 / total_bytes_));
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    if (percent / 10 <= last_tenth_ || percent >= 100 || now - last_line_ < kMinInterval) return;
    last_tenth_ = percent / 10;
    last_line_ = now;
    spdlog::info("loading weights: {}% ({}/{} MB)", percent, Megabytes(done),
                 Megabytes(total_bytes_));
}

double LoadProgress::Finish() {
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    const int64_t done = done_bytes_.load();
    if (done > 0) {
        spdlog::info("model loaded in {:.2f} s ({} MB of weights)", seconds, Megabytes(done));
    } else {
        spdlog::info("model loaded in {:.2f} s", seconds);
    }
    return seconds;
}

}  // namespace kvshard::cli
