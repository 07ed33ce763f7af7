#include "comm/tcp_kv_wire.h"

#include <cstring>
#include <string_view>
#include <type_traits>

#include "comm/kv_hash.h"
#include "comm/kv_staging.h"
#include "comm/shm_region.h"

namespace kvshard::internal {

namespace {

constexpr char kHelloMagic[4] = {'K', 'V', 'S', 'H'};
constexpr char kTransferMagic[4] = {'K', 'V', 'S', 'T'};
constexpr char kPieceMagic[4] = {'K', 'V', 'S', 'P'};
constexpr char kAckMagic[4] = {'K', 'V', 'S', 'A'};
constexpr char kOfferMagic[4] = {'K', 'V', 'S', 'M'};
constexpr char kChunkMagic[4] = {'K', 'V', 'S', 'C'};
constexpr char kCreditMagic[4] = {'K', 'V', 'S', 'F'};

template <typename T>
void Put(uint8_t* at, T value) {
    using U = std::make_unsigned_t<T>;
    const U bits = static_cast<U>(value);
    for (size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<uint8_t>(bits >> (8 * i));
}

template <typename T>
T Get(const uint8_t* at) {
    using U = std::make_unsigned_t<T>;
    U bits = 0;
    for (size_t i = 0; i < sizeof(T); ++i) bits |= static_cast<U>(U{at[i]} << (8 * i));
    return static_cast<T>(bits);
}

// Status codes on the wire: fixed numbers, independent of StatusCode's declaration order.
uint16_t WireCode(StatusCode code) {
    switch (code) {
        case StatusCode::kOk:
            return 0;
        case StatusCode::kInvalidArgument:
            return 1;
        case StatusCode::kNotFound:
            return 2;
        case StatusCode::kDataLoss:
            return 3;
        case StatusCode::kUnimplemented:
            return 4;
        case StatusCode::kOutOfRange:
            return 5;
        case StatusCode::kResourceExhausted:
            return 6;
        case StatusCode::kUnavailable:
            return 7;
        case StatusCode::kDeadlineExceeded:
            return 8;
        case StatusCode::kAborted:
            return 9;
        case StatusCode::kInternal:
            return 10;
    }
    return 10;
}

constexpr StatusCode kCodesByWire[] = {
    StatusCode::kOk,
    StatusCode::kInvalidArgument,
    StatusCode::kNotFound,
    StatusCode::kDataLoss,
    StatusCode::kUnimplemented,
    StatusCode::kOutOfRange,
    StatusCode::kResourceExhausted,
    StatusCode::kUnavailable,
    StatusCode::kDeadlineExceeded,
    StatusCode::kAborted,
    StatusCode::kInternal,
};

}  // namespace

std::string EncodeKvHello(const std::string& token) {
    const std::string_view t = std::string_view(token).substr(0, kMaxKvTokenBytes);
    std::string out(kKvHelloHeaderBytes + t.size(), '\0');
    auto* p = reinterpret_cast<uint8_t*>(out.data());
    std::memcpy(p, kHelloMagic, 4);
    Put<uint16_t>(p + 4, kKvWireVersion);
    Put<uint16_t>(p + 6, static_cast<uint16_t>(t.size()));
    std::memcpy(p + kKvHelloHeaderBytes, t.data(), t.size());
    return out;
}

Result<uint16_t> DecodeKvHelloHeader(const std::array<uint8_t, kKvHelloHeaderBytes>& in) {
    if (std::memcmp(in.data(), kHelloMagic, 4) != 0) {
        return DataLoss("not a KV transport hello (bad magic)");
    }
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV transport hello version " + std::to_string(version) +
                             ", this build speaks " + std::to_string(kKvWireVersion));
    }
    const uint16_t token_bytes = Get<uint16_t>(&in[6]);
    if (token_bytes > kMaxKvTokenBytes) {
        return DataLoss("KV transport hello: token of " + std::to_string(token_bytes) +
                        " bytes exceeds " + std::to_string(kMaxKvTokenBytes));
    }
    return token_bytes;
}

bool KvTokensEqual(const std::string& expected, const std::string& presented) {
    // The length is not secret (it is on the wire); the bytes are compared all the way.
    if (expected.size() != presented.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
        diff |= static_cast<unsigned char>(expected[i] ^ presented[i]);
    }
    return diff == 0;
}

Result<KvFrameKind> DecodeKvFrameKind(const uint8_t* magic) {
    if (std::memcmp(magic, kTransferMagic, 4) == 0) return KvFrameKind::kTransfer;
    if (std::memcmp(magic, kPieceMagic, 4) == 0) return KvFrameKind::kPiece;
    if (std::memcmp(magic, kOfferMagic, 4) == 0) return KvFrameKind::kOffer;
    if (std::memcmp(magic, kChunkMagic, 4) == 0) return KvFrameKind::kChunk;
    return DataLoss("not a KV transfer, piece, offer or chunk frame (bad magic)");
}

