// The TCP KV transport's frames (docs/comm.md, "KV transports"): one piece frame per KvPiece,
// answered by one acknowledgement frame. Internal to comm/ (tcp_kv_transport.cc and its tests).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/kv_transport.h"
#include "common/status.h"

namespace kvshard::internal {

inline constexpr uint16_t kKvWireVersion = 1;
inline constexpr size_t kKvPieceFrameHeaderBytes = 56;
inline constexpr size_t kKvAckFrameHeaderBytes = 20;
inline constexpr uint32_t kMaxKvAckMessageBytes = 4'096;

// Piece frame header, little-endian:
//   0 "KVSP" | 4 u16 version | 6 u8 dtype | 7 u8 zero | 8 u64 transfer_id | 16 i32 layer_begin
//   | 20 i32 layer_end | 24 i32 head_begin | 28 i32 head_end | 32 i32 num_blocks
//   | 36 i32 block_size | 40 i32 head_dim | 44 u64 payload bytes | 52 u32 CRC-32 of the payload
using KvPieceFrameHeader = std::array<uint8_t, kKvPieceFrameHeaderBytes>;
KvPieceFrameHeader EncodeKvPieceFrameHeader(const KvPieceHeader& header, uint64_t payload_bytes,
                                            uint32_t payload_crc);

struct DecodedKvPieceFrame {
    KvPieceHeader header;
    uint64_t payload_bytes = 0;  // == KvPieceBytes(header)
    uint32_t payload_crc = 0;
};
// Everything a receiver checks before it allocates the payload: DataLoss (magic, reserved byte,
// a length that does not match the header), Unimplemented (version), InvalidArgument (fields).
Result<DecodedKvPieceFrame> DecodeKvPieceFrameHeader(const KvPieceFrameHeader& bytes);

// Ack frame: 0 "KVSA" | 4 u16 version | 6 u16 status code | 8 u64 transfer_id
//   | 16 u32 message bytes (<= kMaxKvAckMessageBytes) | 20 message
std::string EncodeKvAckFrame(uint64_t transfer_id, const Status& status);

struct DecodedKvAckHeader {
    uint64_t transfer_id = 0;
    StatusCode code = StatusCode::kOk;
    uint32_t message_bytes = 0;
};
Result<DecodedKvAckHeader> DecodeKvAckFrameHeader(
    const std::array<uint8_t, kKvAckFrameHeaderBytes>& bytes);

uint32_t KvPayloadCrc(const std::vector<uint8_t>& payload);

}  // namespace kvshard::internal
