// kvshard_kv_transport_bench: each KV transport's bandwidth against its ceiling, for the pieces
// the engine sends (issue 16, part 6; scripts/bench-kv-transfer runs it).
//
//   kvshard_kv_transport_bench [--layers 30] [--kv-heads 3] [--head-dim 64] [--block-size 16]
//                              [--tokens 512,2048] [--runs 7] [--paths local,shm,tcp] [--sync]
//
// Defaults: the default model's fp32 KV (30 layers x 3 KV heads x head_dim 64: 46 KB a token) for
// prompts of 512 and 2048 tokens, blockwise (one piece of every layer) and layerwise (one piece
// per layer). For each size:
//   memcpy       one memcpy of the transfer's bytes between touched buffers: the ceiling of the
//                in-process and shared-memory paths;
//   socket       a plain loopback TCP copy of the same bytes (one write, reads into a touched
//                buffer) to a child process: the ceiling of the TCP path;
//   local        LocalKvTransport: Send of every piece, then Receive (this process);
//   shm          TcpKvTransport to a child process on this host: payloads through the shared
//                region (shared_memory on);
//   tcp          the same with shared_memory off on the sender: payloads over the socket.
// The sender sends every piece with SendPipelined and then Flushes the transfer, as a sending
// worker does (--sync: Send of every piece, each waiting for its verdict, as before pipelining).
// A run is timed from the first Send to the receiver's Receive returning every piece (the child
// reports its steady_clock, the same clock across processes); the receiver then recycles the
// buffers, as a decode worker does. Figures are medians of --runs after one warm-up run (checked
// byte for byte); 1 GB = 1e9 B. The machine may be shared: medians, not best runs.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on

#include "comm/kv_transport.h"

namespace kvshard {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

struct Options {
    int64_t layers = 30, kv_heads = 3, head_dim = 64, block_size = 16;
    std::vector<int64_t> tokens = {512, 2048};
    int runs = 7;
    // The transports measured (memcpy and socket, their ceilings, always are).
    bool local = true, shm = true, tcp = true;
    // Send of every piece, each waiting for its verdict (as before pipelining), instead of
    // SendPipelined of every piece and one Flush, as a sending worker does.
    bool sync = false;
};

[[noreturn]] void Die(const std::string& what) {
    std::fprintf(stderr, "kvshard_kv_transport_bench: %s\n", what.c_str());
    std::exit(1);
}
void CheckOk(const Status& st, const std::string& what) {
    if (!st.ok()) Die(what + ": " + st.ToString());
}

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
}

// The pieces of one transfer: every layer in one, or one per layer.
std::vector<KvPiece> MakePieces(const Options& o, int64_t tokens, bool layerwise, uint32_t seed) {
    const int64_t blocks = (tokens + o.block_size - 1) / o.block_size;
    std::vector<KvPiece> out;
    const int64_t step = layerwise ? 1 : o.layers;
    std::mt19937 rng(seed);
    for (int64_t l = 0; l < o.layers; l += step) {
        KvPiece p;
        p.header = {.transfer_id = 0,
                    .layer_begin = static_cast<int32_t>(l),
                    .layer_end = static_cast<int32_t>(l + step),
                    .head_begin = 0,
                    .head_end = static_cast<int32_t>(o.kv_heads),
                    .num_blocks = static_cast<int32_t>(blocks),
                    .block_size = static_cast<int32_t>(o.block_size),
                    .head_dim = static_cast<int32_t>(o.head_dim),
                    .dtype = KvDtype::kFp32};
        p.data.resize(static_cast<size_t>(KvPieceBytes(p.header)));
        for (size_t i = 0; i < p.data.size(); i += 4) {
            const uint32_t r = rng();
            std::memcpy(p.data.data() + i, &r, std::min<size_t>(4, p.data.size() - i));
        }
        out.push_back(std::move(p));
    }
    return out;
}

// ---- the child: receiving transport and plain socket copy ----

// Commands on the child's pipe: {kind, transfer_id, cells or bytes, checksum wanted}.
struct Command {
    int64_t kind;  // 0 stop, 1 receive a transfer, 2 read `amount` bytes off the socket
    uint64_t transfer_id;
    int64_t amount;
};
struct Reply {
    int64_t done_ns;
    uint64_t checksum;  // a sum over the received bytes (warm-up runs check it)
};

