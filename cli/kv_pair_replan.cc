// KvPairPlan (cli/kv_pair_replan.h).
#include "cli/kv_pair_replan.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "comm/collective.h"
#include "comm/kv_nccl_pairs.h"
#include "comm/socket_kv_pair_channel.h"

namespace kvshard::cli {

Result<std::vector<KvNcclPair>> ReplanKvNcclPairsWhere(
    std::vector<KvNcclPair> pairs, const std::function<bool(const KvNcclPair&)>& which,
    const std::function<Result<std::string>()>& new_id) {
    for (KvNcclPair& p : pairs) {
        if (!which(p)) continue;
        KV_ASSIGN_OR_RETURN(p.nccl_unique_id, new_id());
    }
    return pairs;
}

Result<std::vector<KvNcclPair>> ReplanKvNcclPairs(
    std::vector<KvNcclPair> pairs, const std::string& instance,
    const std::function<Result<std::string>()>& new_id) {
    return ReplanKvNcclPairsWhere(
        std::move(pairs),
        [&](const KvNcclPair& p) {
            return p.prefill_instance == instance || p.decode_instance == instance;
        },
        new_id);
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
      executors_(instances_.size(), nullptr) {
    for (const KvNcclPair& p : pairs_) sets_[{p.prefill_instance, p.decode_instance}];
}

KvPairPlan::~KvPairPlan() { Detach(); }

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

void KvPairPlan::SetTransferFence(TransferFence fence) {
    std::lock_guard<std::mutex> lock(mu_);
    fence_ = std::move(fence);
}

void KvPairPlan::SetOnReplanned(std::function<void()> on_replanned) {
    std::lock_guard<std::mutex> lock(mu_);
    on_replanned_ = std::move(on_replanned);
}

void KvPairPlan::Detach() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        executors_.assign(executors_.size(), nullptr);
        fence_ = nullptr;
        on_replanned_ = nullptr;
        detached_ = true;
        queue_.clear();
    }
    cv_.notify_all();
    if (repair_thread_.joinable()) repair_thread_.join();
}

int KvPairPlan::replans() const {
    std::lock_guard<std::mutex> lock(mu_);
    return replans_;
}

int KvPairPlan::repairs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return repairs_;
}

std::chrono::milliseconds KvPairPlan::RepairDelay(int repairs) {
    if (repairs <= 0) return std::chrono::milliseconds(0);
    constexpr int64_t kFirstMs = 1'000, kMaxMs = 60'000;
    const int doublings = std::min(repairs - 1, 6);  // 1 s << 6 is past the cap
    return std::chrono::milliseconds(std::min(kFirstMs << doublings, kMaxMs));
}

Result<uint64_t> KvPairPlan::ReplanLocked(const std::function<bool(const KvNcclPair&)>& which,
                                          const std::string& also, std::string* told) {
    KV_ASSIGN_OR_RETURN(
        pairs_, ReplanKvNcclPairsWhere(pairs_, which, [&]() { return NewKvPairId(link_, host_); }));
    // The transfer numbering is paused while both sides are told: a transfer numbered from
    // `first` on is planned on each instance after its RankSettings on the same control channel,
    // so its worker meets it on the new pairs (module comment); one numbered before is refused by
    // them (the workers' Replan drops the old channels with what they held).
    uint64_t first = 0;
    const auto tell = [&](uint64_t next) {
        first = next;
        for (const KvNcclPair& p : pairs_) {
            if (which(p)) sets_[{p.prefill_instance, p.decode_instance}].first_transfer = first;
        }
        for (size_t i = 0; i < instances_.size(); ++i) {
            const KvPairInstance& other = instances_[i];
            const bool involved =
                other.name == also ||
                std::any_of(pairs_.begin(), pairs_.end(), [&](const KvNcclPair& p) {
                    return which(p) &&
                           (p.prefill_instance == other.name || p.decode_instance == other.name);
                });
            if (!involved || executors_[i] == nullptr) continue;
            const Status updated = executors_[i]->UpdateRankSettings(RankSettingsLocked(i, first));
            if (!updated.ok()) {
                spdlog::error("kv_transfer.path: nccl: instance {} not told its new KV pairs: {}",
                              other.name, updated.ToString());
                continue;
            }
            if (other.name != also) *told += (told->empty() ? "" : ", ") + other.name;
        }
    };
    if (fence_) {
        fence_(tell);
    } else {
        tell(0);
    }
    if (on_replanned_) on_replanned_();
    return first;
}

