// The TCP KV transport's frames (docs/comm.md, "KV transports"). A connection opens with a hello
// (answered by an acknowledgement); then the sender names a transfer with a transfer frame before
// its pieces, and sends one piece frame per KvPiece, each answered by one acknowledgement frame.
// Internal to comm/ (tcp_kv_transport.cc, its tests and its fuzzer).
//
// Every decoder here is total over its fixed-size input: it validates each field and never
// allocates; what the header announces (a token's or a payload's length) is bounded before a
// caller reads it.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/kv_transport.h"
#include "common/status.h"

namespace kvshard::internal {

inline constexpr uint16_t kKvWireVersion = 2;
inline constexpr size_t kKvHelloHeaderBytes = 8;
inline constexpr size_t kKvFrameMagicBytes = 4;
inline constexpr size_t kKvTransferFrameBytes = 16;
inline constexpr size_t kKvPieceFrameHeaderBytes = 56;
inline constexpr size_t kKvAckFrameHeaderBytes = 20;
inline constexpr uint32_t kMaxKvAckMessageBytes = 4'096;

// Hello, once per connection, sender first: 0 "KVSH" | 4 u16 version | 6 u16 token bytes
//   (<= kMaxKvTokenBytes) | 8 token. Answered by an ack frame for transfer 0.
std::string EncodeKvHello(const std::string& token);
// The token's length: DataLoss (magic, a token over the limit), Unimplemented (version).
Result<uint16_t> DecodeKvHelloHeader(const std::array<uint8_t, kKvHelloHeaderBytes>& bytes);
// Compares in time independent of where they differ (a token is a secret).
bool KvTokensEqual(const std::string& expected, const std::string& presented);

// After the hello, every frame from the sender starts with one of two magics.
enum class KvFrameKind { kTransfer, kPiece };
// DataLoss for any other magic. REQUIRES: kKvFrameMagicBytes bytes at `magic`.
Result<KvFrameKind> DecodeKvFrameKind(const uint8_t* magic);
size_t KvFrameHeaderBytes(KvFrameKind kind);  // kKvTransferFrameBytes or kKvPieceFrameHeaderBytes

// Transfer frame: 0 "KVST" | 4 u16 version | 6 u16 zero | 8 u64 transfer_id. Names the transfer
// whose pieces follow on this connection; a receiver refuses pieces of any other.
using KvTransferFrame = std::array<uint8_t, kKvTransferFrameBytes>;
KvTransferFrame EncodeKvTransferFrame(uint64_t transfer_id);
// The transfer id: DataLoss (magic, reserved bytes), Unimplemented (version).
Result<uint64_t> DecodeKvTransferFrame(const KvTransferFrame& bytes);

// Piece frame header, little-endian:
//   0 "KVSP" | 4 u16 version | 6 u8 dtype | 7 u8 zero | 8 u64 transfer_id | 16 i32 layer_begin
//   | 20 i32 layer_end | 24 i32 head_begin | 28 i32 head_end | 32 i32 num_blocks
//   | 36 i32 block_size | 40 i32 head_dim | 44 u64 payload bytes | 52 u32 CRC-32 of the payload
using KvPieceFrameHeader = std::array<uint8_t, kKvPieceFrameHeaderBytes>;
KvPieceFrameHeader EncodeKvPieceFrameHeader(const KvPieceHeader& header, uint64_t payload_bytes,
                                            uint32_t payload_crc);

// The transfer id field of a piece frame header, whether or not the rest is valid (so that a
// refusal can name it).
uint64_t KvPieceFrameTransferId(const KvPieceFrameHeader& bytes);

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
