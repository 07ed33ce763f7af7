// CollectiveStore: the key-value store the ranks of a Gloo group (CollectiveConfig::Kind::kGloo,
// comm/gloo_collective.cc) meet in before they connect to each other: each rank sets one key
// (its TCP pairs' addresses) and reads every other rank's. Two implementations:
//
//   MemoryCollectiveStore   in this process: the coordinator's side of a rendezvous (one per
//                           instance formation, served over the registration channel), and the
//                           threads of a test.
//   ChannelCollectiveStore  a worker process's view of its coordinator's store, through the
//                           registration channel (StoreRequest / StoreReply, comm/
//                           control_messages.h), between RegisterAck and Ready.
//
// Bounds: a key holds at most kMaxCollectiveStoreKeyBytes bytes, a value
// kMaxCollectiveStoreValueBytes, a store kMaxCollectiveStoreKeys keys; more is refused
// (ResourceExhausted naming the limit), so a peer cannot make the coordinator allocate without
// bound.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "common/status.h"

namespace kvshard {

class FrameChannel;

inline constexpr size_t kMaxCollectiveStoreKeyBytes = 256;
inline constexpr size_t kMaxCollectiveStoreValueBytes = 64 * 1024;
inline constexpr size_t kMaxCollectiveStoreKeys = 1'024;

// Thread-safety: implementations may be called from any thread.
class CollectiveStore {
  public:
    virtual ~CollectiveStore() = default;
    // Sets `key` to `value`; a later Set of the same key replaces it.
    virtual Status Set(const std::string& key, const std::string& value) = 0;
    // The value of `key`, waiting until some rank sets it: DeadlineExceeded naming the key when
    // none did by `deadline`.
    virtual Result<std::string> Get(const std::string& key,
                                    std::chrono::steady_clock::time_point deadline) = 0;
};

// InvalidArgument / ResourceExhausted for a key or value outside the bounds above, else OK.
Status CheckCollectiveStoreEntry(const std::string& key, const std::string& value);

class MemoryCollectiveStore final : public CollectiveStore {
  public:
    Status Set(const std::string& key, const std::string& value) override;
    Result<std::string> Get(const std::string& key,
                            std::chrono::steady_clock::time_point deadline) override;
    // The value of `key` if set, without waiting.
    std::optional<std::string> Find(const std::string& key) const;
    size_t size() const;

  private:
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::map<std::string, std::string> entries_;  // guarded by mu_
};

// Forwards to the coordinator over `channel`, one request and one reply at a time; a Get whose
// key is not set yet asks again every few milliseconds until the deadline. Any other message on
// the channel (a Shutdown) or a closed channel ends the call with an error.
// Ownership: `channel` is not owned and must outlive the store. Thread-safety: one caller at a
// time, and nobody else receives on the channel meanwhile.
class ChannelCollectiveStore final : public CollectiveStore {
  public:
    explicit ChannelCollectiveStore(FrameChannel& channel) : channel_(channel) {}
    Status Set(const std::string& key, const std::string& value) override;
    Result<std::string> Get(const std::string& key,
                            std::chrono::steady_clock::time_point deadline) override;

  private:
    // One round trip: the reply's value, nullopt when the key is not set.
    Result<std::optional<std::string>> Ask(bool set, const std::string& key,
                                           const std::string& value,
                                           std::chrono::steady_clock::time_point deadline);
    FrameChannel& channel_;
    std::mutex mu_;
};

}  // namespace kvshard
