// The KV pair path's plan across re-forms (kv_transfer.path: nccl, worker/kv_handoff_pairs.h):
// serve plans every pair once at start (each with a fresh id for its link); when an instance
// re-forms, its supervisor (cli/process_instance.h ProcessInstanceSpec::before_relaunch) calls
// Replan: every pair with that instance gets a fresh id (a used NCCL unique id cannot be joined
// again, and the old peer of a socket pair is gone), its new ranks get the new pairs at
// registration, and the ranks of every healthy instance with a pair with it get theirs at once
// in a RankSettingsMessage (RemoteStepExecutor::UpdateRankSettings), on which they drop the old
// channels and join the new ones. The new pairs carry the router's next transfer id
// (kv_pair_first_transfer): a transfer planned before the re-plan is refused by them on both sides
// rather than sent or awaited over a channel that never saw its offer.
//
// Thread-safety: every method from any thread (the supervisors of several instances may re-plan
// at once); one mutex orders the re-plans.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cli/serve_devices.h"
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

// The settings rank `rank` of `instance` gets (kv_nccl_pairs, kv_pair_link, kv_pair_timeout_ms,
// and kv_pair_first_transfer when `first_transfer_id` > 0).
KvPairRankList KvPairSettingsOfRank(const std::vector<KvNcclPair>& pairs,
                                    const std::string& instance, int rank, KvPairLink link,
                                    int64_t timeout_ms, uint64_t first_transfer_id = 0);

// A fresh pair id for `link`: nccl, NewNcclUniqueId (Unimplemented in a build without CUDA);
// socket, NewSocketKvPairId on `host`.
Result<std::string> NewKvPairId(KvPairLink link, const std::string& host);

class KvPairPlan {
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
    // Where Replan reads the next transfer id (the router's); 0 until set (no transfer yet).
    void SetNextTransferId(std::function<uint64_t()> next);
    // Forgets the executors and the transfer-id source: later Replans change nothing. Waits for
    // a Replan in progress.
    void Detach();

    // New ids for every pair with the instance named `instance`, handed to the executors of it
    // and of every instance with a pair with it. The id maker's error (the pairs then stay as
    // they were: the re-formed instance's ranks get the old ids, which fail at once, and the
    // error is logged naming kv_transfer.path).
    Status Replan(const std::string& instance);
    // Re-plans so far (tests, logs).
    int replans() const;

  private:
    KvPairPlan(std::vector<KvPairInstance> instances, KvPairLink link, std::string host,
               int64_t timeout_ms, std::vector<KvNcclPair> pairs);
    std::vector<KvPairRankList> RankSettingsLocked(size_t i, uint64_t first_transfer_id) const;

    const std::vector<KvPairInstance> instances_;
    const KvPairLink link_;
    const std::string host_;
    const int64_t timeout_ms_;
    mutable std::mutex mu_;
    std::vector<KvNcclPair> pairs_;               // guarded by mu_
    std::vector<RemoteStepExecutor*> executors_;  // guarded by mu_; by instance
    std::function<uint64_t()> next_transfer_id_;  // guarded by mu_
    int replans_ = 0;                             // guarded by mu_
};

}  // namespace kvshard::cli
