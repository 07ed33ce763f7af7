// The wire format of process mode: every message (comm/control_messages.h) travels as one frame.
//
//   offset  size  field
//        0     4  magic "KVSF"
//        4     2  version (kWireVersion), little-endian
//        6     2  message type (MessageType), little-endian
//        8     4  payload length in bytes, little-endian
//       12     4  CRC-32 (IEEE 802.3, as zlib) of the payload, little-endian
//       16     n  payload
//
// Payload: the message's fields in declaration order, fixed-width little-endian integers, floats
// as their IEEE-754 bits, bools as one byte 0 or 1, strings and vectors as a u32 element count
// followed by the elements. Nothing is optional and nothing may follow the last field.
//
// Decoding is total: a truncated, oversized, wrong-version, wrong-type, wrong-CRC or otherwise
// malformed frame returns an error Status naming what is wrong; it never crashes and never
// reserves memory for more elements than the remaining bytes can hold (decoded memory stays
// below 8 times the frame length: a list of empty strings, 4 bytes each on the wire, is the
// worst case).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "comm/control_messages.h"
#include "common/status.h"

namespace kvshard {

enum class MessageType : uint16_t {
    kStepPlan = 1,
    kStepResult = 2,
    kRegister = 3,
    kRegisterAck = 4,
    kHeartbeat = 5,
    kShutdown = 6,
    kReady = 7,
    kStoreRequest = 8,
    kStoreReply = 9,
    kRankSettings = 10,
};

std::string_view MessageTypeName(MessageType type);
MessageType TypeOf(const Message& message);

inline constexpr std::string_view kFrameMagic = "KVSF";
// 2: KV transfer ops (StepPlan.kv_recvs/kv_sends, StepResult transfer fields), Register's
// kv_endpoint, the Ready message. 3: Register's token. Later changes of a message's fields
// bump kControlProtocolVersion (comm/control_messages.h) only: Register keeps its encoding, so
// a worker of another version is refused by the registry with both versions named.
inline constexpr uint16_t kWireVersion = 3;
inline constexpr size_t kFrameHeaderBytes = 16;
inline constexpr uint32_t kDefaultMaxFramePayloadBytes = 64u << 20;

struct FrameHeader {
    uint16_t version = kWireVersion;
    MessageType type = MessageType::kHeartbeat;
    uint32_t payload_bytes = 0;
    uint32_t payload_crc32 = 0;
};

// The whole frame, header and payload. REQUIRES: every vector and string has < 2^32 elements.
std::string EncodeFrame(const Message& message);

// Checks the first kFrameHeaderBytes of a frame: magic, version, a known type and a payload of
// at most max_payload_bytes (so a reader may allocate payload_bytes after this succeeds).
// Errors: DataLoss (not a frame), Unimplemented (another version), ResourceExhausted (too big).
Result<FrameHeader> DecodeFrameHeader(std::string_view header,
                                      uint32_t max_payload_bytes = kDefaultMaxFramePayloadBytes);

// Checks the payload's length and CRC against `header` and decodes it (DataLoss when malformed).
Result<Message> DecodePayload(const FrameHeader& header, std::string_view payload);

// DecodeFrameHeader + DecodePayload over exactly one frame.
Result<Message> DecodeFrame(std::string_view frame,
                            uint32_t max_payload_bytes = kDefaultMaxFramePayloadBytes);

// CRC-32 (IEEE, reflected, as zlib's crc32): Crc32("123456789") == 0xCBF43926.
uint32_t Crc32(std::string_view bytes);

}  // namespace kvshard
