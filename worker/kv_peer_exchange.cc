#include "worker/kv_peer_exchange.h"

#include <algorithm>

namespace kvshard {

KvPeerExchange::Registration::~Registration() {
    std::lock_guard<std::mutex> lock(rank_->mu);  // a copy in progress holds it
    rank_->alive = false;
}

std::unique_ptr<KvPeerExchange::Registration> KvPeerExchange::RegisterSource(
    Backend& backend, const KvPool& pool, const ShardLayout& layout) {
    auto rank = std::make_shared<KvPeerRank>();
    rank->backend = &backend;
    rank->pool = &pool;
    rank->layout = layout;
    return std::make_unique<Registration>(std::move(rank));
}

void KvPeerExchange::DropStale(Clock::time_point now) {
    const auto limit = std::chrono::milliseconds(options_.stale_after_ms);
    for (auto& [endpoint, list] : waiting_) {
        std::erase_if(list, [&](const Waiting& w) { return now - w.posted > limit; });
    }
    std::erase_if(discarded_, [&](const auto& d) { return now - d.second > limit; });
}

Status KvPeerExchange::Post(const std::string& dst_endpoint, KvPeerSource source) {
    if (source.rank == nullptr) return InvalidArgument("KV peer handoff: a source without a rank");
    const Clock::time_point now = Clock::now();
    {
        std::lock_guard<std::mutex> lock(mu_);
        DropStale(now);
        if (discarded_.count({dst_endpoint, source.transfer_id}) > 0) {
            return Status(StatusCode::kAborted, "KV peer handoff: transfer " +
                                                    std::to_string(source.transfer_id) +
                                                    " was discarded at " + dst_endpoint);
        }
        std::vector<Waiting>& list = waiting_[dst_endpoint];
        if (static_cast<int64_t>(list.size()) >= options_.max_sources) {
            return Status(StatusCode::kResourceExhausted,
                          "KV peer handoff: " + std::to_string(list.size()) +
                              " sources already wait for " + dst_endpoint);
        }
        list.push_back({std::move(source), now});
    }
    cv_.notify_all();
    return Status::Ok();
}

Result<std::vector<KvPeerSource>> KvPeerExchange::Take(const std::string& endpoint,
                                                       uint64_t transfer_id, int64_t expected_cells,
                                                       Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    auto covered = [&] {
        int64_t cells = 0;
        for (const Waiting& w : waiting_[endpoint]) {
            if (w.source.transfer_id == transfer_id) cells += w.source.cells;
        }
        return cells;
    };
    int64_t cells = covered();
    while (cells < expected_cells) {
        if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
            cells = covered();
            if (cells >= expected_cells) break;
            return Status(StatusCode::kDeadlineExceeded,
                          "KV peer handoff: transfer " + std::to_string(transfer_id) + ": " +
                              std::to_string(cells) + " of " + std::to_string(expected_cells) +
                              " layer-heads posted by the deadline");
        }
        cells = covered();
    }
    std::vector<KvPeerSource> out;
    std::vector<Waiting>& list = waiting_[endpoint];
    for (Waiting& w : list) {
        if (w.source.transfer_id == transfer_id) out.push_back(std::move(w.source));
    }
    std::erase_if(list, [&](const Waiting& w) { return w.source.transfer_id == transfer_id; });
    return out;
}

void KvPeerExchange::Discard(const std::string& endpoint, uint64_t transfer_id) {
    std::lock_guard<std::mutex> lock(mu_);
    DropStale(Clock::now());
    auto it = waiting_.find(endpoint);
    if (it != waiting_.end()) {
        std::erase_if(it->second,
                      [&](const Waiting& w) { return w.source.transfer_id == transfer_id; });
    }
    discarded_[{endpoint, transfer_id}] = Clock::now();
}

int64_t KvPeerExchange::num_waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [endpoint, list] : waiting_) n += static_cast<int64_t>(list.size());
    return n;
}

}  // namespace kvshard
