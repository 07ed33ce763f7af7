// kvshard_kv_transfer_bench: bandwidth of a KV handoff (disaggregated prefill -> decode, DESIGN.md
// data flow step 6) beside the machine's memcpy bandwidth, the ceiling any path of the handoff
// could reach (issue 6, item 7).
//
//   kvshard_kv_transfer_bench [--layers 30] [--kv-heads 3] [--head-dim 64] [--block-size 16]
//                             [--dtype f32|int8] [--tokens 512,2048] [--runs 7] [--json]
//
// Defaults: the default model's KV geometry (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64)
// in fp32 pools of 16-slot blocks, and prompts of 512 and 2048 tokens. For each prompt size:
//   memcpy       one memcpy of a buffer the size of the whole transfer (both buffers touched
//                first); best and median of the runs: the reference;
//   pack+unpack  PackKvPiece from a source pool, UnpackKvPiece into a destination pool, no
//                transport;
//   local        the same through LocalKvTransport: a sender thread packs and Sends, the
//                receiving thread Receives every cell and unpacks (as worker/step_runner.cc does);
//   tcp          the same through TcpKvTransport over 127.0.0.1;
//   peer         the peer-copy handoff (kv_transfer.path: peer): QueueKvPeerCopies from the
//                source pool straight into the destination pool through the backend's PeerCopy
//                (the CPU's memcpy here; cudaMemcpyPeerAsync between GPUs), no piece.
// Each path runs blockwise (one piece of all layers) and layerwise (one piece per layer, as a
// prefill sends layer by layer). A transfer's bytes are KvPieceBytes summed over its pieces;
// GB/s = those bytes / seconds of one whole transfer (first pack to last unpack), 1 GB = 1e9 B.
// memcpy GB/s counts the bytes copied once (not read + write). Figures are medians of --runs
// after one warm-up run (which also opens the TCP connection and is checked byte for byte);
// ratios are to memcpy's median. Blocks are scattered through pools twice the transfer's size,
// and every pool is written before the first run, so no run pays for first-touch page faults of
// the pools (the receiver recycles the staged pieces' buffers, as the workers do).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "kernels/cpu_backend.h"
#include "worker/kv_handoff.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"

namespace kvshard {
namespace {
// The pools' memory comes from one CPU backend that outlives them.
Backend& CpuBackendInstance() {
    static CpuBackend backend{BackendConfig{}};
    return backend;
}
}  // namespace
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
    int64_t layers = 30;
    int64_t kv_heads = 3;
    int64_t head_dim = 64;
    int64_t block_size = 16;
    KvDtype storage = KvDtype::kFp32;
    std::vector<int64_t> tokens = {512, 2048};
    int runs = 7;
    bool json = false;
};

[[noreturn]] void Die(const std::string& what) {
    std::fprintf(stderr, "kvshard_kv_transfer_bench: %s\n", what.c_str());
    std::exit(1);
}

void CheckOk(const Status& st, const char* what) {
    if (!st.ok()) Die(std::string(what) + ": " + st.ToString());
}

double Seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One measured configuration: seconds of each timed run.
struct Row {
    std::string path;
    std::string mode;
    std::vector<double> seconds;
};

// Two pools of one geometry and the scattered block tables of one transfer between them.
struct Setup {
    std::unique_ptr<KvPool> src, dst;
    ShardLayout layout;  // one rank holding every KV head (tp 1 on both sides)
    std::vector<int32_t> src_blocks, dst_blocks;
    int64_t bytes = 0;  // of the whole transfer
    int64_t cells = 0;  // layers × heads: what Receive waits for
};

