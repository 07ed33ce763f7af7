#include "comm/plan_codec.h"

#include <zlib.h>

#include <algorithm>

#include "comm/step_codec.h"
#include "comm/wire_fields.h"
#include "common/check.h"

namespace kvshard {
namespace {

// ---- encoding ----

// Writer and Reader: comm/wire_fields.h; StepPlan and StepResult: comm/step_codec.cc.
using wire::Reader;
using wire::Writer;

void Encode(Writer& w, const StepPlan& plan) { EncodeStepPlan(w, plan); }

void Encode(Writer& w, const StepResult& result) { EncodeStepResult(w, result); }

void Encode(Writer& w, const RegisterMessage& m) {
    w.Fixed(m.worker_rank);
    w.Fixed(m.tp);
    w.String(m.instance_id);
    w.Fixed(m.protocol_version);
    w.String(m.kv_endpoint);
    w.String(m.token);
    w.String(m.model);
}

void EncodeSettings(Writer& w, const std::vector<std::pair<std::string, std::string>>& settings) {
    w.Count(settings.size());
    for (const auto& [key, value] : settings) {
        w.String(key);
        w.String(value);
    }
}

void Encode(Writer& w, const RegisterAckMessage& m) {
    w.Bool(m.accepted);
    w.String(m.error);
    w.String(m.model_path);
    w.Fixed(m.tp);
    EncodeSettings(w, m.settings);
    w.Fixed(m.rank);
}

void Encode(Writer& w, const HeartbeatMessage& m) { w.Fixed(m.sequence); }

void Encode(Writer& w, const ShutdownMessage& m) { w.String(m.reason); }

void Encode(Writer& w, const ReadyMessage& m) {
    w.Bool(m.ok);
    w.String(m.error);
    w.Fixed(m.num_kv_blocks);
}

void Encode(Writer& w, const StoreRequestMessage& m) {
    w.Bool(m.set);
    w.String(m.key);
    w.String(m.value);
}

void Encode(Writer& w, const StoreReplyMessage& m) {
    w.Bool(m.found);
    w.String(m.value);
    w.String(m.error);
}

void Encode(Writer& w, const RankSettingsMessage& m) { EncodeSettings(w, m.settings); }

// ---- decoding ----

// RegisterAck's settings at most.
constexpr uint32_t kMaxSettings = 1 << 16;

RegisterMessage DecodeRegister(Reader& r) {
    RegisterMessage m;
    m.worker_rank = r.Fixed<int32_t>("Register.worker_rank");
    m.tp = r.Fixed<int32_t>("Register.tp");
    m.instance_id = r.String("Register.instance_id");
    m.protocol_version = r.Fixed<uint32_t>("Register.protocol_version");
    m.kv_endpoint = r.String("Register.kv_endpoint");
    m.token = r.String("Register.token");
    m.model = r.String("Register.model");
    return m;
}

// `fields`: the names of the count, each key and each value, for errors.
std::vector<std::pair<std::string, std::string>> DecodeSettings(Reader& r,
                                                                const char* const (&fields)[3]) {
    // A pair of strings takes 64 bytes in memory but only 8 on the wire; the cap keeps decoded
    // memory near the frame length even for a frame of nothing but empty pairs.
    const uint32_t n = r.Count(fields[0], 8, kMaxSettings);
    std::vector<std::pair<std::string, std::string>> settings;
    settings.reserve(n);
    for (uint32_t i = 0; i < n && r.status().ok(); ++i) {
        std::string key = r.String(fields[1]);
        std::string value = r.String(fields[2]);
        settings.emplace_back(std::move(key), std::move(value));
    }
    return settings;
}

RegisterAckMessage DecodeRegisterAck(Reader& r) {
    RegisterAckMessage m;
    m.accepted = r.Bool("RegisterAck.accepted");
    m.error = r.String("RegisterAck.error");
    m.model_path = r.String("RegisterAck.model_path");
    m.tp = r.Fixed<int32_t>("RegisterAck.tp");
    m.settings = DecodeSettings(
        r, {"RegisterAck.settings", "RegisterAck.settings.key", "RegisterAck.settings.value"});
    m.rank = r.Fixed<int32_t>("RegisterAck.rank");
    return m;
}

Result<Message> DecodeMessage(MessageType type, Reader& r) {
    Message message;
    switch (type) {
        case MessageType::kStepPlan:
            message = DecodeStepPlan(r);
            break;
        case MessageType::kStepResult:
            message = DecodeStepResult(r);
            break;
        case MessageType::kRegister:
            message = DecodeRegister(r);
            break;
        case MessageType::kRegisterAck:
            message = DecodeRegisterAck(r);
            break;
        case MessageType::kHeartbeat:
            message = HeartbeatMessage{r.Fixed<uint64_t>("Heartbeat.sequence")};
            break;
        case MessageType::kShutdown:
            message = ShutdownMessage{r.String("Shutdown.reason")};
            break;
        case MessageType::kReady: {
            ReadyMessage ready;
            ready.ok = r.Bool("Ready.ok");
            ready.error = r.String("Ready.error");
            ready.num_kv_blocks = r.Fixed<int64_t>("Ready.num_kv_blocks");
            message = std::move(ready);
            break;
        }
        case MessageType::kStoreRequest: {
            StoreRequestMessage request;
            request.set = r.Bool("StoreRequest.set");
            request.key = r.String("StoreRequest.key");
            request.value = r.String("StoreRequest.value");
            message = std::move(request);
            break;
        }
        case MessageType::kStoreReply: {
            StoreReplyMessage reply;
            reply.found = r.Bool("StoreReply.found");
            reply.value = r.String("StoreReply.value");
            reply.error = r.String("StoreReply.error");
            message = std::move(reply);
            break;
        }
        case MessageType::kRankSettings:
            message = RankSettingsMessage{
                DecodeSettings(r, {"RankSettings.settings", "RankSettings.settings.key",
                                   "RankSettings.settings.value"})};
            break;
    }
    r.Finish();
    if (!r.status().ok()) {
        return r.status().WithContext(std::string(MessageTypeName(type)) + " frame");
    }
    return message;
}

uint32_t ReadU32(std::string_view bytes, size_t offset) {
    uint32_t value = 0;
    for (size_t i = 0; i < 4; ++i) {
        value |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[offset + i])) << (8 * i);
    }
    return value;
}