size_t KvFrameHeaderBytes(KvFrameKind kind) {
    switch (kind) {
        case KvFrameKind::kTransfer:
            return kKvTransferFrameBytes;
        case KvFrameKind::kPiece:
            return kKvPieceFrameHeaderBytes;
        case KvFrameKind::kOffer:
            return kKvOfferFrameHeaderBytes;
        case KvFrameKind::kChunk:
            return kKvChunkFrameBytes;
    }
    return kKvPieceFrameHeaderBytes;
}

KvTransferFrame EncodeKvTransferFrame(uint64_t transfer_id) {
    KvTransferFrame out{};
    std::memcpy(out.data(), kTransferMagic, 4);
    Put<uint16_t>(&out[4], kKvWireVersion);
    Put<uint16_t>(&out[6], 0);
    Put<uint64_t>(&out[8], transfer_id);
    return out;
}

Result<uint64_t> DecodeKvTransferFrame(const KvTransferFrame& in) {
    if (std::memcmp(in.data(), kTransferMagic, 4) != 0) {
        return DataLoss("not a KV transfer frame (bad magic)");
    }
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV transfer frame version " + std::to_string(version) +
                             ", this build speaks " + std::to_string(kKvWireVersion));
    }
    const uint16_t reserved = Get<uint16_t>(&in[6]);
    if (reserved != 0) {
        return DataLoss("KV transfer frame: reserved bytes 6-7 are " + std::to_string(reserved));
    }
    return Get<uint64_t>(&in[8]);
}

KvPieceFrameHeader EncodeKvPieceFrameHeader(const KvPieceHeader& h, uint64_t payload_bytes,
                                            uint64_t payload_hash, uint8_t flags) {
    KvPieceFrameHeader out{};
    std::memcpy(out.data(), kPieceMagic, 4);
    Put<uint16_t>(&out[4], kKvWireVersion);
    out[6] = KvDtypeWireCode(h.dtype);
    out[7] = flags;
    Put<uint64_t>(&out[8], h.transfer_id);
    Put<int32_t>(&out[16], h.layer_begin);
    Put<int32_t>(&out[20], h.layer_end);
    Put<int32_t>(&out[24], h.head_begin);
    Put<int32_t>(&out[28], h.head_end);
    Put<int32_t>(&out[32], h.num_blocks);
    Put<int32_t>(&out[36], h.block_size);
    Put<int32_t>(&out[40], h.head_dim);
    Put<uint64_t>(&out[44], payload_bytes);
    Put<uint64_t>(&out[52], payload_hash);
    return out;
}

uint64_t KvPieceFrameTransferId(const KvPieceFrameHeader& in) { return Get<uint64_t>(&in[8]); }

Result<DecodedKvPieceFrame> DecodeKvPieceFrameHeader(const KvPieceFrameHeader& in) {
    if (std::memcmp(in.data(), kPieceMagic, 4) != 0) {
        return DataLoss("not a KV piece frame (bad magic)");
    }
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV piece frame version " + std::to_string(version) +
                             ", this build speaks " + std::to_string(kKvWireVersion));
    }
    if ((in[7] & ~(kKvPieceInRegion | kKvPieceUncredited)) != 0 || in[7] == kKvPieceUncredited) {
        return DataLoss("KV piece frame: unknown flags " + std::to_string(in[7]));
    }
    DecodedKvPieceFrame out;
    KvPieceHeader& h = out.header;
    KV_ASSIGN_OR_RETURN(h.dtype, KvDtypeFromWireCode(in[6]));
    h.transfer_id = Get<uint64_t>(&in[8]);
    h.layer_begin = Get<int32_t>(&in[16]);
    h.layer_end = Get<int32_t>(&in[20]);
    h.head_begin = Get<int32_t>(&in[24]);
    h.head_end = Get<int32_t>(&in[28]);
    h.num_blocks = Get<int32_t>(&in[32]);
    h.block_size = Get<int32_t>(&in[36]);
    h.head_dim = Get<int32_t>(&in[40]);
    out.payload_bytes = Get<uint64_t>(&in[44]);
    out.payload_hash = Get<uint64_t>(&in[52]);
    out.in_region = (in[7] & kKvPieceInRegion) != 0;
    out.uncredited = (in[7] & kKvPieceUncredited) != 0;
    KV_RETURN_IF_ERROR(ValidateKvPieceHeader(h));  // bounds KvPieceBytes, so no overflow below
    const int64_t expected = KvPieceBytes(h);
    if (out.payload_bytes != static_cast<uint64_t>(expected)) {
        return DataLoss("KV piece frame: payload length " + std::to_string(out.payload_bytes) +
                        " does not match its header (" + std::to_string(expected) + " bytes)");
    }
    return out;
}

std::string EncodeKvAckFrame(uint64_t transfer_id, const Status& status) {
    const std::string_view message =
        std::string_view(status.message()).substr(0, kMaxKvAckMessageBytes);
    std::string out(kKvAckFrameHeaderBytes + message.size(), '\0');
    auto* p = reinterpret_cast<uint8_t*>(out.data());
    std::memcpy(p, kAckMagic, 4);
    Put<uint16_t>(p + 4, kKvWireVersion);
    Put<uint16_t>(p + 6, WireCode(status.code()));
    Put<uint64_t>(p + 8, transfer_id);
    Put<uint32_t>(p + 16, static_cast<uint32_t>(message.size()));
    std::memcpy(p + kKvAckFrameHeaderBytes, message.data(), message.size());
    return out;
}

