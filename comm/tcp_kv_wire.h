// The TCP KV transport's frames (docs/comm.md, "KV transports"). A connection opens with a hello
// (answered by an acknowledgement carrying the receiver's boot id); a sender on the same host may
// then offer a shared-memory region (comm/shm_region.h) with an offer frame, answered by an
// acknowledgement. Then the sender names a transfer with a transfer frame before its pieces, and
// sends one piece frame per KvPiece, each answered by one acknowledgement frame. A piece's payload
// follows its header on the socket, or, through the region, as chunk frames naming where in the
// region each chunk lies, each answered by a credit frame once the receiver copied it out.
// Internal to comm/ (the TCP transport's sender and sessions, their tests and the fuzzer).
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

// 3: 64-bit XXH3 payload hashes instead of CRC-32, the boot id in the hello's acknowledgement,
// the shared-memory offer, chunk and credit frames. 4: the region is a sealed memfd named by
// process id, descriptor and salt; region pieces that need no credits (kKvPieceUncredited).
inline constexpr uint16_t kKvWireVersion = 4;
inline constexpr size_t kKvHelloHeaderBytes = 8;
inline constexpr size_t kKvFrameMagicBytes = 4;
inline constexpr size_t kKvTransferFrameBytes = 16;
inline constexpr size_t kKvPieceFrameHeaderBytes = 60;
inline constexpr size_t kKvOfferFrameHeaderBytes = 16;
inline constexpr size_t kKvChunkFrameBytes = 32;
inline constexpr size_t kKvAckFrameHeaderBytes = 20;
inline constexpr size_t kKvCreditFrameBytes = 20;  // as long as an ack header: read alike
inline constexpr uint32_t kMaxKvAckMessageBytes = 4'096;

// Hello, once per connection, sender first: 0 "KVSH" | 4 u16 version | 6 u16 token bytes
//   (<= kMaxKvTokenBytes) | 8 token. Answered by an ack frame for transfer 0 whose message, when
//   OK, is the receiver's boot id (KvHostBootId(); empty when it has none or serves no shared
//   memory): the sender offers a region only when it equals its own.
std::string EncodeKvHello(const std::string& token);
// The token's length: DataLoss (magic, a token over the limit), Unimplemented (version).
Result<uint16_t> DecodeKvHelloHeader(const std::array<uint8_t, kKvHelloHeaderBytes>& bytes);
// Compares in time independent of where they differ (a token is a secret).
bool KvTokensEqual(const std::string& expected, const std::string& presented);

// After the hello, every frame from the sender starts with one of these magics.
enum class KvFrameKind { kTransfer, kPiece, kOffer, kChunk };
// DataLoss for any other magic. REQUIRES: kKvFrameMagicBytes bytes at `magic`.
Result<KvFrameKind> DecodeKvFrameKind(const uint8_t* magic);
size_t KvFrameHeaderBytes(KvFrameKind kind);  // the fixed bytes of that frame's header

// Transfer frame: 0 "KVST" | 4 u16 version | 6 u16 zero | 8 u64 transfer_id. Names the transfer
// whose pieces follow on this connection; a receiver refuses pieces of any other.
using KvTransferFrame = std::array<uint8_t, kKvTransferFrameBytes>;
KvTransferFrame EncodeKvTransferFrame(uint64_t transfer_id);
// The transfer id: DataLoss (magic, reserved bytes), Unimplemented (version).
Result<uint64_t> DecodeKvTransferFrame(const KvTransferFrame& bytes);

// Piece frame header, little-endian:
//   0 "KVSP" | 4 u16 version | 6 u8 dtype | 7 u8 flags | 8 u64 transfer_id | 16 i32 layer_begin
//   | 20 i32 layer_end | 24 i32 head_begin | 28 i32 head_end | 32 i32 num_blocks
//   | 36 i32 block_size | 40 i32 head_dim | 44 u64 payload bytes | 52 u64 XXH3-64 of the payload
// flags: kKvPieceInRegion (the payload comes as chunk frames through the offered region; the
// hash field is then 0, each chunk carrying its own); kKvPieceUncredited, with kKvPieceInRegion
// only (the piece fits the region whole, so the sender reuses none of its chunks before its
// acknowledgement: the receiver sends no credit frames for it, the acknowledgement frees every
// chunk);
// other bits must be 0.
inline constexpr uint8_t kKvPieceInRegion = 1;
inline constexpr uint8_t kKvPieceUncredited = 2;
using KvPieceFrameHeader = std::array<uint8_t, kKvPieceFrameHeaderBytes>;
KvPieceFrameHeader EncodeKvPieceFrameHeader(const KvPieceHeader& header, uint64_t payload_bytes,
                                            uint64_t payload_hash, uint8_t flags = 0);

