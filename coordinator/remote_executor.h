// Process mode, the coordinator's side: worker processes (worker/worker_service.h) connect to a
// WorkerRegistry, which checks each registration and hands the accepted channel to the
// RemoteStepExecutor of its instance; the engine (coordinator/engine.h) runs its steps through
// that executor as it would through the embedded TpGroup.
//
//   WorkerRegistry::Start ─ AddInstance("0", tp) → RemoteStepExecutor
//        accept thread → one handshake thread per connection (each with its own deadline):
//        Register → token and fields checked → rank (the asked one, or the lowest free one for
//        kAnyRank) → RegisterAck{model, tp, rank, settings} → slot of (instance, rank)
//   executor.WaitReady(timeout)   every rank registered and Ready (or why not); epoch 1. Until
//        then it also serves the formation's rendezvous store (StoreRequest → StoreReply), in
//        which the ranks of a Gloo group (comm/collective.h) find each other
//   executor.Execute(plan)        plan to every rank, every rank's StepResult back, merged
//   executor.Health()             OK while every rank's channel is alive, also between steps
//   executor.Reform(timeout)      after a failure: new registrations, every rank Ready; epoch+1
//
// Failure: a dead worker is noticed by its channel's heartbeats (FrameChannelOptions
// dead_after_ms; they run while idle too, so Health() turns non-OK without a step) or by the
// step deadline, whichever comes first. The executor is then failed: Execute and Health return
// Unavailable naming the instance, the rank, its peer address and the reason, at once, so the
// engine fails its requests and never hangs, until someone (cli/process_instance.h) re-forms it
// with new workers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/control_messages.h"
#include "comm/frame_channel.h"
#include "comm/step_executor.h"
#include "common/status.h"

namespace kvshard {

struct WorkerRegistryOptions {
    std::string host = "127.0.0.1";  // where workers connect; "0.0.0.0" for other machines
    uint16_t port = 0;               // 0: a free port (see WorkerRegistry::port())
    // The secret every Register must carry (workers.token). Empty: Start makes a random one
    // (see WorkerRegistry::token()), so the registry is never open to whoever reaches the port.
    std::string token;
    // Heartbeats and dead-peer detection of every worker channel.
    FrameChannelOptions channel;
    // A connection that sends no Register within this long is dropped. Each connection has its
    // own deadline: silent connections never delay another's registration.
    int64_t register_message_timeout_ms = 5'000;
    // Connections accepted but not yet registered or refused, at most; more are refused at once.
    int max_pending_handshakes = 64;
};

// A random token for workers.token: 32 bytes from the kernel's random source, as 64 hex digits.
std::string RandomWorkerToken();

struct RemoteInstanceOptions {
    std::string instance_id;
    int tp = 1;
    // What every rank is told to load (RegisterAckMessage model_path and settings).
    std::string model_path;
    std::vector<std::pair<std::string, std::string>> settings;
    // Empty, or one list per rank appended to that rank's settings (what differs between the
    // ranks: e.g. the NCCL KV handoff's pairs, comm/kv_nccl_pairs.h kKvNcclPairsSetting).
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_settings;
    // How long Execute waits for every rank's StepResult (a dead worker is usually found sooner
    // by the channel heartbeats).
    int64_t step_timeout_ms = 60'000;
    // CUDA builds: the ranks run on GPUs and form an NCCL group, so each formation of a tp > 1
    // instance gets an NCCL unique id (settings "nccl_unique_id"). Off for CPU workers, which
    // all-reduce over Gloo: making an id starts NCCL's bootstrap root (a listening socket and a
    // thread that waits for ranks), which nothing would ever join.
    bool nccl_bootstrap = false;
};

class RemoteStepExecutor;

// Accepts worker connections on one TCP port for any number of instances. A registration is
// refused (RegisterAck{accepted: false}, logged, recorded in rejections()) without the right
// token (compared in constant time), for another protocol version, an unknown instance, a tp
// other than the instance's (both named; kAnyTp takes the instance's), a model other than the
// instance's (when the worker names one), a rank outside [0, tp) or already registered (the
// rank and its holder named), kAnyRank when every rank is taken, or an instance that failed and
// is not re-forming. CUDA builds hand every rank of a tp > 1 formation the same NCCL unique id
// (settings "nccl_unique_id") when its options ask for one (nccl_bootstrap). Thread-safety: every method may be called from any thread.
class WorkerRegistry {
  public:
    static Result<std::unique_ptr<WorkerRegistry>> Start(const WorkerRegistryOptions& options);
    // Stops accepting, refuses the registrations held for a re-form ("shutting down", at once),
    // closes the connections still in their handshake and joins every thread. Executors made by
    // this registry stay usable (they own their channels).
    ~WorkerRegistry();
    WorkerRegistry(const WorkerRegistry&) = delete;
    WorkerRegistry& operator=(const WorkerRegistry&) = delete;

