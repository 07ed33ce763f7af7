// kvshard_stream: a STREAM-like memory bandwidth probe (McCalpin's triad, a[i] = b[i] + s * c[i]
// over doubles), run with 1 thread and with every core, so a benchmark of a bandwidth-bound
// decode can print the ceiling its speedup could reach beside it.
//
//   kvshard_stream [--mib-per-array N] [--repeats N] [--json]
//
// Bytes per triad: 3 arrays × 8 bytes × n (STREAM's convention; the write-allocate read of `a`
// is not counted). Figures are the best of the repeats, as STREAM reports. Arrays are several
// times the last-level cache (default 512 MiB each) and first-touched by the threads that use
// them.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

double TriadGBps(double* a, const double* b, const double* c, int64_t n, int threads, int repeats) {
    const double scalar = 3.0;
    double best = 1e30;
    for (int rep = 0; rep < repeats; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t i = 0; i < n; ++i) a[i] = b[i] + scalar * c[i];
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, secs);
    }
    return 3.0 * 8.0 * static_cast<double>(n) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
    int64_t mib = 512;
    int repeats = 10;
    bool json = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--mib-per-array" && i + 1 < argc) {
            mib = std::atoll(argv[++i]);
        } else if (arg == "--repeats" && i + 1 < argc) {
            repeats = std::atoi(argv[++i]);
        } else if (arg == "--json") {
            json = true;
        } else {
            std::fprintf(stderr, "usage: %s [--mib-per-array N] [--repeats N] [--json]\n", argv[0]);
            return 2;
        }
    }
    if (mib <= 0 || repeats <= 0) {
        std::fprintf(stderr, "kvshard_stream: --mib-per-array and --repeats must be positive\n");
        return 2;
    }
    const int64_t n = mib * 1024 * 1024 / static_cast<int64_t>(sizeof(double));
    const int max_threads = omp_get_max_threads();
    std::unique_ptr<double[]> a(new double[static_cast<size_t>(n)]);
    std::unique_ptr<double[]> b(new double[static_cast<size_t>(n)]);
    std::unique_ptr<double[]> c(new double[static_cast<size_t>(n)]);
#pragma omp parallel for schedule(static) num_threads(max_threads)
    for (int64_t i = 0; i < n; ++i) {
        a[i] = 0.0;
        b[i] = 1.0;
        c[i] = 2.0;
    }
    std::vector<std::pair<int, double>> rows;
    for (int t : {1, max_threads}) {
        if (!rows.empty() && t == rows.back().first) break;
        TriadGBps(a.get(), b.get(), c.get(), n, t, 1);  // warm-up
        rows.emplace_back(t, TriadGBps(a.get(), b.get(), c.get(), n, t, repeats));
    }
    if (a[n / 2] != 7.0) {
        std::fprintf(stderr, "kvshard_stream: wrong triad result %g\n", a[n / 2]);
        return 1;
    }
    if (json) {
        std::printf("{\"mib_per_array\":%lld,\"repeats\":%d,\"triad_gb_per_s\":{",
                    static_cast<long long>(mib), repeats);
        for (size_t i = 0; i < rows.size(); ++i) {
            std::printf("%s\"%d\":%.2f", i ? "," : "", rows[i].first, rows[i].second);
        }
        std::printf("}}\n");
    } else {
        for (const auto& [t, gbps] : rows) {
            std::printf("triad %d thread%s: %7.2f GB/s\n", t, t == 1 ? " " : "s", gbps);
        }
        if (rows.size() == 2) {
            std::printf("ratio %d/1 threads: %.2f\n", rows[1].first,
                        rows[1].second / rows[0].second);
        }
    }
    return 0;
}
