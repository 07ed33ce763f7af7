// The worker service: the body of a worker process of process mode (`kvshard worker`). It
// connects to the coordinator, registers one rank of one instance, loads what the coordinator's
// RegisterAck says (its weight shard, a KV pool), reports Ready, then executes every StepPlan it
// receives and answers each with a StepResult, until Shutdown or until the connection fails.
//
//   connect (retried until connect_timeout_ms) → Register → RegisterAck (rank, tp) →
//   [tp > 1 without a collective given, unless the ranks use NCCL: a Gloo group meets through
//   the coordinator] → load → [tp > 1: the rank's collective on its backend: the host one, the
//   host-staged one, or NCCL on the backend's stream with the RegisterAck's nccl_unique_id
//   (worker/rank_collective.h)] → Ready
//   loop: StepPlan → StepRunner::Execute → StepResult     Shutdown → exit 0
//
// Every rank answers every plan, with its own tokens (ranks sample alike) and its own KV byte
// counters; the coordinator (coordinator/remote_executor.h) takes rank 0's tokens, sums the
// counters and treats any rank's error as the step's.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/collective.h"
#include "comm/frame_channel.h"
#include "common/status.h"
#include "worker/model_runner.h"

namespace kvshard {

// What a worker needs besides the model path, carried in RegisterAck.settings as text so that
// both sides of the wire agree on one encoding (EncodeWorkerSettings / DecodeWorkerSettings).
struct WorkerRunSettings {
    // max_context, block_size, num_kv_blocks, kv_storage, weight_format, max_step_tokens, and
    // the backend's kind (cpu or cuda).
    RunnerOptions runner;
    std::string tokenizer_path;  // llama2.c only; "" finds it beside the model
    int threads = 0;             // OpenMP/BLAS threads of the worker; 0: leave the default
    // cuda: the GPU of each rank of the instance (rank r runs on devices[r]; an ordinal may
    // repeat). Empty: runner.backend.device for every rank.
    std::vector<int> devices;
    // Stage the ranks' collectives through the host even where they could run directly
    // (worker/rank_collective.h): the host-staged path on the CPU, or around NCCL on GPUs.
    bool force_staged_collective = false;
};

std::vector<std::pair<std::string, std::string>> EncodeWorkerSettings(const WorkerRunSettings& s);
// InvalidArgument naming the key for a missing or malformed value; unknown keys are ignored (a
// newer coordinator may send more).
Result<WorkerRunSettings> DecodeWorkerSettings(
    const std::vector<std::pair<std::string, std::string>>& settings);

struct WorkerServiceOptions {
    std::string coordinator_host = "127.0.0.1";
    uint16_t coordinator_port = 0;
    std::string instance_id;
    // This rank, or kAnyRank (comm/control_messages.h): the coordinator assigns the lowest free
    // one. The instance's tp as the worker was told, or kAnyTp: the coordinator's.
    int rank = 0;
    int tp = 1;
    // Non-empty: the model the worker expects (path, or file name); the coordinator refuses the
    // registration when its instance serves another.
    std::string model;
    // The registry's secret (KVSHARD_WORKER_TOKEN), sent in Register.
    std::string token;
    // Address this rank's KV transport listens on (other instances send KV there).
    std::string kv_host = "127.0.0.1";
    // > 0: overrides the coordinator's threads setting.
    int threads = 0;
    // How long to keep trying to reach the coordinator (it may start after the worker).
    int64_t connect_timeout_ms = 60'000;
    // How long the coordinator may take to answer Register.
    int64_t register_timeout_ms = 60'000;
    FrameChannelOptions channel;
    // The instance's collective (not owned; outlives the call), e.g. the MPI group under
    // mpirun: of size tp with this rank. Null: with tp > 1 the ranks build a Gloo communicator
    // (comm/collective.h) meeting in the coordinator's rendezvous store over the registration
    // channel, listening on collective_host (or the interface collective_iface names, or
    // GLOO_SOCKET_IFNAME's), with collective_timeout_ms for the rendezvous and every operation.
    Collective* collective = nullptr;
    std::string collective_host = "127.0.0.1";
    std::string collective_iface;
    int64_t collective_timeout_ms = 60'000;
};

// Runs the worker until Shutdown (returns OK) or a failure: the coordinator could not be reached
// or refused the registration (the ack's reason), the ranks' collective could not be formed or
// the model could not be loaded (both reported to the coordinator with Ready{ok=false} first),
// or the connection failed (Unavailable, naming the peer and why). Logs its state transitions.
Status RunWorkerService(const WorkerServiceOptions& options);

}  // namespace kvshard