    const std::string& host() const { return options_.host; }
    uint16_t port() const;
    // What workers must present (given, or made by Start); the launcher passes it to the
    // workers it starts in their environment (KVSHARD_WORKER_TOKEN).
    const std::string& token() const { return options_.token; }

    // Declares an instance whose `tp` ranks may now register and returns its executor.
    // InvalidArgument for an empty id, tp < 1, rank_settings neither empty nor of tp lists, or
    // an id in use by a live executor.
    Result<std::unique_ptr<RemoteStepExecutor>> AddInstance(const RemoteInstanceOptions& options);

    // The registrations refused so far, each "peer: reason" (for logs and tests); the latest
    // kMaxRejections only.
    std::vector<std::string> rejections() const;
    static constexpr size_t kMaxRejections = 1'024;

    struct Slots;  // one instance's ranks, shared with its executor

  private:
    // One connection between accept and its registration (or refusal).
    struct Handshake {
        std::thread thread;
        // Valid while non-null: the handshake thread nulls it (under mu_) before it hands the
        // channel over or destroys it, so the destructor can Close a pending one.
        FrameChannel* channel = nullptr;
        bool done = false;  // the thread is about to end: join it
    };

    explicit WorkerRegistry(const WorkerRegistryOptions& options);
    void AcceptLoop();
    // Joins the handshake threads that finished.
    void ReapHandshakes();
    // Reads the Register (its own deadline), checks it and hands the channel to its slot.
    void HandleConnection(std::unique_ptr<FrameChannel>& channel,
                          std::list<Handshake>::iterator handshake);
    // Sends RegisterAck{accepted=false, reason} and records the refusal.
    void Reject(FrameChannel& channel, const std::string& reason);

    const WorkerRegistryOptions options_;
    std::unique_ptr<FrameListener> listener_;
    std::thread accept_thread_;

    mutable std::mutex mu_;
    bool stopping_ = false;                                    // guarded by mu_
    std::map<std::string, std::shared_ptr<Slots>> instances_;  // guarded by mu_
    std::deque<std::string> rejections_;                       // guarded by mu_
    std::list<Handshake> handshakes_;                          // guarded by mu_
    int pending_handshakes_ = 0;                               // guarded by mu_
    // Set by the destructor; read under an instance's slots->mu (which mu_ must not nest in).
    std::atomic<bool> closing_{false};
};

// The StepExecutor of one instance of worker processes. Ownership: owns the channels of its
// ranks once they registered. Thread-safety: Execute from one thread at a time (the engine
// thread); WaitReady, BeginReform and Reform from one thread at a time (the one that forms the
// instance: StartProcessInstance, then its supervisor), concurrently with Execute; Health,
// Shutdown, UpdateRankSettings and the accessors from any thread.
class RemoteStepExecutor : public StepExecutor {
  public:
    explicit RemoteStepExecutor(std::shared_ptr<WorkerRegistry::Slots> slots);
    // Shutdown("executor destroyed"); the instance id is then free for a new AddInstance.
    ~RemoteStepExecutor() override;
    RemoteStepExecutor(const RemoteStepExecutor&) = delete;
    RemoteStepExecutor& operator=(const RemoteStepExecutor&) = delete;

    // Waits until every rank registered and reported Ready. Returns at once with the reason when
    // a worker reports a load error, its connection fails, or `check_workers` (called every few
    // milliseconds; e.g. the launcher noticing a worker process exited) returns an error;
    // DeadlineExceeded naming the ranks still missing after `timeout`. Any error fails the
    // executor (until the next Reform). OK: Health() OK and epoch() 1.
    Status WaitReady(std::chrono::milliseconds timeout,
                     const std::function<Status()>& check_workers = {});

