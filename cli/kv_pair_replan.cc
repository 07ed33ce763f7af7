// KvPairPlan (cli/kv_pair_replan.h).
#include "cli/kv_pair_replan.h"

#include <spdlog/spdlog.h>

#include "comm/collective.h"
#include "comm/kv_nccl_pairs.h"
#include "comm/socket_kv_pair_channel.h"

namespace kvshard::cli {

Result<std::vector<KvNcclPair>> ReplanKvNcclPairs(
    std::vector<KvNcclPair> pairs, const std::string& instance,
    const std::function<Result<std::string>()>& new_id) {
    for (KvNcclPair& p : pairs) {
        if (p.prefill_instance != instance && p.decode_instance != instance) continue;
        KV_ASSIGN_OR_RETURN(p.nccl_unique_id, new_id());
    }
    return pairs;
}

KvPairRankList KvPairSettingsOfRank(const std::vector<KvNcclPair>& pairs,
                                    const std::string& instance, int rank, KvPairLink link,
                                    int64_t timeout_ms, uint64_t first_transfer_id) {
    KvPairRankList out = {{std::string(kKvNcclPairsSetting),
                           EncodeKvNcclPairs(KvNcclPairsOfRank(pairs, instance, rank))},
                          {std::string(kKvPairLinkSetting), std::string(KvPairLinkName(link))},
                          {std::string(kKvPairTimeoutSetting), std::to_string(timeout_ms)}};
    if (first_transfer_id > 0) {
        out.emplace_back(std::string(kKvPairFirstTransferSetting),
                         std::to_string(first_transfer_id));
    }
    return out;
}

Result<std::string> NewKvPairId(KvPairLink link, const std::string& host) {
    switch (link) {
        case KvPairLink::kSocket:
            return NewSocketKvPairId(host);
        case KvPairLink::kNccl:
            return NewNcclUniqueId();
    }
    return InvalidArgument("kv_pair_link: unknown link");
}

KvPairPlan::KvPairPlan(std::vector<KvPairInstance> instances, KvPairLink link, std::string host,
                       int64_t timeout_ms, std::vector<KvNcclPair> pairs)
    : instances_(std::move(instances)),
      link_(link),
      host_(std::move(host)),
      timeout_ms_(timeout_ms),
      pairs_(std::move(pairs)),
      executors_(instances_.size(), nullptr) {}

Result<std::unique_ptr<KvPairPlan>> KvPairPlan::Create(const ModelSpec& spec,
                                                       std::vector<KvPairInstance> instances,
                                                       KvPairLink link, std::string host,
                                                       int64_t timeout_ms) {
    std::vector<KvNcclInstance> prefill, decode;
    for (const KvPairInstance& i : instances) {
        if (i.role == PoolRole::kPrefill) prefill.push_back({.name = i.name, .tp = i.tp});
        if (i.role == PoolRole::kDecode) decode.push_back({.name = i.name, .tp = i.tp});
    }
    KV_ASSIGN_OR_RETURN(
        std::vector<KvNcclPair> pairs,
        PlanKvNcclPairs(spec, prefill, decode, [&]() { return NewKvPairId(link, host); }));
    return std::unique_ptr<KvPairPlan>(
        new KvPairPlan(std::move(instances), link, std::move(host), timeout_ms, std::move(pairs)));
}

std::vector<KvPairRankList> KvPairPlan::RankSettingsLocked(size_t i,
                                                           uint64_t first_transfer_id) const {
    std::vector<KvPairRankList> ranks;
    const KvPairInstance& instance = instances_.at(i);
    if (instance.role == PoolRole::kMixed) return ranks;
    for (int rank = 0; rank < instance.tp; ++rank) {
        ranks.push_back(KvPairSettingsOfRank(pairs_, instance.name, rank, link_, timeout_ms_,
                                             first_transfer_id));
    }
    return ranks;
}

std::vector<KvPairRankList> KvPairPlan::RankSettings(size_t i) const {
    std::lock_guard<std::mutex> lock(mu_);
    return RankSettingsLocked(i, 0);
}

void KvPairPlan::SetExecutor(size_t i, RemoteStepExecutor* executor) {
    std::lock_guard<std::mutex> lock(mu_);
    executors_.at(i) = executor;
}

void KvPairPlan::SetNextTransferId(std::function<uint64_t()> next) {
    std::lock_guard<std::mutex> lock(mu_);
    next_transfer_id_ = std::move(next);
}

void KvPairPlan::Detach() {
    std::lock_guard<std::mutex> lock(mu_);
    executors_.assign(executors_.size(), nullptr);
    next_transfer_id_ = nullptr;
}

int KvPairPlan::replans() const {
    std::lock_guard<std::mutex> lock(mu_);
    return replans_;
}

Status KvPairPlan::Replan(const std::string& instance) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string why = "kv_transfer.path: nccl: the KV pairs with instance " + instance;
    Result<std::vector<KvNcclPair>> made =
        ReplanKvNcclPairs(pairs_, instance, [&]() { return NewKvPairId(link_, host_); });
    if (!made.ok()) {
        const Status failed = made.status().WithContext(why +
                                                        " cannot be re-planned; they stay "
                                                        "down after its re-form");
        spdlog::error("{}", failed.ToString());
        return failed;
    }
    pairs_ = std::move(*made);
    replans_++;
    // Read after the new pairs exist: a transfer the router numbers from here on is planned on
    // both sides after their new pairs were handed out (module comment).
    const uint64_t first = next_transfer_id_ ? next_transfer_id_() : 0;
    std::string told;
    for (size_t i = 0; i < instances_.size(); ++i) {
        const KvPairInstance& other = instances_[i];
        const bool involved =
            other.name == instance ||
            std::any_of(pairs_.begin(), pairs_.end(), [&](const KvNcclPair& p) {
                return (p.prefill_instance == instance && p.decode_instance == other.name) ||
                       (p.decode_instance == instance && p.prefill_instance == other.name);
            });
        if (!involved || executors_[i] == nullptr) continue;
        const Status updated = executors_[i]->UpdateRankSettings(RankSettingsLocked(i, first));
        if (!updated.ok()) {
            spdlog::error("{}: instance {} not told: {}", why, other.name, updated.ToString());
            continue;
        }
        if (other.name != instance) told += (told.empty() ? "" : ", ") + other.name;
    }
    spdlog::info(
        "KV pairs with instance {} re-planned: new {} pair ids (transfers from id {} "
        "on), handed to its new workers{}",
        instance, KvPairLinkName(link_), first, told.empty() ? "" : " and to instance(s) " + told);
    return Status::Ok();
}

}  // namespace kvshard::cli
