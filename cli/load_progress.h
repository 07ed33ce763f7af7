// LoadProgress: the "loading weights: 45% (44/98 MB)" lines `kvshard serve` logs while its
// embedded workers read their weights, and the "model loaded in 1.23 s" line at the end.
//
// Thread-safety: Add may be called from every loading rank's thread at once; the rest from the
// thread that owns the object.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace kvshard::cli {

class LoadProgress {
  public:
    // `total_bytes`: what every rank together will load (0: unknown; no percentages are shown).
    // `start`: when the load began (the model file's opening).
    LoadProgress(int64_t total_bytes, std::chrono::steady_clock::time_point start);

    // `bytes` more are loaded. Logs a line when the load has crossed another tenth of the total
    // and at least kMinInterval has passed since the last line, so a slow load shows it moves
    // and a fast one stays quiet.
    void Add(int64_t bytes);
    // Logs "model loaded in S s" (with the bytes loaded) and returns the seconds since `start`.
    double Finish();

    static constexpr std::chrono::milliseconds kMinInterval{500};

  private:
    using Clock = std::chrono::steady_clock;
    const int64_t total_bytes_;
    const Clock::time_point start_;
    std::atomic<int64_t> done_bytes_{0};
    std::mutex mu_;
    int last_tenth_ = 0;           // GUARDED_BY(mu_)
    Clock::time_point last_line_;  // GUARDED_BY(mu_)
};

// "44" MB (10^6 bytes), as the lines print sizes.
std::string Megabytes(int64_t bytes);

}  // namespace kvshard::cli