uint16_t ReadU16(std::string_view bytes, size_t offset) {
    return static_cast<uint16_t>(static_cast<uint8_t>(bytes[offset]) |
                                 (static_cast<uint8_t>(bytes[offset + 1]) << 8));
}

std::string Hex(std::string_view bytes) {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out;
    for (char c : bytes) {
        out += kDigits[static_cast<uint8_t>(c) >> 4];
        out += kDigits[static_cast<uint8_t>(c) & 0xF];
    }
    return out;
}

}  // namespace

std::string_view MessageTypeName(MessageType type) {
    switch (type) {
        case MessageType::kStepPlan:
            return "StepPlan";
        case MessageType::kStepResult:
            return "StepResult";
        case MessageType::kRegister:
            return "Register";
        case MessageType::kRegisterAck:
            return "RegisterAck";
        case MessageType::kHeartbeat:
            return "Heartbeat";
        case MessageType::kShutdown:
            return "Shutdown";
        case MessageType::kReady:
            return "Ready";
        case MessageType::kStoreRequest:
            return "StoreRequest";
        case MessageType::kStoreReply:
            return "StoreReply";
        case MessageType::kRankSettings:
            return "RankSettings";
    }
    return "Unknown";
}

MessageType TypeOf(const Message& message) {
    struct Visitor {
        MessageType operator()(const StepPlan&) const { return MessageType::kStepPlan; }
        MessageType operator()(const StepResult&) const { return MessageType::kStepResult; }
        MessageType operator()(const RegisterMessage&) const { return MessageType::kRegister; }
        MessageType operator()(const RegisterAckMessage&) const {
            return MessageType::kRegisterAck;
        }
        MessageType operator()(const HeartbeatMessage&) const { return MessageType::kHeartbeat; }
        MessageType operator()(const ShutdownMessage&) const { return MessageType::kShutdown; }
        MessageType operator()(const ReadyMessage&) const { return MessageType::kReady; }
        MessageType operator()(const StoreRequestMessage&) const {
            return MessageType::kStoreRequest;
        }
        MessageType operator()(const StoreReplyMessage&) const { return MessageType::kStoreReply; }
        MessageType operator()(const RankSettingsMessage&) const {
            return MessageType::kRankSettings;
        }
    };
    return std::visit(Visitor{}, message);
}

