#include "comm/collective_store.h"

namespace kvshard {

using Clock = std::chrono::steady_clock;

Status CheckCollectiveStoreEntry(const std::string& key, const std::string& value) {
    if (key.empty()) return InvalidArgument("collective store: empty key");
    if (key.size() > kMaxCollectiveStoreKeyBytes) {
        return Status(StatusCode::kResourceExhausted,
                      "collective store: key of " + std::to_string(key.size()) +
                          " bytes (at most " + std::to_string(kMaxCollectiveStoreKeyBytes) + ")");
    }
    if (value.size() > kMaxCollectiveStoreValueBytes) {
        return Status(StatusCode::kResourceExhausted,
                      "collective store: value of " + std::to_string(value.size()) +
                          " bytes for key '" + key + "' (at most " +
                          std::to_string(kMaxCollectiveStoreValueBytes) + ")");
    }
    return Status::Ok();
}

// ---- MemoryCollectiveStore ----

Status MemoryCollectiveStore::Set(const std::string& key, const std::string& value) {
    KV_RETURN_IF_ERROR(CheckCollectiveStoreEntry(key, value));
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (entries_.size() >= kMaxCollectiveStoreKeys && entries_.count(key) == 0) {
            return Status(StatusCode::kResourceExhausted,
                          "collective store: already " + std::to_string(entries_.size()) +
                              " keys (at most " + std::to_string(kMaxCollectiveStoreKeys) + ")");
        }
        entries_[key] = value;
    }
    cv_.notify_all();
    return Status::Ok();
}

Result<std::string> MemoryCollectiveStore::Get(const std::string& key, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return entries_.count(key) > 0; })) {
        return Status(StatusCode::kDeadlineExceeded,
                      "collective store: key '" + key + "' not set in time (a rank is missing)");
    }
    return entries_.at(key);
}

std::optional<std::string> MemoryCollectiveStore::Find(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return std::nullopt;
    return it->second;
}

size_t MemoryCollectiveStore::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size();
}

}  // namespace kvshard
