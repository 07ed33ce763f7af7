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
// 4: SamplingParams' logit controls (penalties, logit_bias, min_tokens), ScheduledSequence.history.
// 5: rank and tp may be left to the coordinator (RegisterMessage kAnyRank / kAnyTp, and
//    RegisterAckMessage.rank), RegisterMessage.model, StoreRequest/StoreReply (the collective's
//    rendezvous).
// 6: ScheduledSequence.allowed_tokens (structured outputs' token mask).
// 7: StepResult.error_code (a failed step's Status code travels with its message).
// 8: ScheduledSequence.num_prompt_logprobs / next_prompt_token, StepResult.prompt_logprobs.
// 9: KV cache groups: ScheduledSequence.group_block_tables / group_slot_mappings,
//    KvSendOp/KvRecvOp.group_block_tables; kv::CopyOp is StepPlan's block copy.
// 10: TransferFailure carries a Status code before its message, as StepResult's error does.
// 11: StepPlan.kv_discards and kv_ready, KvSendOp.dst_instance, KvRecvOp.src_instance (the KV
//     pair path).
// 12: RankSettingsMessage (a Ready rank's per-rank settings changed: the KV pair path's pairs
//     re-planned after another instance re-formed).
// 13: TransferFailure.pairs_down and pairs_first_transfer (the coordinator re-plans a pair set
//     that failed without a re-form).
inline constexpr uint32_t kControlProtocolVersion = 13;

// RegisterMessage.worker_rank: the coordinator assigns the lowest free rank.
inline constexpr int32_t kAnyRank = -1;
// RegisterMessage.tp: the worker takes the instance's tp from the coordinator.
inline constexpr int32_t kAnyTp = 0;

// Worker -> coordinator, the first frame on a new connection.
struct RegisterMessage {
    int32_t worker_rank = 0;  // rank within its instance, or kAnyRank
    int32_t tp = 1;           // the instance's tp as the worker was told, or kAnyTp
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
    // The model the worker expects to serve (its --model), or "" for whatever the coordinator
    // says. A path must equal the instance's model path; a bare file name, the path's last part.
    std::string model = {};
    friend bool operator==(const RegisterMessage&, const RegisterMessage&) = default;
};

// Coordinator -> worker, the answer to RegisterMessage.
struct RegisterAckMessage {
    bool accepted = false;
    std::string error;  // why not, when !accepted
    std::string model_path;
    int32_t tp = 1;
    // Block settings and anything else the worker needs (block_size, num_blocks, kv_dtype, the
    // collective's bootstrap: nccl_unique_id, ...), as key/value pairs; values are arbitrary
    // bytes.
    std::vector<std::pair<std::string, std::string>> settings;
    // The worker's rank: the one it asked for, or the one the coordinator assigned (kAnyRank).
    int32_t rank = 0;
    friend bool operator==(const RegisterAckMessage&, const RegisterAckMessage&) = default;
};

// Worker -> coordinator, between RegisterAck and Ready: one operation on the instance's
// rendezvous store (comm/collective_store.h), in which the ranks of a Gloo group exchange their
// addresses. Each formation of an instance has a store of its own.
struct StoreRequestMessage {
    bool set = false;  // true: set key to value; false: get key
    std::string key;
    std::string value;
    friend bool operator==(const StoreRequestMessage&, const StoreRequestMessage&) = default;
};

// Coordinator -> worker, the answer to each StoreRequest, at once: a get of a key no rank has
// set yet answers found = false (the worker asks again).
struct StoreReplyMessage {
    bool found = false;
    std::string value;
    std::string error;  // non-empty: the request was refused (a bound, see collective_store.h)
    friend bool operator==(const StoreReplyMessage&, const StoreReplyMessage&) = default;
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

// Coordinator -> worker, between steps, to a rank that reported Ready: its per-rank settings
// (RemoteInstanceOptions::rank_settings, the part of RegisterAck.settings that differs between
// ranks) as they are now. Sent when the coordinator re-planned them after another instance
// re-formed: the KV pair path's new pairs (worker/kv_handoff_pairs.h KvPairHandoff::Replan).
struct RankSettingsMessage {
    std::vector<std::pair<std::string, std::string>> settings;
    friend bool operator==(const RankSettingsMessage&, const RankSettingsMessage&) = default;
};

// Everything that travels in a frame. The index of each alternative is not its wire type (see
// MessageType in comm/plan_codec.h).
using Message = std::variant<StepPlan, StepResult, RegisterMessage, RegisterAckMessage,
                             HeartbeatMessage, ShutdownMessage, ReadyMessage, StoreRequestMessage,
                             StoreReplyMessage, RankSettingsMessage>;

}  // namespace kvshard
