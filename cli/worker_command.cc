// `kvshard worker`: one worker process of process mode — one rank of one instance, registering
// with the coordinator at --coordinator and running the steps it sends (worker/worker_service.h).
// Under mpirun (`mpirun -np N kvshard worker ...`) rank and tp come from MPI and the ranks
// all-reduce over MPI. Otherwise the rank is --rank, else LWS_WORKER_INDEX (a LeaderWorkerSet
// pod's index), else whichever the coordinator assigns (the lowest free one); the tp is the
// coordinator's (--tp, when given, must agree), and the ranks of a tp > 1 instance meet through
// the coordinator and all-reduce over Gloo (TCP pairs on --collective-host, or the interface of
// --collective-iface or GLOO_SOCKET_IFNAME). The registry's token comes from the environment
// (KVSHARD_WORKER_TOKEN, which is how the coordinator's launcher passes it) or --token-file,
// never from the command line, which every local user can read.
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "cli/commands.h"
#include "comm/collective.h"
#include "comm/control_messages.h"
#include "comm/mpi_runtime.h"
#include "common/host_port.h"
#include "common/logging.h"
#include "worker/worker_service.h"

namespace kvshard::cli {
namespace {

struct WorkerFlags {
    std::string coordinator;
    std::string instance;
    int rank = -1;
    int tp = 0;
    std::string model;
    std::string kv_host = "127.0.0.1";
    std::string collective_host;  // "": kv_host
    std::string collective_iface;
    int threads = 0;
    int64_t heartbeat_ms = 1'000;
    int64_t dead_after_ms = 5'000;
    int64_t connect_timeout_ms = 60'000;
    int64_t collective_timeout_ms = 60'000;
    std::string log_level = "info";
    std::string token_file;
};

// The token: --token-file's first line if given, else KVSHARD_WORKER_TOKEN.
Result<std::string> ReadToken(const WorkerFlags& f) {
    if (!f.token_file.empty()) {
        std::ifstream in(f.token_file);
        if (!in) return InvalidArgument("--token-file: cannot read '" + f.token_file + "'");
        std::string token;
        std::getline(in, token);
        while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
        if (token.empty()) return InvalidArgument("--token-file: '" + f.token_file + "' is empty");
        return token;
    }
    const char* env = std::getenv("KVSHARD_WORKER_TOKEN");
    return std::string(env != nullptr ? env : "");
}

// The LeaderWorkerSet pod index (LWS_WORKER_INDEX), or kAnyRank when not set.
Result<int> RankFromEnvironment() {
    const char* env = std::getenv("LWS_WORKER_INDEX");
    if (env == nullptr || *env == '\0') return kAnyRank;
    const std::string text = env;
    int rank = -1;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), rank);
    if (ec != std::errc() || ptr != text.data() + text.size() || rank < 0) {
        return InvalidArgument("LWS_WORKER_INDEX: '" + text + "' is not a rank (an integer >= 0)");
    }
    return rank;
}