Setup MakeSetup(const Options& o, int64_t tokens) {
    Setup s;
    const int64_t blocks = (tokens + o.block_size - 1) / o.block_size;
    KvPoolConfig c{.num_blocks = 2 * blocks,
                   .block_size = o.block_size,
                   .num_layers = o.layers,
                   .num_kv_heads = o.kv_heads,
                   .head_dim = o.head_dim,
                   .storage = o.storage};
    Result<std::unique_ptr<KvPool>> src = KvPool::Create(c, CpuBackendInstance());
    CheckOk(src.status(), "source pool");
    Result<std::unique_ptr<KvPool>> dst = KvPool::Create(c, CpuBackendInstance());
    CheckOk(dst.status(), "destination pool");
    s.src = std::move(*src);
    s.dst = std::move(*dst);
    s.layout.kv_heads = {0, o.kv_heads};
    std::mt19937 rng(12345);
    for (int64_t b = 0; b < c.num_blocks; ++b) {
        uint8_t* p = s.src->MutableBlockData(b);
        for (int64_t i = 0; i < s.src->bytes_per_block(); ++i) p[i] = static_cast<uint8_t>(rng());
        std::memset(s.dst->MutableBlockData(b), 0, static_cast<size_t>(s.dst->bytes_per_block()));
    }
    std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    s.src_blocks.assign(ids.begin(), ids.begin() + blocks);
    std::shuffle(ids.begin(), ids.end(), rng);
    s.dst_blocks.assign(ids.begin(), ids.begin() + blocks);
    KvPieceHeader h{.layer_begin = 0,
                    .layer_end = static_cast<int32_t>(o.layers),
                    .head_begin = 0,
                    .head_end = static_cast<int32_t>(o.kv_heads),
                    .num_blocks = static_cast<int32_t>(blocks),
                    .block_size = static_cast<int32_t>(o.block_size),
                    .head_dim = static_cast<int32_t>(o.head_dim),
                    .dtype = o.storage};
    s.bytes = KvPieceBytes(h);
    s.cells = o.layers * o.kv_heads;
    return s;
}

// The destination's blocks hold what the source's held (the whole block: every layer and head).
void Verify(const Setup& s, const std::string& what) {
    for (size_t i = 0; i < s.src_blocks.size(); ++i) {
        if (std::memcmp(s.src->BlockData(s.src_blocks[i]), s.dst->BlockData(s.dst_blocks[i]),
                        static_cast<size_t>(s.src->bytes_per_block())) != 0) {
            Die(what + ": block " + std::to_string(i) + " arrived different");
        }
    }
}

void ClearDestination(Setup& s) {
    for (int32_t b : s.dst_blocks) {
        std::memset(s.dst->MutableBlockData(b), 0, static_cast<size_t>(s.dst->bytes_per_block()));
    }
}

// Layer ranges of the pieces of one transfer.
std::vector<std::pair<int64_t, int64_t>> Pieces(int64_t layers, bool layerwise) {
    std::vector<std::pair<int64_t, int64_t>> out;
    if (!layerwise) return {{0, layers}};
    for (int64_t l = 0; l < layers; ++l) out.emplace_back(l, l + 1);
    return out;
}

// Warm-up (checked), then `runs` timed runs of `one`, which returns one transfer's seconds.
Row Measure(const std::string& path, const std::string& mode, Setup& s, int runs,
            const std::function<double(uint64_t transfer_id)>& one) {
    static uint64_t next_transfer_id = 1;
    ClearDestination(s);
    one(next_transfer_id++);
    Verify(s, path + " " + mode);
    Row row{path, mode, {}};
    for (int r = 0; r < runs; ++r) row.seconds.push_back(one(next_transfer_id++));
    return row;
}

Row PackUnpack(Setup& s, const Options& o, bool layerwise, int runs) {
    const auto pieces = Pieces(o.layers, layerwise);
    KvPiece piece;  // reused, as a worker's StepRunner reuses its send buffer
    return Measure("pack+unpack", layerwise ? "layerwise" : "blockwise", s, runs, [&](uint64_t id) {
        const auto t0 = Clock::now();
        for (const auto& [lb, le] : pieces) {
            CheckOk(PackKvPiece(CpuBackendInstance(), *s.src, s.layout, id, s.src_blocks, lb, le,
                                s.layout.kv_heads, &piece),
                    "pack");
            CheckOk(UnpackKvPiece(CpuBackendInstance(), piece, *s.dst, s.layout, s.dst_blocks),
                    "unpack");
        }
        return Seconds(t0, Clock::now());
    });
}

