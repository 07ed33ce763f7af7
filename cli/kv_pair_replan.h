// The KV pair path's plan across re-forms (kv_transfer.path: nccl, worker/kv_handoff_pairs.h):
// serve plans every pair once at start (each with a fresh id for its link); when an instance
// re-forms, its supervisor (cli/process_instance.h ProcessInstanceSpec::before_relaunch) calls
// Replan: every pair with that instance gets a fresh id (a used NCCL unique id cannot be joined
// again, and the old peer of a socket pair is gone), its new ranks get the new pairs at
// registration, and the ranks of every healthy instance with a pair with it get theirs at once
// in a RankSettingsMessage (RemoteStepExecutor::UpdateRankSettings), on which they drop the old
// channels and join the new ones. The new pairs carry the router's next transfer id
// (kv_pair_first_transfer): a transfer planned before the re-plan is refused by them on both sides
// rather than sent or awaited over a channel that never saw its offer. The router hands out no
// id while the instances are told (SetTransferFence): a transfer numbered from that id on reaches
// each instance's workers after their RankSettings, on the same control channel, so both sides
// meet it on the new pairs; were the id read before the telling, a transfer numbered in between
// could be received on one side's old pairs and readied, and so sent, on the other's new ones,
// where it would pair with the next transfer's receive.
//
// A pair set that fails without a re-form (a receive that timed out, a peer's channel reset: the
// pair protocol fails a pair for good, comm/kv_pair_protocol.h) is re-planned the same way but
// for the pairs between its two instances only, both of them healthy: the engines report the
// workers' TransferFailure::pairs_down (KvPairHealth, coordinator/engine_api.h), and a thread of
// the plan makes the new ids and tells both instances' executors. A report about pairs already
// replaced (an older pairs_first_transfer) is stale and ignored; a set re-planned again and again
// without a transfer getting through waits RepairDelay between re-plans (a link that keeps
// failing is not re-planned in a loop): reports within the wait are dropped, and the next report
// after it re-plans.
//
// Thread-safety: every method from any thread (the supervisors of several instances may re-plan
// at once, the engines report from theirs); one mutex orders the re-plans.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli/serve_devices.h"
#include "coordinator/engine_api.h"
#include "coordinator/remote_executor.h"
#include "worker/kv_handoff_nccl_pairs.h"
#include "worker/kv_handoff_pairs.h"

namespace kvshard::cli {

using KvPairRankList = std::vector<std::pair<std::string, std::string>>;

// `pairs` with a fresh id (from `new_id`) for every pair of instance `instance`, the others as
// they are. new_id's error as it is.
Result<std::vector<KvNcclPair>> ReplanKvNcclPairs(
    std::vector<KvNcclPair> pairs, const std::string& instance,
    const std::function<Result<std::string>()>& new_id);
// `pairs` with a fresh id for every pair `which` selects, the others as they are.
Result<std::vector<KvNcclPair>> ReplanKvNcclPairsWhere(
    std::vector<KvNcclPair> pairs, const std::function<bool(const KvNcclPair&)>& which,
    const std::function<Result<std::string>()>& new_id);

// The settings rank `rank` of `instance` gets (kv_nccl_pairs, kv_pair_link, kv_pair_timeout_ms,
// and kv_pair_first_transfer when `first_transfer_id` > 0).
KvPairRankList KvPairSettingsOfRank(const std::vector<KvNcclPair>& pairs,
                                    const std::string& instance, int rank, KvPairLink link,
                                    int64_t timeout_ms, uint64_t first_transfer_id = 0);

// A fresh pair id for `link`: nccl, NewNcclUniqueId (Unimplemented in a build without CUDA);
// socket, NewSocketKvPairId on `host`.
Result<std::string> NewKvPairId(KvPairLink link, const std::string& host);

class KvPairPlan : public KvPairHealth {
  public:
    // PlanKvNcclPairs between every prefill and every decode instance of `instances`, ids for
    // `link` (KvPairRankSettings' errors).
    static Result<std::unique_ptr<KvPairPlan>> Create(const ModelSpec& spec,
                                                      std::vector<KvPairInstance> instances,
                                                      KvPairLink link, std::string host,
                                                      int64_t timeout_ms);

    // The rank settings of instance `i` (in Create's order), one list per rank; empty for a
    // mixed instance (RemoteInstanceOptions::rank_settings).
    std::vector<KvPairRankList> RankSettings(size_t i) const;

