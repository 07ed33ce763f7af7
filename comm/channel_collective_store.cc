// ChannelCollectiveStore (comm/collective_store.h): a worker's requests to the coordinator's
// rendezvous store over its registration channel.
#include <chrono>
#include <thread>
#include <variant>

#include "comm/collective_store.h"
#include "comm/control_messages.h"
#include "comm/frame_channel.h"

namespace kvshard {

using SteadyClock = std::chrono::steady_clock;

// ---- ChannelCollectiveStore ----

Result<std::optional<std::string>> ChannelCollectiveStore::Ask(bool set, const std::string& key,
                                                               const std::string& value,
                                                               SteadyClock::time_point deadline) {
    StoreRequestMessage request;
    request.set = set;
    request.key = key;
    request.value = value;
    KV_RETURN_IF_ERROR(channel_.Send(request).WithContext("collective store request"));
    Result<Message> answer = channel_.Receive(deadline);
    if (!answer.ok()) {
        return answer.status().WithContext("collective store: waiting for the coordinator");
    }
    const auto* reply = std::get_if<StoreReplyMessage>(&*answer);
    if (reply == nullptr) {
        std::string what(MessageTypeName(TypeOf(*answer)));
        if (const auto* shutdown = std::get_if<ShutdownMessage>(&*answer)) {
            what += ": " + shutdown->reason;
        }
        return Status(StatusCode::kUnavailable,
                      "collective store: expected StoreReply, the coordinator sent " + what);
    }
    if (!reply->error.empty()) {
        return Status(StatusCode::kInvalidArgument,
                      "collective store: the coordinator refused: " + reply->error);
    }
    if (!reply->found) return std::optional<std::string>();
    return std::optional<std::string>(reply->value);
}

Status ChannelCollectiveStore::Set(const std::string& key, const std::string& value) {
    KV_RETURN_IF_ERROR(CheckCollectiveStoreEntry(key, value));
    std::lock_guard<std::mutex> lock(mu_);
    // A Set is answered at once; the channel's own send timeout and heartbeats bound it.
    return Ask(true, key, value, SteadyClock::now() + std::chrono::seconds(30)).status();
}

Result<std::string> ChannelCollectiveStore::Get(const std::string& key,
                                                SteadyClock::time_point deadline) {
    KV_RETURN_IF_ERROR(CheckCollectiveStoreEntry(key, ""));
    std::lock_guard<std::mutex> lock(mu_);
    for (;;) {
        KV_ASSIGN_OR_RETURN(std::optional<std::string> value, Ask(false, key, "", deadline));
        if (value.has_value()) return std::move(*value);
        if (SteadyClock::now() >= deadline) {
            return Status(StatusCode::kDeadlineExceeded,
                          "collective store: key '" + key +
                              "' not set in time (another rank did not reach the coordinator)");
        }
        // Polling, not synchronization: the coordinator answers at once, set or not, so that
        // it never holds a request (the other ranks' keys arrive on other connections).
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

}  // namespace kvshard