uint32_t Crc32(std::string_view bytes) {
    // zlib's table-driven CRC runs at GB/s; the bit-serial alternatives are ~10x slower, which
    // capped KV handoff over TCP at ~0.15 GB/s (scripts/bench-kv-transfer).
    uLong crc = crc32(0L, Z_NULL, 0);
    const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
    size_t left = bytes.size();
    while (left > 0) {
        const auto n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
        crc = crc32(crc, data, n);
        data += n;
        left -= n;
    }
    return static_cast<uint32_t>(crc);
}

std::string EncodeFrame(const Message& message) {
    std::string frame(kFrameHeaderBytes, '\0');
    Writer payload_writer(&frame);
    std::visit([&](const auto& m) { Encode(payload_writer, m); }, message);
    const std::string_view payload = std::string_view(frame).substr(kFrameHeaderBytes);
    KV_CHECK_LE(payload.size(), size_t{UINT32_MAX});

    std::string header;
    Writer w(&header);
    header.append(kFrameMagic);
    w.Fixed(kWireVersion);
    w.Fixed(static_cast<uint16_t>(TypeOf(message)));
    w.Fixed(static_cast<uint32_t>(payload.size()));
    w.Fixed(Crc32(payload));
    KV_CHECK_EQ(header.size(), kFrameHeaderBytes);
    frame.replace(0, kFrameHeaderBytes, header);
    return frame;
}

Result<FrameHeader> DecodeFrameHeader(std::string_view header, uint32_t max_payload_bytes) {
    if (header.size() < kFrameHeaderBytes) {
        return DataLoss("frame header truncated: " + std::to_string(header.size()) + " of " +
                        std::to_string(kFrameHeaderBytes) + " bytes");
    }
    if (header.substr(0, 4) != kFrameMagic) {
        return DataLoss("not a kvshard frame: magic bytes " + Hex(header.substr(0, 4)) +
                        ", expected " + Hex(kFrameMagic) + " (\"KVSF\")");
    }
    FrameHeader result;
    result.version = ReadU16(header, 4);
    if (result.version != kWireVersion) {
        return Unimplemented("frame version " + std::to_string(result.version) +
                             "; this build speaks version " + std::to_string(kWireVersion));
    }
    const uint16_t type = ReadU16(header, 6);
    if (type < static_cast<uint16_t>(MessageType::kStepPlan) ||
        type > static_cast<uint16_t>(MessageType::kRankSettings)) {
        return DataLoss("unknown message type " + std::to_string(type));
    }
    result.type = static_cast<MessageType>(type);
    result.payload_bytes = ReadU32(header, 8);
    if (result.payload_bytes > max_payload_bytes) {
        return Status(StatusCode::kResourceExhausted,
                      std::string(MessageTypeName(result.type)) + " frame of " +
                          std::to_string(result.payload_bytes) + " payload bytes exceeds the " +
                          "limit of " + std::to_string(max_payload_bytes));
    }
    result.payload_crc32 = ReadU32(header, 12);
    return result;
}

Result<Message> DecodePayload(const FrameHeader& header, std::string_view payload) {
    if (payload.size() != header.payload_bytes) {
        return DataLoss(std::string(MessageTypeName(header.type)) + " frame: payload has " +
                        std::to_string(payload.size()) + " bytes, header says " +
                        std::to_string(header.payload_bytes));
    }
    const uint32_t crc = Crc32(payload);
    if (crc != header.payload_crc32) {
        return DataLoss(std::string(MessageTypeName(header.type)) + " frame: payload CRC-32 " +
                        std::to_string(crc) + " does not match the header's " +
                        std::to_string(header.payload_crc32));
    }
    Reader reader(payload);
    return DecodeMessage(header.type, reader);
}

Result<Message> DecodeFrame(std::string_view frame, uint32_t max_payload_bytes) {
    KV_ASSIGN_OR_RETURN(const FrameHeader header, DecodeFrameHeader(frame, max_payload_bytes));
    return DecodePayload(header, frame.substr(kFrameHeaderBytes));
}

}  // namespace kvshard