Status KvPairPlan::Replan(const std::string& instance) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string told;
    Result<uint64_t> first = ReplanLocked(
        [&](const KvNcclPair& p) {
            return p.prefill_instance == instance || p.decode_instance == instance;
        },
        instance, &told);
    if (!first.ok()) {
        const Status failed = first.status().WithContext(
            "kv_transfer.path: nccl: the KV pairs with instance " + instance +
            " cannot be re-planned; they stay down after its re-form");
        spdlog::error("{}", failed.ToString());
        return failed;
    }
    replans_++;
    spdlog::info(
        "KV pairs with instance {} re-planned: new {} pair ids (transfers from id {} "
        "on), handed to its new workers{}",
        instance, KvPairLinkName(link_), *first, told.empty() ? "" : " and to instance(s) " + told);
    return Status::Ok();
}

void KvPairPlan::OnPairsDown(const std::string& prefill, const std::string& decode,
                             uint64_t pairs_first_transfer, const Status& why) {
    std::unique_lock<std::mutex> lock(mu_);
    if (detached_) return;
    auto it = sets_.find({prefill, decode});
    if (it == sets_.end()) return;
    PairSet& set = it->second;
    // Pairs replaced since (by a re-form or an earlier re-plan): their failure is not news.
    if (pairs_first_transfer < set.first_transfer || set.queued) return;
    const auto now = std::chrono::steady_clock::now();
    const auto wait = RepairDelay(set.repairs_since_transfer);
    if (set.repairs_since_transfer > 0 && now < set.last_repair + wait) {
        spdlog::debug(
            "KV pairs {} -> {} down ({}); re-planned {} time(s) without a transfer through them, "
            "the next re-plan waits {} ms from the last",
            prefill, decode, why.ToString(), set.repairs_since_transfer, wait.count());
        return;
    }
    spdlog::warn("KV pairs {} -> {} down ({}): re-planning them", prefill, decode, why.ToString());
    set.queued = true;
    queue_.push_back({prefill, decode});
    if (!repair_thread_.joinable()) repair_thread_ = std::thread([this] { RepairLoop(); });
    lock.unlock();
    cv_.notify_all();
}

void KvPairPlan::OnPairsTransferred(const std::string& prefill, const std::string& decode) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find({prefill, decode});
    if (it != sets_.end()) it->second.repairs_since_transfer = 0;
}

void KvPairPlan::WaitRepairsIdle() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return detached_ || (queue_.empty() && !repairing_); });
}

void KvPairPlan::RepairLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
        cv_.wait(lock, [&] { return detached_ || !queue_.empty(); });
        if (detached_) return;
        const SetKey key = queue_.front();
        queue_.pop_front();
        repairing_ = true;
        PairSet& set = sets_.at(key);
        set.queued = false;
        std::string told;
        const auto which = [&](const KvNcclPair& p) {
            return p.prefill_instance == key.first && p.decode_instance == key.second;
        };
        Result<uint64_t> first = ReplanLocked(which, "", &told);
        set.last_repair = std::chrono::steady_clock::now();
        set.repairs_since_transfer++;
        if (first.ok()) {
            repairs_++;
            spdlog::info(
                "KV pairs {} -> {} re-planned after a failure: new {} pair ids (transfers from "
                "id {} on), handed to instance(s) {}; re-plan {} since a transfer went through",
                key.first, key.second, KvPairLinkName(link_), *first, told,
                set.repairs_since_transfer);
        } else {
            spdlog::error(
                "kv_transfer.path: nccl: the KV pairs {} -> {} cannot be re-planned ({}); they "
                "stay down until the next failure report after {} ms",
                key.first, key.second, first.status().ToString(),
                RepairDelay(set.repairs_since_transfer).count());
        }
        repairing_ = false;
        cv_.notify_all();
    }
}

}  // namespace kvshard::cli
