#include "comm/kv_staging.h"

#include <utility>

namespace kvshard::internal {

namespace {

// Discarded transfer ids remembered at most (each also for stale_after_ms at most): enough for
// every transfer a receiver cancels within that time at any plausible rate, and a bound on the
// memory a stream of cancellations can take.
constexpr size_t kMaxRememberedDiscards = 65'536;

std::string TransferText(uint64_t transfer_id) { return "transfer " + std::to_string(transfer_id); }

}  // namespace

Status ValidateKvTransportOptions(const KvTransportOptions& options) {
    if (options.max_staged_bytes <= 0) {
        return InvalidArgument("max_staged_bytes=" + std::to_string(options.max_staged_bytes) +
                               " must be > 0");
    }
    if (options.stale_after_ms <= 0) {
        return InvalidArgument("stale_after_ms=" + std::to_string(options.stale_after_ms) +
                               " must be > 0");
    }
    return Status::Ok();
}

int64_t KvPieceCells(const KvPieceHeader& h) {
    return (int64_t{h.layer_end} - h.layer_begin) * (int64_t{h.head_end} - h.head_begin);
}

KvStaging::KvStaging(const KvTransportOptions& options, std::string owner,
                     std::function<Clock::time_point()> now)
    : options_(options), owner_(std::move(owner)), now_(std::move(now)) {}

Status KvStaging::Reserve(uint64_t transfer_id, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    DropStaleLocked(now_());
    if (closed_) return Status(StatusCode::kUnavailable, "KV endpoint " + owner_ + " is closed");
    if (discarded_.count(transfer_id) != 0) {
        return Aborted(TransferText(transfer_id) + " was discarded (or went stale) at " + owner_);
    }
    if (bytes > options_.max_staged_bytes) {
        return Status(StatusCode::kResourceExhausted,
                      "KV piece of " + std::to_string(bytes) + " bytes exceeds max_staged_bytes=" +
                          std::to_string(options_.max_staged_bytes) + " of " + owner_);
    }
    if (staged_bytes_ + reserved_bytes_ + bytes > options_.max_staged_bytes) {
        return Status(StatusCode::kResourceExhausted,
                      "KV staging of " + owner_ + " is full: " + std::to_string(staged_bytes_) +
                          " bytes staged + " + std::to_string(reserved_bytes_) + " arriving + " +
                          std::to_string(bytes) +
                          " > max_staged_bytes=" + std::to_string(options_.max_staged_bytes));
    }
    reserved_bytes_ += bytes;
    return Status::Ok();
}

void KvStaging::Unreserve(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_bytes_ -= bytes;
    KV_CHECK(reserved_bytes_ >= 0) << reserved_bytes_;
}

Status KvStaging::Commit(KvPiece piece) {
    const int64_t bytes = static_cast<int64_t>(piece.data.size());
    const uint64_t id = piece.header.transfer_id;
    std::lock_guard<std::mutex> lock(mu_);
    reserved_bytes_ -= bytes;
    KV_CHECK(reserved_bytes_ >= 0) << reserved_bytes_;
    const Clock::time_point now = now_();
    if (closed_) return Status(StatusCode::kUnavailable, "KV endpoint " + owner_ + " is closed");
    if (discarded_.count(id) != 0) {
        return Aborted(TransferText(id) + " was discarded (or went stale) at " + owner_);
    }
    Transfer& transfer = transfers_[id];
    transfer.last_arrival = now;
    const KvPieceHeader& h = piece.header;
    for (const KvPiece& staged : transfer.pieces) {
        const KvPieceHeader& s = staged.header;
        if (s.layer_begin == h.layer_begin && s.layer_end == h.layer_end &&
            s.head_begin == h.head_begin && s.head_end == h.head_end) {
            return Status::Ok();  // a resend after a lost acknowledgement
        }
    }
    transfer.cells += KvPieceCells(h);
    transfer.bytes += bytes;
    staged_bytes_ += bytes;
    transfer.pieces.push_back(std::move(piece));
    arrived_.notify_all();
    return Status::Ok();
}

Status KvStaging::StageCopy(const KvPiece& piece) {
    const int64_t bytes = static_cast<int64_t>(piece.data.size());
    KV_RETURN_IF_ERROR(Reserve(piece.header.transfer_id, bytes));
    return Commit(piece);
}

Result<std::vector<KvPiece>> KvStaging::Receive(uint64_t transfer_id, int64_t expected_cells,
                                                Clock::time_point deadline) {
    if (expected_cells <= 0) {
        return InvalidArgument("Receive of " + TransferText(transfer_id) + ": expected_cells=" +
                               std::to_string(expected_cells) + " must be > 0");
    }
    std::unique_lock<std::mutex> lock(mu_);
    DropStaleLocked(now_());
    ++waiting_[transfer_id];
    const auto complete = [&] {
        auto it = transfers_.find(transfer_id);
        return it != transfers_.end() && it->second.cells >= expected_cells;
    };
    arrived_.wait_until(lock, deadline, [&] {
        return complete() || discarded_.count(transfer_id) != 0 || closed_;
    });
    if (--waiting_[transfer_id] == 0) waiting_.erase(transfer_id);
    if (complete()) {
        auto it = transfers_.find(transfer_id);
        std::vector<KvPiece> pieces = std::move(it->second.pieces);
        staged_bytes_ -= it->second.bytes;
        transfers_.erase(it);
        return pieces;
    }
    if (discarded_.count(transfer_id) != 0) {
        return Aborted(TransferText(transfer_id) + " was discarded (or went stale) at " + owner_);
    }
    if (closed_) return Status(StatusCode::kUnavailable, "KV endpoint " + owner_ + " is closed");
    auto it = transfers_.find(transfer_id);
    const int64_t cells = it == transfers_.end() ? 0 : it->second.cells;
    const size_t pieces = it == transfers_.end() ? 0 : it->second.pieces.size();
    return Status(StatusCode::kDeadlineExceeded,
                  TransferText(transfer_id) + " incomplete at " + owner_ + " by the deadline: " +
                      std::to_string(cells) + " of " + std::to_string(expected_cells) +
                      " cells (layers x heads) staged in " + std::to_string(pieces) + " pieces");
}

void KvStaging::Discard(uint64_t transfer_id) {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = now_();
    DropStaleLocked(now);
    auto it = transfers_.find(transfer_id);
    if (it != transfers_.end()) {
        staged_bytes_ -= it->second.bytes;
        transfers_.erase(it);
    }
    RememberDiscardLocked(transfer_id, now);
    arrived_.notify_all();  // a Receive waiting for it returns Aborted
}

int64_t KvStaging::staged_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    // Reading the count also drops stale transfers, so that it never reports abandoned bytes
    // (logically const: nothing a caller could still take is removed).
    const_cast<KvStaging*>(this)->DropStaleLocked(now_());
    return staged_bytes_;
}

void KvStaging::Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    arrived_.notify_all();
}

void KvStaging::DropStaleLocked(Clock::time_point now) {
    const auto stale_after = std::chrono::milliseconds(options_.stale_after_ms);
    for (auto it = transfers_.begin(); it != transfers_.end();) {
        if (now - it->second.last_arrival > stale_after && waiting_.count(it->first) == 0) {
            staged_bytes_ -= it->second.bytes;
            RememberDiscardLocked(it->first, now);
            it = transfers_.erase(it);
        } else {
            ++it;
        }
    }
    while (!discarded_order_.empty() && (discarded_order_.size() > kMaxRememberedDiscards ||
                                         now - discarded_order_.front().second > stale_after)) {
        discarded_.erase(discarded_order_.front().first);
        discarded_order_.pop_front();
    }
}

void KvStaging::RememberDiscardLocked(uint64_t transfer_id, Clock::time_point now) {
    if (discarded_.insert(transfer_id).second) discarded_order_.emplace_back(transfer_id, now);
}

}  // namespace kvshard::internal