Row PeerCopies(Setup& s, const Options& o, bool layerwise, int runs) {
    const auto pieces = Pieces(o.layers, layerwise);
    Backend& b = CpuBackendInstance();
    return Measure("peer", layerwise ? "layerwise" : "blockwise", s, runs, [&](uint64_t) {
        const auto t0 = Clock::now();
        for (const auto& [lb, le] : pieces) {
            CheckOk(QueueKvPeerCopies(b, *s.src, s.layout, s.src_blocks, b, *s.dst, s.layout,
                                      s.dst_blocks, lb, le, s.layout.kv_heads)
                        .status(),
                    "peer copy");
        }
        CheckOk(b.Synchronize(), "peer copy");
        return Seconds(t0, Clock::now());
    });
}

// A sender thread packs and Sends every piece; this thread Receives them all and unpacks, as a
// decode worker's step does. Timed from the sender's first pack to the last unpack.
Row ThroughTransport(const std::string& path, Setup& s, const Options& o, bool layerwise, int runs,
                     KvTransport& from, KvTransport& to) {
    const auto pieces = Pieces(o.layers, layerwise);
    const std::string dst = to.endpoint();
    KvPiece piece;  // reused, as a worker's StepRunner reuses its send buffer
    return Measure(path, layerwise ? "layerwise" : "blockwise", s, runs, [&](uint64_t id) {
        const auto deadline = Clock::now() + std::chrono::seconds(120);
        Clock::time_point t0;
        Status sent;
        std::thread sender([&] {
            t0 = Clock::now();
            for (const auto& [lb, le] : pieces) {
                sent = PackKvPiece(CpuBackendInstance(), *s.src, s.layout, id, s.src_blocks, lb,
                                   le, s.layout.kv_heads, &piece);
                if (!sent.ok()) return;
                sent = from.Send(dst, piece, deadline);
                if (!sent.ok()) return;
            }
        });
        Result<std::vector<KvPiece>> got = to.Receive(id, s.cells, deadline);
        if (got.ok()) {
            for (const KvPiece& piece : *got)
                CheckOk(UnpackKvPiece(CpuBackendInstance(), piece, *s.dst, s.layout,
                                      s.dst_blocks),
                        "unpack");
        }
        const auto t1 = Clock::now();
        if (got.ok()) to.Recycle(std::move(*got));  // as worker/step_runner.cc does
        sender.join();
        CheckOk(sent, (path + " Send").c_str());
        CheckOk(got.status(), (path + " Receive").c_str());
        return Seconds(t0, t1);
    });
}

// memcpy of the transfer's size between two touched buffers: best and median seconds.
std::pair<double, double> MemcpySeconds(int64_t bytes, int runs) {
    std::vector<uint8_t> a(static_cast<size_t>(bytes), 1), b(static_cast<size_t>(bytes), 2);
    std::memcpy(b.data(), a.data(), a.size());  // warm-up
    std::vector<double> secs;
    for (int r = 0; r < runs; ++r) {
        a[static_cast<size_t>(r) % a.size()] = static_cast<uint8_t>(r);
        const auto t0 = Clock::now();
        std::memcpy(b.data(), a.data(), a.size());
        secs.push_back(Seconds(t0, Clock::now()));
        if (b[static_cast<size_t>(r) % b.size()] != static_cast<uint8_t>(r))
            Die("memcpy went wrong");
    }
    return {*std::min_element(secs.begin(), secs.end()), Median(secs)};
}

