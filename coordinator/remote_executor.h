// Process mode, the coordinator's side: worker processes (worker/worker_service.h) connect to a
// WorkerRegistry, which checks each registration and hands the accepted channel to the
// RemoteStepExecutor of its instance; the engine (coordinator/engine.h) runs its steps through
// that executor as it would through the embedded TpGroup.
//
//   WorkerRegistry::Start ─ AddInstance("0", tp) → RemoteStepExecutor
//        accept thread: Register → validate → RegisterAck{model, settings} → slot of (instance,
//        rank)
//   executor.WaitReady(timeout)   every rank registered and Ready (or why not)
//   executor.Execute(plan)        plan to every rank, every rank's StepResult back, merged
//
// Failure: a dead worker is noticed by its channel's heartbeats (FrameChannelOptions
// dead_after_ms) or by the step deadline, whichever comes first. The executor then fails for
// good: that Execute and every later one return Unavailable naming the instance, the rank, its
// peer address and the reason, at once, so the engine fails its requests and never hangs.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
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
    // Heartbeats and dead-peer detection of every worker channel.
    FrameChannelOptions channel;
    // A connection that sends no Register within this long is dropped.
    int64_t register_message_timeout_ms = 5'000;
};

struct RemoteInstanceOptions {
    std::string instance_id;
    int tp = 1;
    // What every rank is told to load (RegisterAckMessage model_path and settings).
    std::string model_path;
    std::vector<std::pair<std::string, std::string>> settings;
    // How long Execute waits for every rank's StepResult (a dead worker is usually found sooner
    // by the channel heartbeats).
    int64_t step_timeout_ms = 60'000;
};

class RemoteStepExecutor;

// Accepts worker connections on one TCP port for any number of instances.
// Thread-safety: every method may be called from any thread.
class WorkerRegistry {
  public:
    static Result<std::unique_ptr<WorkerRegistry>> Start(const WorkerRegistryOptions& options);
    // Stops accepting and joins the accept thread. Executors made by this registry stay usable
    // (they own their channels).
    ~WorkerRegistry();
    WorkerRegistry(const WorkerRegistry&) = delete;
    WorkerRegistry& operator=(const WorkerRegistry&) = delete;

    const std::string& host() const { return options_.host; }
    uint16_t port() const;

    // Declares an instance whose `tp` ranks may now register and returns its executor.
    // InvalidArgument for an empty id, tp < 1, or an id in use by a live executor.
    Result<std::unique_ptr<RemoteStepExecutor>> AddInstance(const RemoteInstanceOptions& options);

    // The registrations refused so far, each "peer: reason" (for logs and tests).
    std::vector<std::string> rejections() const;

    struct Slots;  // one instance's ranks, shared with its executor

  private:
    explicit WorkerRegistry(const WorkerRegistryOptions& options);
    void AcceptLoop();
    void HandleConnection(std::unique_ptr<FrameChannel> channel);
    // Sends RegisterAck{accepted=false, reason} and records the refusal.
    void Reject(FrameChannel& channel, const std::string& reason);

    const WorkerRegistryOptions options_;
    std::unique_ptr<FrameListener> listener_;
    std::thread accept_thread_;

    mutable std::mutex mu_;
    bool stopping_ = false;                                    // guarded by mu_
    std::map<std::string, std::shared_ptr<Slots>> instances_;  // guarded by mu_
    std::vector<std::string> rejections_;                      // guarded by mu_
};

// The StepExecutor of one instance of worker processes. Ownership: owns the channels of its
// ranks once they registered. Thread-safety: Execute from one thread at a time (the engine
// thread); WaitReady before the first Execute; Shutdown, status and kv_endpoints from any thread.
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
    // executor for good.
    Status WaitReady(std::chrono::milliseconds timeout,
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

    // OK while usable; otherwise why not.
    Status status() const;
    const std::string& instance_id() const;
    int tp() const;
    // The KvTransport endpoint each rank registered with ("" before it registered).
    std::vector<std::string> kv_endpoints() const override;
    // The KV blocks each rank's pool holds, from its Ready message (0 before).
    std::vector<int64_t> num_kv_blocks() const;

  private:
    // Records the first failure (and closes every channel) and returns it.
    Status Fail(Status status);
    Status RankError(int rank, const std::string& what, const Status& why) const;

    std::shared_ptr<WorkerRegistry::Slots> slots_;
    bool ready_ = false;  // Execute thread only, after WaitReady
};

}  // namespace kvshard