Result<DecodedKvAckHeader> DecodeKvAckFrameHeader(
    const std::array<uint8_t, kKvAckFrameHeaderBytes>& in) {
    if (std::memcmp(in.data(), kAckMagic, 4) != 0)
        return DataLoss("not a KV ack frame (bad magic)");
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV ack frame version " + std::to_string(version));
    }
    const uint16_t code = Get<uint16_t>(&in[6]);
    if (code >= std::size(kCodesByWire)) {
        return DataLoss("KV ack frame: unknown status code " + std::to_string(code));
    }
    DecodedKvAckHeader out;
    out.code = kCodesByWire[code];
    out.transfer_id = Get<uint64_t>(&in[8]);
    out.message_bytes = Get<uint32_t>(&in[16]);
    if (out.message_bytes > kMaxKvAckMessageBytes) {
        return DataLoss("KV ack frame: message of " + std::to_string(out.message_bytes) +
                        " bytes exceeds " + std::to_string(kMaxKvAckMessageBytes));
    }
    return out;
}

std::string EncodeKvOfferFrame(const std::string& name, uint64_t region_bytes) {
    const std::string_view n = std::string_view(name).substr(0, kMaxKvShmNameBytes);
    std::string out(kKvOfferFrameHeaderBytes + n.size(), '\0');
    auto* p = reinterpret_cast<uint8_t*>(out.data());
    std::memcpy(p, kOfferMagic, 4);
    Put<uint16_t>(p + 4, kKvWireVersion);
    Put<uint16_t>(p + 6, static_cast<uint16_t>(n.size()));
    Put<uint64_t>(p + 8, region_bytes);
    std::memcpy(p + kKvOfferFrameHeaderBytes, n.data(), n.size());
    return out;
}

Result<DecodedKvOfferHeader> DecodeKvOfferFrameHeader(
    const std::array<uint8_t, kKvOfferFrameHeaderBytes>& in) {
    if (std::memcmp(in.data(), kOfferMagic, 4) != 0) {
        return DataLoss("not a KV shared-memory offer (bad magic)");
    }
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV offer frame version " + std::to_string(version));
    }
    DecodedKvOfferHeader out;
    out.name_bytes = Get<uint16_t>(&in[6]);
    out.region_bytes = Get<uint64_t>(&in[8]);
    if (out.name_bytes == 0 || out.name_bytes > kMaxKvShmNameBytes) {
        return DataLoss("KV offer frame: a name of " + std::to_string(out.name_bytes) +
                        " bytes (1 to " + std::to_string(kMaxKvShmNameBytes) + ")");
    }
    return out;
}

KvChunkFrame EncodeKvChunkFrame(const KvChunk& chunk) {
    KvChunkFrame out{};
    std::memcpy(out.data(), kChunkMagic, 4);
    Put<uint16_t>(&out[4], kKvWireVersion);
    Put<uint64_t>(&out[8], chunk.region_offset);
    Put<uint64_t>(&out[16], chunk.bytes);
    Put<uint64_t>(&out[24], chunk.hash);
    return out;
}

Result<KvChunk> DecodeKvChunkFrame(const KvChunkFrame& in) {
    if (std::memcmp(in.data(), kChunkMagic, 4) != 0) return DataLoss("not a KV chunk frame");
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV chunk frame version " + std::to_string(version));
    }
    if (Get<uint16_t>(&in[6]) != 0) return DataLoss("KV chunk frame: reserved bytes 6-7");
    KvChunk out;
    out.region_offset = Get<uint64_t>(&in[8]);
    out.bytes = Get<uint64_t>(&in[16]);
    out.hash = Get<uint64_t>(&in[24]);
    if (out.bytes == 0) return DataLoss("KV chunk frame: an empty chunk");
    return out;
}

KvCreditFrame EncodeKvCreditFrame(uint64_t region_offset) {
    KvCreditFrame out{};
    std::memcpy(out.data(), kCreditMagic, 4);
    Put<uint16_t>(&out[4], kKvWireVersion);
    Put<uint64_t>(&out[8], region_offset);
    return out;
}

bool IsKvCreditFrame(const uint8_t* magic) { return std::memcmp(magic, kCreditMagic, 4) == 0; }

Result<uint64_t> DecodeKvCreditFrame(const KvCreditFrame& in) {
    if (!IsKvCreditFrame(in.data())) return DataLoss("not a KV credit frame");
    const uint16_t version = Get<uint16_t>(&in[4]);
    if (version != kKvWireVersion) {
        return Unimplemented("KV credit frame version " + std::to_string(version));
    }
    if (Get<uint16_t>(&in[6]) != 0 || Get<uint32_t>(&in[16]) != 0) {
        return DataLoss("KV credit frame: reserved bytes");
    }
    return Get<uint64_t>(&in[8]);
}

uint64_t KvPayloadHash(const uint8_t* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace kvshard::internal
