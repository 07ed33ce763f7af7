// TpGroup: one tensor-parallel instance embedded in this process — `tp` worker threads, each
// owning the ModelRunner of one rank (its weight slices, its KV heads' pool) and that rank's
// communicator: a LocalGroup's (comm/local_collective.h) on the CPU; on GPUs NCCL on each rank's
// stream when every rank has a GPU of its own, else the LocalGroup behind the host-staged
// collective (worker/rank_collective.h chooses).
//
// Work reaches the ranks as a job that every rank thread runs at once (the ranks' collectives
// pair up inside it): Execute runs a StepPlan through each rank's StepRunner and returns rank 0's
// StepResult; RunOnEveryRank runs any function, e.g. the Generate loop, which stays in lockstep
// on its own because every rank sees the same logits and so samples the same tokens.
//
// Threads: each rank's OpenMP loops use threads_per_rank threads; BLAS calls are single-threaded
// while a group of tp > 1 lives (OpenBLAS has one process-wide setting, and the ranks already
// fill the cores); the previous setting is restored when the group is destroyed.
// Failure: errors found before any communication (a bad plan) are the same on every rank and
// leave the group usable. Ranks that disagree (one failed, another did not) break the group:
// its LocalGroup is aborted and every later call returns that error.
// Thread-safety: Execute and RunOnEveryRank are called from one thread at a time.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/local_collective.h"
#include "comm/step_executor.h"
#include "common/status.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "worker/generator.h"
#include "worker/kv_peer_exchange.h"
#include "worker/model_runner.h"
#include "worker/rank_collective.h"
#include "worker/step_runner.h"

namespace kvshard {

struct TpGroupConfig {
    int tp = 1;
    RunnerOptions runner = {};
    // OpenMP threads of each rank's thread; 0: max(1, hardware threads / tp).
    int threads_per_rank = 0;
    // How long a rank waits in a collective for the others.
    int64_t timeout_ms = LocalGroup::kDefaultTimeoutMs;
    // The GPU of each rank when runner.backend.kind is cuda (tp entries; an ordinal may repeat:
    // those ranks share the GPU and stage their collectives through the host). Empty:
    // runner.backend.device + rank.
    std::vector<int> devices = {};
    // Stage the collectives through the host even where the ranks could use theirs directly
    // (the CPU backend; NCCL): the host-staged path, testable on the CPU.
    bool force_staged = false;
    // Non-empty: each rank r gets an in-process KV transport named "<kv_transport_name>/<r>"
    // (comm/kv_transport.h), for KV handoff to and from other instances of this process.
    std::string kv_transport_name = {};
    // The peer-copy KV handoff (worker/kv_peer_exchange.h), shared by every instance of the
    // process that hands KV over by peer copies; null: host-staged. REQUIRES: kv_transport_name.
    std::shared_ptr<KvPeerExchange> peer_exchange = {};
};

class TpGroup : public StepExecutor {
  public:
    // Starts the rank threads and loads each rank's slices on its own thread. `model` is only
    // read while Create runs. Errors: MakeShardLayout's (tp against the model's heads), the
    // file's.
    static Result<std::unique_ptr<TpGroup>> Create(const ModelFile& model,
                                                   const TpGroupConfig& config);
    // Stops and joins the rank threads.
    ~TpGroup() override;
    TpGroup(const TpGroup&) = delete;
    TpGroup& operator=(const TpGroup&) = delete;

    int tp() const { return static_cast<int>(runners_.size()); }
    // How the ranks reach each other (host at tp 1).
    CollectivePath collective_path() const { return path_; }

    // Runs the plan on every rank. Internal error if the ranks sampled different tokens. The
    // result's KV byte counters are summed over ranks and its failed transfers merged.
    Result<StepResult> Execute(const StepPlan& plan) override;

    // Each rank's KV transport endpoint (empty without kv_transport_name).
    std::vector<std::string> kv_endpoints() const override;
    // Bytes the ranks' KV transports hold staged (received, not yet written to a pool).
    int64_t kv_staged_bytes() const;

    // Runs fn(rank, runner) on every rank's thread at once and waits for all of them. Returns OK,
    // or the error of the lowest failing rank.
    Status RunOnEveryRank(const std::function<Status(int rank, ModelRunner& runner)>& fn);

    // REQUIRES: 0 <= rank < tp(); not while a job runs.
    ModelRunner& runner(int rank) { return *runners_[static_cast<size_t>(rank)]; }

  private:
    explicit TpGroup(const TpGroupConfig& config);
    void RankMain(int rank);

    using Job = std::function<Status(int rank)>;
    Status RunJob(const Job& job);
    // RunJob even on a broken group (the destructor's teardown).
    Status RunJobUnchecked(const Job& job);

    TpGroupConfig config_;
    int saved_blas_threads_ = 0;  // restored by the destructor; 0: unchanged
    std::shared_ptr<LocalGroup> group_;
    CollectivePath path_ = CollectivePath::kHost;
    // Per rank, each used only by its rank's thread while a job runs. The runners hold the rank
    // collectives, which hold (staged) the LocalGroup's: declared in that order, destroyed after.
    std::vector<std::unique_ptr<Collective>> collectives_;
    std::vector<std::unique_ptr<RankCollective>> rank_collectives_;
    std::vector<std::unique_ptr<ModelRunner>> runners_;
    std::vector<std::unique_ptr<KvTransport>> transports_;
    std::vector<std::unique_ptr<StepRunner>> step_runners_;
    std::vector<StepResult> step_results_;

    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_;
    // Guarded by mu_.
    const Job* job_ = nullptr;
    uint64_t job_generation_ = 0;
    int num_done_ = 0;
    std::vector<Status> job_status_;
    bool stopping_ = false;
    Status broken_;  // set when ranks disagreed; every later call returns it
};

// Generate (worker/generator.h) on every rank of `group` in lockstep. `on_text` is called from
// rank 0's thread only. Returns rank 0's result; Internal error if a rank generated other tokens.
Result<GenerateResult> GenerateOnEveryRank(
    TpGroup& group, const Tokenizer& tokenizer, const std::vector<int32_t>& prompt_ids,
    const GenerateOptions& options, const std::function<void(std::string_view)>& on_text = {},
    int64_t seq_id = 0);

}  // namespace kvshard