bool ParseInt(const char* s, int64_t* out) {
    char* end = nullptr;
    const long long v = std::strtoll(s, &end, 10);
    if (end == s || *end != '\0' || v <= 0) return false;
    *out = v;
    return true;
}

int Usage(const char* argv0) {
    std::fprintf(stderr,
                 "usage: %s [--layers 30] [--kv-heads 3] [--head-dim 64] [--block-size 16] "
                 "[--dtype f32|int8] [--tokens 512,2048] [--runs 7] [--json]\n",
                 argv0);
    return 2;
}

int Main(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const bool has_value = i + 1 < argc;
        int64_t v = 0;
        if (arg == "--json") {
            o.json = true;
        } else if (!has_value) {
            return Usage(argv[0]);
        } else if (arg == "--dtype") {
            const std::string d = argv[++i];
            if (d == "f32")
                o.storage = KvDtype::kFp32;
            else if (d == "int8")
                o.storage = KvDtype::kInt8;
            else
                return Usage(argv[0]);
        } else if (arg == "--tokens") {
            o.tokens.clear();
            std::string list = argv[++i];
            size_t at = 0;
            while (at <= list.size()) {
                const size_t comma = std::min(list.find(',', at), list.size());
                if (!ParseInt(list.substr(at, comma - at).c_str(), &v)) return Usage(argv[0]);
                o.tokens.push_back(v);
                at = comma + 1;
            }
        } else if (!ParseInt(argv[++i], &v)) {
            return Usage(argv[0]);
        } else if (arg == "--layers") {
            o.layers = v;
        } else if (arg == "--kv-heads") {
            o.kv_heads = v;
        } else if (arg == "--head-dim") {
            o.head_dim = v;
        } else if (arg == "--block-size") {
            o.block_size = v;
        } else if (arg == "--runs") {
            o.runs = static_cast<int>(v);
        } else {
            return Usage(argv[0]);
        }
    }

    // Staging must hold one whole transfer.
    int64_t max_bytes = 0;
    std::vector<Setup> setups;
    for (int64_t t : o.tokens) {
        setups.push_back(MakeSetup(o, t));
        max_bytes = std::max(max_bytes, setups.back().bytes);
    }
    KvTransportOptions topt;
    topt.max_staged_bytes = std::max<int64_t>(topt.max_staged_bytes, 2 * max_bytes);
    const std::string tag = std::to_string(getpid());
    Result<std::unique_ptr<KvTransport>> local_src =
        MakeLocalKvTransport("xferbench-src-" + tag, topt);
    CheckOk(local_src.status(), "local transport");
    Result<std::unique_ptr<KvTransport>> local_dst =
        MakeLocalKvTransport("xferbench-dst-" + tag, topt);
    CheckOk(local_dst.status(), "local transport");
    Result<std::unique_ptr<KvTransport>> tcp_src = MakeTcpKvTransport("127.0.0.1", 0, topt);
    CheckOk(tcp_src.status(), "tcp transport");
    Result<std::unique_ptr<KvTransport>> tcp_dst = MakeTcpKvTransport("127.0.0.1", 0, topt);
    CheckOk(tcp_dst.status(), "tcp transport");

    const char* dtype = o.storage == KvDtype::kFp32 ? "f32" : "int8";
    if (o.json) {
        std::printf(
            "{\"layers\":%lld,\"kv_heads\":%lld,\"head_dim\":%lld,\"block_size\":%lld,"
            "\"dtype\":\"%s\",\"runs\":%d,\"hardware_threads\":%u,\"results\":[",
            (long long)o.layers, (long long)o.kv_heads, (long long)o.head_dim,
            (long long)o.block_size, dtype, o.runs, std::thread::hardware_concurrency());
    } else {
        std::printf(
            "KV handoff: %lld layers x %lld KV heads x head_dim %lld, %s, block_size %lld; "
            "%u hardware threads; medians of %d runs after 1 warm-up; ratios to memcpy's "
            "median\n",
            (long long)o.layers, (long long)o.kv_heads, (long long)o.head_dim, dtype,
            (long long)o.block_size, std::thread::hardware_concurrency(), o.runs);
        std::printf("%6s %6s %8s  %-12s %-10s %9s %10s %11s\n", "tokens", "blocks", "MB", "path",
                    "mode", "GB/s", "vs memcpy", "latency ms");
    }
    for (size_t i = 0; i < setups.size(); ++i) {
        Setup& s = setups[i];
        const auto [best, median] = MemcpySeconds(s.bytes, o.runs);
        std::vector<Row> rows;
        for (bool layerwise : {false, true}) rows.push_back(PackUnpack(s, o, layerwise, o.runs));
        for (bool layerwise : {false, true}) rows.push_back(PeerCopies(s, o, layerwise, o.runs));
        for (bool layerwise : {false, true}) {
            rows.push_back(
                ThroughTransport("local", s, o, layerwise, o.runs, **local_src, **local_dst));
        }
        for (bool layerwise : {false, true}) {
            rows.push_back(ThroughTransport("tcp", s, o, layerwise, o.runs, **tcp_src, **tcp_dst));
        }
        const double gb = static_cast<double>(s.bytes) / 1e9;
        const double memcpy_gbps = gb / median;
        const int64_t tokens = o.tokens[i];
        const auto blocks = static_cast<long long>(s.src_blocks.size());
        if (o.json) {
            std::printf(
                "%s{\"tokens\":%lld,\"blocks\":%lld,\"bytes\":%lld,"
                "\"memcpy\":{\"best_gb_per_s\":%.3f,\"median_gb_per_s\":%.3f,"
                "\"median_ms\":%.4f},\"rows\":[",
                i ? "," : "", (long long)tokens, blocks, (long long)s.bytes, gb / best, memcpy_gbps,
                median * 1e3);
            for (size_t r = 0; r < rows.size(); ++r) {
                const double m = Median(rows[r].seconds);
                std::printf(
                    "%s{\"path\":\"%s\",\"mode\":\"%s\",\"gb_per_s\":%.3f,\"vs_memcpy\":%.4f,"
                    "\"latency_ms\":%.4f,\"runs_ms\":[",
                    r ? "," : "", rows[r].path.c_str(), rows[r].mode.c_str(), gb / m,
                    (gb / m) / memcpy_gbps, m * 1e3);
                for (size_t k = 0; k < rows[r].seconds.size(); ++k) {
                    std::printf("%s%.4f", k ? "," : "", rows[r].seconds[k] * 1e3);
                }
                std::printf("]}");
            }
            std::printf("]}");
        } else {
            const double mb = static_cast<double>(s.bytes) / 1e6;
            std::printf("%6lld %6lld %8.2f  %-12s %-10s %9.2f %10.2f %11.3f\n", (long long)tokens,
                        blocks, mb, "memcpy", "best", gb / best,
                        memcpy_gbps > 0 ? (gb / best) / memcpy_gbps : 0.0, best * 1e3);
            std::printf("%6lld %6lld %8.2f  %-12s %-10s %9.2f %10.2f %11.3f\n", (long long)tokens,
                        blocks, mb, "memcpy", "median", memcpy_gbps, 1.0, median * 1e3);
            for (const Row& r : rows) {
                const double m = Median(r.seconds);
                std::printf("%6lld %6lld %8.2f  %-12s %-10s %9.2f %10.2f %11.3f\n",
                            (long long)tokens, blocks, mb, r.path.c_str(), r.mode.c_str(), gb / m,
                            (gb / m) / memcpy_gbps, m * 1e3);
            }
        }
    }
    if (o.json) std::printf("]}\n");
    return 0;
}

}  // namespace
}  // namespace kvshard

int main(int argc, char** argv) { return kvshard::Main(argc, argv); }
