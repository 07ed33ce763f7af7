// KvPairSender and KvPairReceiver (comm/kv_pair_protocol.h).
#include "comm/kv_pair_protocol.h"

#include <limits>
#include <string>
#include <utility>

namespace kvshard {

namespace {

std::string Named(uint64_t transfer_id) {
    return "KV pair transfer " + std::to_string(transfer_id);
}

}  // namespace

Result<size_t> KvPairTransferBytes(const KvPairTransfer& t) {
    if (t.num_blocks <= 0 || t.bytes_per_block <= 0) {
        return InvalidArgument(
            Named(t.transfer_id) + ": num_blocks=" + std::to_string(t.num_blocks) +
            ", bytes_per_block=" + std::to_string(t.bytes_per_block) + " must both be > 0");
    }
    const auto blocks = static_cast<uint64_t>(t.num_blocks);
    const auto per_block = static_cast<uint64_t>(t.bytes_per_block);
    if (blocks > std::numeric_limits<size_t>::max() / per_block) {
        return InvalidArgument(Named(t.transfer_id) + ": " + std::to_string(t.num_blocks) +
                               " blocks of " + std::to_string(t.bytes_per_block) +
                               " bytes overflow a size");
    }
    return static_cast<size_t>(blocks * per_block);
}

// ---- KvPairSender ----

KvPairSender::KvPairSender(KvPairChannel* channel, int64_t timeout_ms, int64_t max_offers)
    : channel_(channel), timeout_ms_(timeout_ms), max_offers_(max_offers) {
    thread_ = std::thread([this] { Run(); });
}

KvPairSender::~KvPairSender() {
    std::vector<Offered> ended;
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
        ended = FailLocked(Aborted("KV pair sender closed"));
    }
    cv_.notify_all();
    channel_->Abort(Aborted("KV pair sender closed"));
    thread_.join();
    for (Offered& offer : ended) offer.done(Aborted("KV pair sender closed"));
}

std::vector<KvPairSender::Offered> KvPairSender::FailLocked(const Status& why) {
    if (failure_.ok()) failure_ = why;
    std::vector<Offered> ended;
    for (auto& [id, offer] : offers_) ended.push_back(std::move(offer));
    offers_.clear();
    ready_.clear();
    return ended;
}

Status KvPairSender::Offer(const KvPairTransfer& t, const void* src, Done done) {
    KV_RETURN_IF_ERROR(KvPairTransferBytes(t).status());
    if (src == nullptr) return InvalidArgument(Named(t.transfer_id) + ": null source");
    if (!done) return InvalidArgument(Named(t.transfer_id) + ": no done callback");
    std::lock_guard lock(mu_);
    if (!failure_.ok()) return failure_;
    if (offers_.count(t.transfer_id) != 0) {
        return InvalidArgument(Named(t.transfer_id) + ": offered twice");
    }
    if (static_cast<int64_t>(offers_.size()) >= max_offers_) {
        return Status(StatusCode::kResourceExhausted,
                      Named(t.transfer_id) + ": " + std::to_string(offers_.size()) +
                          " transfers already held on this pair (the most)");
    }
    offers_.emplace(t.transfer_id, Offered{t, src, std::move(done), false});
    return Status::Ok();
}

Status KvPairSender::Ready(uint64_t transfer_id) {
    std::vector<Offered> ended;
    Status failed;
    {
        std::lock_guard lock(mu_);
        if (!failure_.ok()) return failure_;
        auto it = offers_.find(transfer_id);
        if (it != offers_.end() && !it->second.ready) {
            it->second.ready = true;
            ready_.push_back(transfer_id);
            cv_.notify_all();
            return Status::Ok();
        }
        // The decode side is about to post a receive that no send of ours will match: the pair's
        // order is lost, so it fails (the receive ends at its deadline).
        failed = Aborted(Named(transfer_id) + ": ready for a transfer this sender " +
                         (it == offers_.end() ? "does not hold" : "was already told about") +
                         "; pair failed");
        ended = FailLocked(failed);
    }
    channel_->Abort(failed);
    for (Offered& offer : ended) offer.done(failed);
    return failed;
}

