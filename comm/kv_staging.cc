#include "comm/kv_staging.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "comm/shm_region.h"

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
    if (options.max_staged_transfers <= 0) {
        return InvalidArgument("max_staged_transfers=" +
                               std::to_string(options.max_staged_transfers) + " must be > 0");
    }
    if (options.read_timeout_ms <= 0) {
        return InvalidArgument("read_timeout_ms=" + std::to_string(options.read_timeout_ms) +
                               " must be > 0");
    }
    if (options.idle_timeout_ms <= 0) {
        return InvalidArgument("idle_timeout_ms=" + std::to_string(options.idle_timeout_ms) +
                               " must be > 0");
    }
    if (options.max_connections <= 0) {
        return InvalidArgument("max_connections=" + std::to_string(options.max_connections) +
                               " must be > 0");
    }
    if (options.token.size() > kMaxKvTokenBytes) {
        return InvalidArgument("token of " + std::to_string(options.token.size()) +
                               " bytes exceeds " + std::to_string(kMaxKvTokenBytes));
    }
    if (options.shm_region_bytes < kMinKvShmRegionBytes ||
        options.shm_region_bytes > kMaxKvShmRegionBytes) {
        return InvalidArgument("shm_region_bytes=" + std::to_string(options.shm_region_bytes) +
                               " outside [" + std::to_string(kMinKvShmRegionBytes) + ", " +
                               std::to_string(kMaxKvShmRegionBytes) + "]");
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

Status KvStaging::Reserve(const KvPieceHeader& header) {
    const uint64_t id = header.transfer_id;
    const int64_t bytes = KvPieceBytes(header);
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = now_();
    DropStaleLocked(now);
    if (closed_) return Status(StatusCode::kUnavailable, "KV endpoint " + owner_ + " is closed");
    if (discarded_.count(id) != 0) {
        return Aborted(TransferText(id) + " was discarded (or went stale) at " + owner_);
    }
    if (geometry_.has_value()) KV_RETURN_IF_ERROR(ValidateKvPieceFits(header, *geometry_));
    const int64_t max_bytes = MaxBytesLocked();
    if (bytes > max_bytes) {
        return Status(StatusCode::kResourceExhausted,
                      "KV piece of " + std::to_string(bytes) + " bytes exceeds max_staged_bytes=" +
                          std::to_string(max_bytes) + " of " + owner_);
    }
    if (staged_bytes_ + reserved_bytes_ + bytes > max_bytes) {
        return Status(StatusCode::kResourceExhausted,
                      "KV staging of " + owner_ + " is full: " + std::to_string(staged_bytes_) +
                          " bytes staged + " + std::to_string(reserved_bytes_) + " arriving + " +
                          std::to_string(bytes) +
                          " > max_staged_bytes=" + std::to_string(max_bytes));
    }
    auto it = transfers_.find(id);
    if (it == transfers_.end()) {
        const int64_t max_transfers = MaxTransfersLocked();
        if (static_cast<int64_t>(transfers_.size()) >= max_transfers) {
            return Status(StatusCode::kResourceExhausted,
                          "KV staging of " + owner_ + " holds " +
                              std::to_string(transfers_.size()) +
                              " transfers, max_staged_transfers=" + std::to_string(max_transfers));
        }
        it = transfers_.emplace(id, Transfer{}).first;
    } else if (geometry_.has_value() &&
               it->second.bytes + it->second.reserved_bytes + bytes > geometry_bytes_) {
        // Distinct pieces of one transfer never add up to more than the whole pool.
        return Status(StatusCode::kResourceExhausted,
                      TransferText(id) + " at " + owner_ + " would exceed the pool's " +
                          std::to_string(geometry_bytes_) + " bytes");
    }
    it->second.reserved_bytes += bytes;
    it->second.last_arrival = now;
    reserved_bytes_ += bytes;
    return Status::Ok();
}

void KvStaging::Unreserve(const KvPieceHeader& header) {
    const int64_t bytes = KvPieceBytes(header);
    std::lock_guard<std::mutex> lock(mu_);
    reserved_bytes_ -= bytes;
    KV_CHECK(reserved_bytes_ >= 0) << reserved_bytes_;
    auto it = transfers_.find(header.transfer_id);
    if (it == transfers_.end()) return;  // discarded meanwhile
    it->second.reserved_bytes -= bytes;
    KV_CHECK(it->second.reserved_bytes >= 0) << it->second.reserved_bytes;
    if (it->second.pieces.empty() && it->second.reserved_bytes == 0) transfers_.erase(it);
}

Status KvStaging::Commit(KvPiece piece) {
    const int64_t bytes = static_cast<int64_t>(piece.data.size());
    const uint64_t id = piece.header.transfer_id;
    std::lock_guard<std::mutex> lock(mu_);
    reserved_bytes_ -= bytes;
    KV_CHECK(reserved_bytes_ >= 0) << reserved_bytes_;
    const Clock::time_point now = now_();
    auto it = transfers_.find(id);
    if (it != transfers_.end()) {
        it->second.reserved_bytes -= bytes;
        KV_CHECK(it->second.reserved_bytes >= 0) << it->second.reserved_bytes;
    }
    if (closed_) return Status(StatusCode::kUnavailable, "KV endpoint " + owner_ + " is closed");
    if (discarded_.count(id) != 0) {
        return Aborted(TransferText(id) + " was discarded (or went stale) at " + owner_);
    }
    // A Receive may have taken the transfer while this piece arrived (a resend whose first copy
    // completed it): staged anew, as any late piece, it goes stale unclaimed.
    if (it == transfers_.end()) it = transfers_.emplace(id, Transfer{}).first;
    Transfer& transfer = it->second;
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
    KV_RETURN_IF_ERROR(Reserve(piece.header));
    KvPiece copy;
    copy.header = piece.header;
    std::optional<std::vector<uint8_t>> pooled = TakePooledBuffer(piece.data.size());
    if (pooled.has_value()) {
        copy.data = std::move(*pooled);
        if (!piece.data.empty())
            std::memcpy(copy.data.data(), piece.data.data(), piece.data.size());
    } else {
        copy.data.assign(piece.data.begin(), piece.data.end());
    }
    return Commit(std::move(copy));
}

std::optional<std::vector<uint8_t>> KvStaging::TakePooledBuffer(size_t bytes) {
    std::vector<uint8_t> out;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pool_.lower_bound(bytes);
        if (it == pool_.end()) return std::nullopt;
        out = std::move(it->second);
        pooled_bytes_ -= static_cast<int64_t>(it->first);
        pool_.erase(it);
    }
    out.resize(bytes);  // within capacity: no allocation; zero-fills only what it never held
    return out;
}