    // Starts re-forming a failed (or healthy: the caller knows better, e.g. a worker process
    // exited) instance: closes every rank's channel (the old workers see it and exit; an
    // Execute in flight returns Unavailable), empties the slots and takes new registrations for
    // them. Until Reform succeeds, Execute and Health return Unavailable "re-forming: reason" at
    // once. No-op after Shutdown. Call it before starting the replacement workers, so their
    // registrations are not refused.
    void BeginReform(const std::string& reason);

    // BeginReform (unless already begun since the last failure), then waits as WaitReady does
    // for every rank to register and report Ready. OK: Health() OK, epoch() one more,
    // kv_endpoints() and num_kv_blocks() those of the new workers. An error leaves the executor
    // failed; Reform may be called again.
    Status Reform(std::chrono::milliseconds timeout,
                  const std::function<Status()>& check_workers = {});

    // Sends the plan to every rank and waits for each rank's StepResult: returns rank 0's, with
    // kv_bytes_sent/received summed over the ranks and failed_transfers merged. A step error on
    // every rank is returned as Internal and leaves the executor usable; on some ranks only, or
    // any channel problem (dead worker, closed connection, step deadline), fails the executor.
    // REQUIRES: WaitReady returned OK.
    Result<StepResult> Execute(const StepPlan& plan) override;

    // Sends ShutdownMessage{reason} to every registered rank (best effort) and closes the
    // channels; later Execute calls return Unavailable. Idempotent.
    void Shutdown(const std::string& reason);

    // OK while every rank of the current formation is registered, Ready and its channel alive
    // (a channel closes on a dead peer after dead_after_ms, idle or not; noticing it here fails
    // the executor at once); otherwise why not: the failure, "re-forming", "shut down", or
    // "workers not ready" before the first WaitReady. Cheap: the engine polls it.
    Status Health() const override;
    // The formations so far: 0 before WaitReady succeeded, 1 after, one more per Reform.
    uint64_t epoch() const override;

    // The recorded failure (OK before any, and after a successful Reform); unlike Health it
    // does not look at the channels.
    Status status() const;
    const std::string& instance_id() const;
    int tp() const;
    // Replaces the per-rank settings (RemoteInstanceOptions::rank_settings) that registrations
    // get from now on, and tells each rank of the current formation that reported Ready its new
    // list (RankSettingsMessage, at once, between its steps); a rank that registered with the old
    // list and is not Ready yet is told when its Ready arrives. InvalidArgument for lists not of
    // tp ranks (or empty where the instance had none). Used by the KV pair path to re-plan the
    // pairs with an instance that re-forms (cli/kv_pair_replan.h).
    Status UpdateRankSettings(
        std::vector<std::vector<std::pair<std::string, std::string>>> rank_settings);

    // The KvTransport endpoint each rank registered with ("" before it registered).
    std::vector<std::string> kv_endpoints() const override;
    // The KV blocks each rank's pool holds, from its Ready message (0 before).
    std::vector<int64_t> num_kv_blocks() const;

  private:
    // Records the first failure of formation `generation` (and closes every channel) and
    // returns it; a stale generation's failure (an Execute that ran into a Reform) is returned
    // without being recorded.
    Status Fail(uint64_t generation, Status status) const;
    Status RankError(int rank, const std::string& what, const Status& why) const;
    // WaitReady's body, for the formation `generation`.
    Status WaitFormed(uint64_t generation, std::chrono::milliseconds timeout,
                      const std::function<Status()>& check_workers);

    std::shared_ptr<WorkerRegistry::Slots> slots_;
    // Held by Execute for the whole step, so BeginReform destroys the old channels only after an
    // Execute in flight has let go of them.
    std::mutex execute_mu_;
    // Held by UpdateRankSettings while it sends, so BeginReform and the destructor destroy the
    // old channels only after it let go of them. Never held with slots_->mu waited for inside.
    std::mutex update_mu_;
};

}  // namespace kvshard