    // The executor of instance `i` once declared; Replan tells it its ranks' new lists.
    // REQUIRES: the executor outlives the plan's use of it (Detach before destroying it).
    void SetExecutor(size_t i, RemoteStepExecutor* executor);
    // How a re-plan fences transfers: `fence(tell)` calls tell(next transfer id) with the
    // router's numbering paused (Router::WithTransferNumberingPaused), and the re-plan hands
    // out the new pairs inside, carrying that id (module comment). Until set: tell(0), no
    // transfer yet.
    using TransferFence = std::function<void(const std::function<void(uint64_t next)>& tell)>;
    void SetTransferFence(TransferFence fence);
    // Called after every re-plan that handed out new ids (serve: kvshard:kv_pair_replans_total).
    void SetOnReplanned(std::function<void()> on_replanned);
    // Forgets the executors and the transfer fence: later Replans change nothing. Waits for
    // a Replan in progress and ends the thread that re-plans failed pairs.
    void Detach();
    ~KvPairPlan() override;

    // New ids for every pair with the instance named `instance`, handed to the executors of it
    // and of every instance with a pair with it. The id maker's error (the pairs then stay as
    // they were: the re-formed instance's ranks get the old ids, which fail at once, and the
    // error is logged naming kv_transfer.path).
    Status Replan(const std::string& instance);
    // Re-plans so far (tests, logs): of re-formed instances, and of failed pair sets.
    int replans() const;
    int repairs() const;

    // KvPairHealth (module comment): the pairs between `prefill` and `decode` are re-planned on
    // the plan's thread, unless the report is stale, one is queued, or RepairDelay holds it.
    // Nothing after Detach, and nothing for two instances without pairs between them.
    void OnPairsDown(const std::string& prefill, const std::string& decode,
                     uint64_t pairs_first_transfer, const Status& why) override;
    // A transfer went through: the set's next failure is re-planned at once.
    void OnPairsTransferred(const std::string& prefill, const std::string& decode) override;
    // How long a pair set waits after a re-plan before the next one, when `repairs` re-plans of
    // it went by without a transfer through it: 1 s, doubling, at most 60 s (0 for none).
    static std::chrono::milliseconds RepairDelay(int repairs);
    // Waits until no re-plan of a failed set is queued or running (tests).
    void WaitRepairsIdle();

  private:
    using SetKey = std::pair<std::string, std::string>;  // (prefill, decode)
    // One prefill instance's pairs with one decode instance.
    struct PairSet {
        uint64_t first_transfer = 0;  // the transfer id the current pairs carry from
        int repairs_since_transfer = 0;
        std::chrono::steady_clock::time_point last_repair;
        bool queued = false;
    };
    KvPairPlan(std::vector<KvPairInstance> instances, KvPairLink link, std::string host,
               int64_t timeout_ms, std::vector<KvNcclPair> pairs);
    std::vector<KvPairRankList> RankSettingsLocked(size_t i, uint64_t first_transfer_id) const;
    // New ids for the pairs `which` selects, handed to the executors of the instances at their
    // ends (and of `also`, the re-formed instance). Returns the first transfer id they carry.
    Result<uint64_t> ReplanLocked(const std::function<bool(const KvNcclPair&)>& which,
                                  const std::string& also, std::string* told);
    void RepairLoop();

    const std::vector<KvPairInstance> instances_;
    const KvPairLink link_;
    const std::string host_;
    const int64_t timeout_ms_;
    mutable std::mutex mu_;
    std::vector<KvNcclPair> pairs_;               // guarded by mu_
    std::vector<RemoteStepExecutor*> executors_;  // guarded by mu_; by instance
    TransferFence fence_;                         // guarded by mu_
    std::function<void()> on_replanned_;          // guarded by mu_
    int replans_ = 0;                             // guarded by mu_
    int repairs_ = 0;                             // guarded by mu_
    std::map<SetKey, PairSet> sets_;              // guarded by mu_; every set with pairs
    std::deque<SetKey> queue_;                    // guarded by mu_: sets to re-plan
    bool repairing_ = false;                      // guarded by mu_: RepairLoop re-plans one
    bool detached_ = false;                       // guarded by mu_
    std::condition_variable cv_;                  // queue_, repairing_ or detached_ changed
    std::thread repair_thread_;                   // started by the first report
};

}  // namespace kvshard::cli