void KvStaging::Recycle(std::vector<KvPiece> pieces) {
    std::vector<std::vector<uint8_t>> evicted;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t max_bytes = std::min(kMaxPooledBytes, MaxBytesLocked());
    for (KvPiece& piece : pieces) {
        const size_t capacity = piece.data.capacity();
        if (capacity == 0 || static_cast<int64_t>(capacity) > max_bytes) continue;
        pooled_bytes_ += static_cast<int64_t>(capacity);
        pool_.emplace(capacity, std::move(piece.data));
        // Over a limit: the smallest go first (a large buffer serves small pieces too).
        while (!pool_.empty() && (pool_.size() > kMaxPooledBuffers || pooled_bytes_ > max_bytes)) {
            pooled_bytes_ -= static_cast<int64_t>(pool_.begin()->first);
            evicted.push_back(std::move(pool_.begin()->second));
            pool_.erase(pool_.begin());
        }
    }
}

int64_t KvStaging::pooled_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pooled_bytes_;
}

Status KvStaging::SetGeometry(const KvReceiveGeometry& geometry) {
    KV_RETURN_IF_ERROR(ValidateKvReceiveGeometry(geometry).WithContext(owner_));
    std::lock_guard<std::mutex> lock(mu_);
    geometry_ = geometry;
    geometry_bytes_ = KvReceiveGeometryBytes(geometry);
    return Status::Ok();
}

int64_t KvStaging::MaxBytesLocked() const {
    return geometry_.has_value() ? std::min(options_.max_staged_bytes, geometry_bytes_)
                                 : options_.max_staged_bytes;
}

int64_t KvStaging::MaxTransfersLocked() const {
    return geometry_.has_value() ? std::min(options_.max_staged_transfers, geometry_->num_blocks)
                                 : options_.max_staged_transfers;
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

int64_t KvStaging::arriving_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reserved_bytes_;
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
        // A transfer with a piece mid-delivery is not stale: the transport's read deadline
        // bounds that delivery, and its Commit or Unreserve settles the transfer.
        if (now - it->second.last_arrival > stale_after && waiting_.count(it->first) == 0 &&
            it->second.reserved_bytes == 0) {
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