Status KvPairSender::Discard(uint64_t transfer_id) {
    Offered discarded;
    {
        std::lock_guard lock(mu_);
        auto it = offers_.find(transfer_id);
        if (it == offers_.end()) return InvalidArgument(Named(transfer_id) + ": not held");
        if (it->second.ready) {
            return InvalidArgument(Named(transfer_id) + ": already announced ready; it is sent");
        }
        discarded = std::move(it->second);
        offers_.erase(it);
    }
    discarded.done(Aborted(Named(transfer_id) + ": discarded by the decode side"));
    return Status::Ok();
}

Status KvPairSender::failure() const {
    std::lock_guard lock(mu_);
    return failure_;
}

int64_t KvPairSender::held() const {
    std::lock_guard lock(mu_);
    return static_cast<int64_t>(offers_.size());
}

void KvPairSender::Run() {
    for (;;) {
        Offered offer;
        {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return stopping_ || !ready_.empty(); });
            if (stopping_) return;
            const uint64_t id = ready_.front();
            ready_.pop_front();
            auto it = offers_.find(id);
            // Ready() queued it and only a failure (which clears both) takes a readied offer out.
            offer = std::move(it->second);
            offers_.erase(it);
        }
        const size_t bytes = *KvPairTransferBytes(offer.transfer);
        const Status sent = channel_->Send(
            offer.src, bytes, KvPairChannel::Clock::now() + std::chrono::milliseconds(timeout_ms_));
        if (sent.ok()) {
            offer.done(sent);
            continue;
        }
        std::vector<Offered> ended;
        {
            std::lock_guard lock(mu_);
            ended = FailLocked(sent);
        }
        channel_->Abort(sent);
        offer.done(sent);
        for (Offered& other : ended) other.done(sent);
    }
}

// ---- KvPairReceiver ----

KvPairReceiver::KvPairReceiver(KvPairChannel* channel, KvPairReceiveLimits limits,
                               AnnounceReady announce, int64_t timeout_ms)
    : channel_(channel), limits_(limits), announce_(std::move(announce)), timeout_ms_(timeout_ms) {}

Status KvPairReceiver::Receive(const KvPairTransfer& t, void* dst, size_t dst_bytes) {
    if (!failure_.ok()) return failure_;
    KV_ASSIGN_OR_RETURN(const size_t bytes, KvPairTransferBytes(t));
    if (t.num_blocks > limits_.max_blocks) {
        return InvalidArgument(
            Named(t.transfer_id) + ": num_blocks=" + std::to_string(t.num_blocks) +
            " is more than this pool takes (" + std::to_string(limits_.max_blocks) + ")");
    }
    if (t.bytes_per_block != limits_.bytes_per_block) {
        return InvalidArgument(Named(t.transfer_id) +
                               ": bytes_per_block=" + std::to_string(t.bytes_per_block) +
                               " is not this pool's " + std::to_string(limits_.bytes_per_block));
    }
    if (dst == nullptr || dst_bytes < bytes) {
        return InvalidArgument(Named(t.transfer_id) + ": destination of " +
                               std::to_string(dst == nullptr ? 0 : dst_bytes) + " bytes for " +
                               std::to_string(bytes));
    }
    if (any_announced_ && t.transfer_id <= last_announced_) {
        return InvalidArgument(Named(t.transfer_id) + ": not after the last one announced (" +
                               std::to_string(last_announced_) + ")");
    }
    any_announced_ = true;
    last_announced_ = t.transfer_id;
    if (Status announced = announce_(t.transfer_id); !announced.ok()) {
        failure_ = Aborted(Named(t.transfer_id) + ": announcing ready failed (" +
                           announced.ToString() + "); pair failed");
        channel_->Abort(failure_);
        return failure_;
    }
    const Status received = channel_->Recv(
        dst, bytes, KvPairChannel::Clock::now() + std::chrono::milliseconds(timeout_ms_));
    if (!received.ok()) {
        failure_ = received;
        channel_->Abort(received);
    }
    return received;
}

}  // namespace kvshard