int RunWorker(const WorkerFlags& f) {
    Result<HostPort> address = ParseHostPort(f.coordinator);
    if (!address.ok()) return Fail(address.status().WithContext("--coordinator").message());

    Result<std::string> token = ReadToken(f);
    if (!token.ok()) return Fail(token.status().message());

    WorkerServiceOptions o;
    o.token = std::move(*token);
    o.coordinator_host = address->host;
    o.coordinator_port = address->port;
    o.instance_id = f.instance;
    o.kv_host = f.kv_host;
    o.model = f.model;
    o.collective_host = f.collective_host.empty() ? f.kv_host : f.collective_host;
    o.collective_iface = f.collective_iface;
    o.collective_timeout_ms = f.collective_timeout_ms;
    o.threads = f.threads;
    o.connect_timeout_ms = f.connect_timeout_ms;
    o.channel.heartbeat_interval_ms = f.heartbeat_ms;
    o.channel.dead_after_ms = f.dead_after_ms;

    std::unique_ptr<MpiRuntime> mpi;
    std::unique_ptr<Collective> collective;
    if (MpiRuntime::LaunchedByMpirun()) {
        Result<std::unique_ptr<MpiRuntime>> m = MpiRuntime::Init();
        if (!m.ok()) return Fail("worker under mpirun: " + m.status().message());
        mpi = std::move(*m);
        o.rank = mpi->world_rank();
        o.tp = mpi->world_size();
        if ((f.tp > 0 && f.tp != o.tp) || (f.rank >= 0 && f.rank != o.rank)) {
            return Fail("--rank/--tp " + std::to_string(f.rank) + "/" + std::to_string(f.tp) +
                        " disagree with mpirun's rank " + std::to_string(o.rank) + " of " +
                        std::to_string(o.tp) + " (leave them out under mpirun)");
        }
        if (o.tp > 1) {
            CollectiveConfig cc;
            cc.kind = CollectiveConfig::Kind::kMpi;
            cc.timeout_ms = f.collective_timeout_ms;
            Result<std::unique_ptr<Collective>> c = MakeCollective(cc);
            if (!c.ok()) return Fail("worker under mpirun: " + c.status().message());
            collective = std::move(*c);
        }
    } else {
        // The coordinator checks the rank against its tp, and assigns one when none is given.
        o.tp = f.tp > 0 ? f.tp : kAnyTp;
        if (f.rank >= 0) {
            o.rank = f.rank;
        } else {
            Result<int> rank = RankFromEnvironment();
            if (!rank.ok()) return Fail(rank.status().message());
            o.rank = *rank;
        }
        if (o.tp != kAnyTp && o.rank >= o.tp) {
            return Fail("--rank " + std::to_string(o.rank) + " must be < --tp " +
                        std::to_string(o.tp));
        }
    }
    o.collective = collective.get();
    InitLogging("worker " + o.instance_id + " r" +
                    (o.rank == kAnyRank ? std::string("?") : std::to_string(o.rank)),
                f.log_level);
    const Status status = RunWorkerService(o);
    if (!status.ok()) {
        Fail(status.message());
        return 2;
    }
    return 0;
}

}  // namespace

Command RegisterWorker(CLI::App& app) {
    auto f = std::make_shared<WorkerFlags>();
    CLI::App* sub = app.add_subcommand(
        "worker", "Run one worker rank of an instance for a coordinator (process mode)");
    sub->add_option("--coordinator", f->coordinator, "HOST:PORT of the coordinator's workers port")
        ->required();
    sub->add_option("--instance", f->instance, "Id of the instance this worker belongs to")
        ->required();
    sub->add_option("--rank", f->rank,
                    "Rank within the instance (default: LWS_WORKER_INDEX if set, else the lowest "
                    "free rank the coordinator assigns; from MPI under mpirun)")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--tp", f->tp,
                    "The instance's tensor-parallel size, checked against the coordinator's "
                    "(default: the coordinator's; from MPI under mpirun)")
        ->check(CLI::PositiveNumber);
    sub->add_option("--model", f->model,
                    "The model this worker expects (a path, or a file name matching the last "
                    "part of the coordinator's model path); refused if the instance serves "
                    "another (default: whatever the coordinator serves)");
    sub->add_option("--kv-host", f->kv_host, "Address this rank's KV transport listens on")
        ->capture_default_str();
    sub->add_option("--collective-host", f->collective_host,
                    "Address the Gloo collective's TCP pairs listen on, reachable by the other "
                    "ranks (default: --kv-host)");
    sub->add_option("--collective-iface", f->collective_iface,
                    "Network interface whose address the Gloo pairs use instead (default: "
                    "GLOO_SOCKET_IFNAME if set)");
    sub->add_option("--threads", f->threads, "CPU threads (0: the coordinator's setting)")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--heartbeat-ms", f->heartbeat_ms, "Heartbeat interval")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--dead-after-ms", f->dead_after_ms,
                    "The coordinator is dead after this long without a frame")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--connect-timeout-ms", f->connect_timeout_ms,
                    "How long to keep trying to reach the coordinator")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--collective-timeout-ms", f->collective_timeout_ms,
                    "Longest wait for the other ranks: an MPI or Gloo collective, and the Gloo "
                    "ranks' rendezvous")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--log-level", f->log_level, "trace|debug|info|warn|error|off")
        ->capture_default_str();
    sub->add_option("--token-file", f->token_file,
                    "File whose first line is the coordinator's workers.token (default: the "
                    "KVSHARD_WORKER_TOKEN environment variable)");
    return [f] { return RunWorker(*f); };
}

}  // namespace kvshard::cli