// The transfer id field of a piece frame header, whether or not the rest is valid (so that a
// refusal can name it).
uint64_t KvPieceFrameTransferId(const KvPieceFrameHeader& bytes);

struct DecodedKvPieceFrame {
    KvPieceHeader header;
    uint64_t payload_bytes = 0;  // == KvPieceBytes(header)
    uint64_t payload_hash = 0;
    bool in_region = false;
    bool uncredited = false;  // kKvPieceUncredited
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

// Offer frame: 0 "KVSM" | 4 u16 version | 6 u16 name bytes (<= kMaxKvShmNameBytes)
//   | 8 u64 region bytes | 16 name. Answered by an ack frame for transfer 0: OK (the region is
// opened; pieces may use it), or a refusal the connection survives (NotFound, Unavailable,
// Unimplemented: go on over the socket), or InvalidArgument and the connection closed (a claim
// outside the agreement: comm/shm_region.h).
std::string EncodeKvOfferFrame(const std::string& name, uint64_t region_bytes);
struct DecodedKvOfferHeader {
    uint16_t name_bytes = 0;
    uint64_t region_bytes = 0;
};
// DataLoss (magic, a name over the limit), Unimplemented (version).
Result<DecodedKvOfferHeader> DecodeKvOfferFrameHeader(
    const std::array<uint8_t, kKvOfferFrameHeaderBytes>& bytes);

// Chunk frame, after a piece header with kKvPieceInRegion: 0 "KVSC" | 4 u16 version | 6 u16 zero
//   | 8 u64 region offset | 16 u64 bytes | 24 u64 XXH3-64 of those bytes. The chunks of a piece
// follow one another in payload order until its payload is complete.
using KvChunkFrame = std::array<uint8_t, kKvChunkFrameBytes>;
struct KvChunk {
    uint64_t region_offset = 0;
    uint64_t bytes = 0;
    uint64_t hash = 0;
};
KvChunkFrame EncodeKvChunkFrame(const KvChunk& chunk);
// DataLoss (magic, reserved bytes, zero bytes), Unimplemented (version). Ranges are the caller's
// to check (against the region and the piece).
Result<KvChunk> DecodeKvChunkFrame(const KvChunkFrame& bytes);

// Credit frame, receiver to sender, once a chunk was copied out (its bytes may be overwritten):
//   0 "KVSF" | 4 u16 version | 6 u16 zero | 8 u64 region offset of the chunk | 16 u32 zero.
// The last chunk of a piece gets no credit, nor does any chunk of an uncredited piece: the
// piece's acknowledgement frees every chunk.
using KvCreditFrame = std::array<uint8_t, kKvCreditFrameBytes>;
KvCreditFrame EncodeKvCreditFrame(uint64_t region_offset);
// What a sender reads after a frame: an acknowledgement or (region pieces) a credit.
bool IsKvCreditFrame(const uint8_t* magic);  // REQUIRES: kKvFrameMagicBytes bytes
// The region offset: DataLoss (magic, reserved), Unimplemented (version).
Result<uint64_t> DecodeKvCreditFrame(const KvCreditFrame& bytes);

// XXH3-64 of a payload (libxxhash): ~10x zlib's CRC-32 on this machine's cores, and 64 bits.
uint64_t KvPayloadHash(const uint8_t* data, size_t bytes);
inline uint64_t KvPayloadHash(const std::vector<uint8_t>& payload) {
    return KvPayloadHash(payload.data(), payload.size());
}

}  // namespace kvshard::internal
