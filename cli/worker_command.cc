// `kvshard worker`: one worker process of process mode — one rank of one instance, registering
// with the coordinator at --coordinator and running the steps it sends (worker/worker_service.h).
// Under mpirun (`mpirun -np N kvshard worker ...`) rank and tp come from MPI and the ranks
// all-reduce over MPI; otherwise --rank/--tp say them (tp 1 only: no collective between
// independent processes). The registry's token comes from the environment
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
#include "comm/mpi_runtime.h"
#include "common/logging.h"
#include "worker/worker_service.h"

namespace kvshard::cli {
namespace {

struct WorkerFlags {
    std::string coordinator;
    std::string instance;
    int rank = -1;
    int tp = 0;
    std::string kv_host = "127.0.0.1";
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

// "HOST:PORT" (the last colon splits, so "[::1]:9000"-style hosts keep their colons).
Result<std::pair<std::string, uint16_t>> ParseHostPort(const std::string& text) {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) {
        return InvalidArgument("--coordinator: '" + text + "' is not HOST:PORT");
    }
    std::string host = text.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    const std::string port_text = text.substr(colon + 1);
    int port = 0;
    auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (port_text.empty() || ec != std::errc() || ptr != port_text.data() + port_text.size() ||
        port < 1 || port > 65535) {
        return InvalidArgument("--coordinator: port '" + port_text + "' is not in 1..65535");
    }
    return std::make_pair(host, static_cast<uint16_t>(port));
}

int RunWorker(const WorkerFlags& f) {
    Result<std::pair<std::string, uint16_t>> address = ParseHostPort(f.coordinator);
    if (!address.ok()) return Fail(address.status().message());

    Result<std::string> token = ReadToken(f);
    if (!token.ok()) return Fail(token.status().message());

    WorkerServiceOptions o;
    o.token = std::move(*token);
    o.coordinator_host = address->first;
    o.coordinator_port = address->second;
    o.instance_id = f.instance;
    o.kv_host = f.kv_host;
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
        o.rank = f.rank < 0 ? 0 : f.rank;
        o.tp = f.tp <= 0 ? 1 : f.tp;
        if (o.rank >= o.tp) {
            return Fail("--rank " + std::to_string(o.rank) + " must be < --tp " +
                        std::to_string(o.tp));
        }
        if (o.tp > 1) {
            return Fail("--tp " + std::to_string(o.tp) +
                        ": ranks of a tensor-parallel instance need MPI between them; start "
                        "them with mpirun -np " +
                        std::to_string(o.tp) + " kvshard worker ...");
        }
    }
    o.collective = collective.get();
    InitLogging("worker " + o.instance_id + " r" + std::to_string(o.rank), f.log_level);
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
                    "Rank within the instance (default 0; from MPI under mpirun)");
    sub->add_option("--tp", f->tp, "The instance's tensor-parallel size (default 1; from MPI)");
    sub->add_option("--kv-host", f->kv_host, "Address this rank's KV transport listens on")
        ->capture_default_str();
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
                    "Longest wait in an MPI collective for the other ranks")
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