void ReadAll(int fd, void* p, size_t n) {
    auto* at = static_cast<uint8_t*>(p);
    while (n > 0) {
        const ssize_t got = ::read(fd, at, n);
        if (got <= 0) Die("pipe/socket read failed");
        at += got;
        n -= static_cast<size_t>(got);
    }
}
void WriteAll(int fd, const void* p, size_t n) {
    const auto* at = static_cast<const uint8_t*>(p);
    while (n > 0) {
        const ssize_t put = ::write(fd, at, n);
        if (put <= 0) Die("pipe/socket write failed");
        at += put;
        n -= static_cast<size_t>(put);
    }
}

uint64_t Checksum(const uint8_t* p, size_t n) {
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i += 4096) sum = sum * 31 + p[i];
    return sum + n;
}

[[noreturn]] void Child(int commands, int replies, int64_t max_bytes) {
    KvTransportOptions options;
    options.max_staged_bytes = std::max<int64_t>(options.max_staged_bytes, 2 * max_bytes);
    Result<std::unique_ptr<KvTransport>> r = MakeTcpKvTransport("127.0.0.1", 0, options);
    CheckOk(r.status(), "child transport");
    asio::io_context io;
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    char endpoint[128] = {};
    std::snprintf(endpoint, sizeof(endpoint), "%s %u", (*r)->endpoint().c_str(),
                  static_cast<unsigned>(acceptor.local_endpoint().port()));
    WriteAll(replies, endpoint, sizeof(endpoint));
    tcp::socket socket(io);
    acceptor.accept(socket);
    std::vector<uint8_t> sink(static_cast<size_t>(max_bytes), 1);  // touched
    for (;;) {
        Command c{};
        // The parent gone (e.g. its output piped into head): leave quietly.
        if (::read(commands, &c, sizeof(c)) != static_cast<ssize_t>(sizeof(c))) std::_Exit(0);
        Reply reply{};
        if (c.kind == 0) std::_Exit(0);
        if (c.kind == 1) {
            Result<std::vector<KvPiece>> got =
                (*r)->Receive(c.transfer_id, c.amount, Clock::now() + std::chrono::seconds(120));
            reply.done_ns = NowNs();
            CheckOk(got.status(), "child Receive");
            for (const KvPiece& p : *got) {
                reply.checksum +=
                    Checksum(p.data.data(), p.data.size()) * (p.header.layer_begin + 1);
            }
            (*r)->Recycle(std::move(*got));
        } else {
            boost::system::error_code ec;
            asio::read(socket, asio::buffer(sink.data(), static_cast<size_t>(c.amount)), ec);
            reply.done_ns = NowNs();
            if (ec) Die("child socket read: " + ec.message());
            reply.checksum = Checksum(sink.data(), static_cast<size_t>(c.amount));
        }
        WriteAll(replies, &reply, sizeof(reply));
    }
}

struct ChildProcess {
    pid_t pid = -1;
    int commands = -1, replies = -1;
    std::string kv_endpoint;
    uint16_t socket_port = 0;
};

ChildProcess StartChild(int64_t max_bytes) {
    int to_child[2], from_child[2];
    if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) Die("pipe");
    const pid_t pid = ::fork();
    if (pid < 0) Die("fork");
    if (pid == 0) {
        ::close(to_child[1]);
        ::close(from_child[0]);
        Child(to_child[0], from_child[1], max_bytes);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    ChildProcess c{pid, to_child[1], from_child[0], "", 0};
    char endpoint[128] = {};
    ReadAll(c.replies, endpoint, sizeof(endpoint));
    const std::string text(endpoint);
    c.kv_endpoint = text.substr(0, text.find(' '));
    c.socket_port = static_cast<uint16_t>(std::stoi(text.substr(text.find(' ') + 1)));
    return c;
}

uint64_t ExpectedChecksum(const std::vector<KvPiece>& pieces) {
    uint64_t sum = 0;
    for (const KvPiece& p : pieces)
        sum += Checksum(p.data.data(), p.data.size()) * (p.header.layer_begin + 1);
    return sum;
}

struct Row {
    std::string path, mode, ceiling;
    double seconds = 0;    // median
    double ceiling_s = 0;  // the ceiling's median for the same bytes
};

// Warm-up (checked), then `runs` timed runs; the median seconds.
template <typename One>
double Measure(int runs, const std::string& what, One&& one) {
    uint64_t got = 0, want = 0;
    one(&got, &want);
    if (got != want) Die(what + ": warm-up run arrived different");
    std::vector<double> s;
    for (int r = 0; r < runs; ++r) s.push_back(one(&got, &want));
    return Median(s);
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
                 "[--tokens 512,2048] [--runs 7] [--paths local,shm,tcp] [--sync]\n",
                 argv0);
    return 2;
}

