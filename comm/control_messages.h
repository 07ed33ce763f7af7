// The control messages of process mode, besides StepPlan and StepResult (comm/step_plan.h): a
// worker process registers with the coordinator, the coordinator accepts it (or says why not) and
// tells it what to load, the worker says when it is Ready, both sides send heartbeats, and the
// coordinator ends a worker with Shutdown. Plain structs; comm/plan_codec.h puts them on the wire.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "comm/step_plan.h"

namespace kvshard {

// Bumped whenever a message's encoding changes; both sides must speak the same version.
// 2: RegisterMessage.kv_endpoint, ReadyMessage, KV transfer ops in StepPlan and StepResult.
// 3: RegisterMessage.token.
inline constexpr uint32_t kControlProtocolVersion = 3;

// Worker -> coordinator, the first frame on a new connection.
struct RegisterMessage {
    int32_t worker_rank = 0;  // rank within its instance
    int32_t tp = 1;           // the instance's tensor-parallel size as the worker was told
    std::string instance_id;
    uint32_t protocol_version = kControlProtocolVersion;
    // Where this rank's KvTransport (comm/kv_transport.h) receives KV pieces ("HOST:PORT"); ""
    // when it has none.
    std::string kv_endpoint;
    // The registry's shared secret (workers.token; KVSHARD_WORKER_TOKEN in the worker's
    // environment). Sent as it is: the control channel is not encrypted, so whoever can read it
    // already reads the prompts; the token keeps those who can only reach the port from taking
    // a rank. The registry compares it in constant time.
    std::string token;
    friend bool operator==(const RegisterMessage&, const RegisterMessage&) = default;
};

// Coordinator -> worker, the answer to RegisterMessage.
struct RegisterAckMessage {
    bool accepted = false;
    std::string error;  // why not, when !accepted
    std::string model_path;
    int32_t tp = 1;
    // Block settings and anything else the worker needs (block_size, num_blocks, kv_dtype,
    // nccl_unique_id, ...), as key/value pairs; values are arbitrary bytes.
    std::vector<std::pair<std::string, std::string>> settings;
    friend bool operator==(const RegisterAckMessage&, const RegisterAckMessage&) = default;
};

// Worker -> coordinator, once, after RegisterAck: the worker loaded its shard and built its KV
// pool (ok), or could not (error says why; the worker exits after sending it).
struct ReadyMessage {
    bool ok = false;
    std::string error;
    int64_t num_kv_blocks = 0;  // blocks of the pool it built
    friend bool operator==(const ReadyMessage&, const ReadyMessage&) = default;
};

// Either direction; any frame proves the peer alive, heartbeats do so while it has nothing to say.
struct HeartbeatMessage {
    uint64_t sequence = 0;
    friend bool operator==(const HeartbeatMessage&, const HeartbeatMessage&) = default;
};

// Coordinator -> worker: finish and exit.
struct ShutdownMessage {
    std::string reason;
    friend bool operator==(const ShutdownMessage&, const ShutdownMessage&) = default;
};

// Everything that travels in a frame. The index of each alternative is not its wire type (see
// MessageType in comm/plan_codec.h).
using Message = std::variant<StepPlan, StepResult, RegisterMessage, RegisterAckMessage,
                             HeartbeatMessage, ShutdownMessage, ReadyMessage>;

}  // namespace kvshard