int Main(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        int64_t v = 0;
        if (arg == "--sync") {
            o.sync = true;
            continue;
        }
        if (i + 1 >= argc) return Usage(argv[0]);
        if (arg == "--tokens") {
            o.tokens.clear();
            const std::string list = argv[++i];
            size_t at = 0;
            while (at <= list.size()) {
                const size_t comma = std::min(list.find(',', at), list.size());
                if (!ParseInt(list.substr(at, comma - at).c_str(), &v)) return Usage(argv[0]);
                o.tokens.push_back(v);
                at = comma + 1;
            }
            continue;
        }
        if (arg == "--paths") {
            const std::string list = std::string(",") + argv[++i] + ",";
            o.local = list.find(",local,") != std::string::npos;
            o.shm = list.find(",shm,") != std::string::npos;
            o.tcp = list.find(",tcp,") != std::string::npos;
            if (!o.local && !o.shm && !o.tcp) return Usage(argv[0]);
            continue;
        }
        if (!ParseInt(argv[++i], &v)) return Usage(argv[0]);
        if (arg == "--layers")
            o.layers = v;
        else if (arg == "--kv-heads")
            o.kv_heads = v;
        else if (arg == "--head-dim")
            o.head_dim = v;
        else if (arg == "--block-size")
            o.block_size = v;
        else if (arg == "--runs")
            o.runs = static_cast<int>(v);
        else
            return Usage(argv[0]);
    }
    int64_t max_bytes = 0;
    for (int64_t t : o.tokens) {
        max_bytes = std::max(max_bytes, 2 * o.layers * o.kv_heads * o.head_dim * 4 *
                                            ((t + o.block_size - 1) / o.block_size) * o.block_size);
    }
    // Fork before any thread exists in this process.
    ChildProcess child = StartChild(max_bytes);

    KvTransportOptions topt;
    topt.max_staged_bytes = std::max<int64_t>(topt.max_staged_bytes, 2 * max_bytes);
    const std::string tag = std::to_string(::getpid());
    Result<std::unique_ptr<KvTransport>> local_src = MakeLocalKvTransport("bench-src-" + tag, topt);
    Result<std::unique_ptr<KvTransport>> local_dst = MakeLocalKvTransport("bench-dst-" + tag, topt);
    CheckOk(local_src.status(), "local transport");
    CheckOk(local_dst.status(), "local transport");
    Result<std::unique_ptr<KvTransport>> shm_src = MakeTcpKvTransport("127.0.0.1", 0, topt);
    KvTransportOptions no_shm = topt;
    no_shm.shared_memory = false;
    Result<std::unique_ptr<KvTransport>> tcp_src = MakeTcpKvTransport("127.0.0.1", 0, no_shm);
    CheckOk(shm_src.status(), "shm transport");
    CheckOk(tcp_src.status(), "tcp transport");
    asio::io_context io;
    tcp::socket plain(io);
    plain.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), child.socket_port));

    std::printf(
        "KV transports: %lld layers x %lld KV heads x head_dim %lld, f32, block_size %lld; %u "
        "hardware threads; medians of %d runs after 1 warm-up; receiver in a child process for "
        "socket/shm/tcp; %s\n",
        (long long)o.layers, (long long)o.kv_heads, (long long)o.head_dim, (long long)o.block_size,
        std::thread::hardware_concurrency(), o.runs,
        o.sync ? "Send per piece (--sync)" : "SendPipelined per piece, one Flush");
    std::printf("%6s %8s %9s  %-7s %-10s %8s %8s  %-7s %8s\n", "tokens", "MB", "piece MB", "path",
                "mode", "GB/s", "ms", "ceiling", "ratio");
    uint64_t next_id = 1;
    for (int64_t tokens : o.tokens) {
        for (bool layerwise : {false, true}) {
            std::vector<KvPiece> pieces = MakePieces(o, tokens, layerwise, 7);
            int64_t bytes = 0;
            for (const KvPiece& p : pieces) bytes += static_cast<int64_t>(p.data.size());
            const int64_t cells = o.layers * o.kv_heads;
            const uint64_t want_sum = ExpectedChecksum(pieces);

            std::vector<uint8_t> a(static_cast<size_t>(bytes), 1), b(static_cast<size_t>(bytes), 2);
            const double memcpy_s = Measure(o.runs, "memcpy", [&](uint64_t* got, uint64_t* want) {
                const auto t0 = Clock::now();
                std::memcpy(b.data(), a.data(), a.size());
                const double s = std::chrono::duration<double>(Clock::now() - t0).count();
                *got = *want = b[b.size() / 2];
                return s;
            });
            const double socket_s = Measure(o.runs, "socket", [&](uint64_t* got, uint64_t* want) {
                const Command c{2, 0, bytes};
                WriteAll(child.commands, &c, sizeof(c));
                const int64_t t0 = NowNs();
                asio::write(plain, asio::buffer(a));
                Reply reply{};
                ReadAll(child.replies, &reply, sizeof(reply));
                *got = reply.checksum;
                *want = Checksum(a.data(), a.size());
                return (reply.done_ns - t0) * 1e-9;
            });
            const auto local = [&](uint64_t* got, uint64_t* want) {
                const uint64_t id = next_id++;
                for (KvPiece& p : pieces) p.header.transfer_id = id;
                const auto t0 = Clock::now();
                const auto deadline = Clock::now() + std::chrono::seconds(60);
                const std::string& dst = (*local_dst)->endpoint();
                for (const KvPiece& p : pieces) {
                    CheckOk(o.sync ? (*local_src)->Send(dst, p, deadline)
                                   : (*local_src)->SendPipelined(dst, p, deadline),
                            "local Send");
                }
                if (!o.sync) CheckOk((*local_src)->Flush(dst, id, deadline), "local Flush");
                Result<std::vector<KvPiece>> r =
                    (*local_dst)->Receive(id, cells, Clock::now() + std::chrono::seconds(60));
                const double s = std::chrono::duration<double>(Clock::now() - t0).count();
                CheckOk(r.status(), "local Receive");
                *got = ExpectedChecksum(*r);
                *want = want_sum;
                (*local_dst)->Recycle(std::move(*r));
                return s;
            };
            const auto remote = [&](KvTransport& from) {
                return [&](uint64_t* got, uint64_t* want) {
                    const uint64_t id = next_id++;
                    for (KvPiece& p : pieces) p.header.transfer_id = id;
                    const Command c{1, id, cells};
                    WriteAll(child.commands, &c, sizeof(c));
                    const int64_t t0 = NowNs();
                    const auto deadline = Clock::now() + std::chrono::seconds(60);
                    if (o.sync) {
                        for (const KvPiece& p : pieces)
                            CheckOk(from.Send(child.kv_endpoint, p, deadline), "Send");
                    } else {
                        for (const KvPiece& p : pieces)
                            CheckOk(from.SendPipelined(child.kv_endpoint, p, deadline),
                                    "SendPipelined");
                        CheckOk(from.Flush(child.kv_endpoint, id, deadline), "Flush");
                    }
                    Reply reply{};
                    ReadAll(child.replies, &reply, sizeof(reply));
                    *got = reply.checksum;
                    *want = want_sum;
                    return (reply.done_ns - t0) * 1e-9;
                };
            };
            std::vector<Row> rows;
            const char* mode = layerwise ? "layerwise" : "blockwise";
            rows.push_back({"memcpy", mode, "memcpy", memcpy_s, memcpy_s});
            rows.push_back({"socket", mode, "socket", socket_s, socket_s});
            if (o.local) {
                rows.push_back(
                    {"local", mode, "memcpy", Measure(o.runs, "local", local), memcpy_s});
            }
            if (o.shm) {
                rows.push_back(
                    {"shm", mode, "memcpy", Measure(o.runs, "shm", remote(**shm_src)), memcpy_s});
            }
            if (o.tcp) {
                rows.push_back(
                    {"tcp", mode, "socket", Measure(o.runs, "tcp", remote(**tcp_src)), socket_s});
            }
            const double gb = static_cast<double>(bytes) / 1e9;
            for (const Row& r : rows) {
                std::printf("%6lld %8.2f %9.2f  %-7s %-10s %8.2f %8.3f  %-7s %8.2f\n",
                            (long long)tokens, bytes / 1e6,
                            static_cast<double>(pieces[0].data.size()) / 1e6, r.path.c_str(),
                            r.mode.c_str(), gb / r.seconds, r.seconds * 1e3, r.ceiling.c_str(),
                            r.ceiling_s / r.seconds);
            }
            std::fflush(stdout);
        }
    }
    const Command stop{0, 0, 0};
    WriteAll(child.commands, &stop, sizeof(stop));
    int status = 0;
    ::waitpid(child.pid, &status, 0);
    return 0;
}

}  // namespace
}  // namespace kvshard

int main(int argc, char** argv) { return kvshard::Main(argc, argv); }
