// libFuzzer target for the TCP KV transport's wire decoder (comm/tcp_kv_wire.h) and the checks a
// receiver applies before it allocates (ValidateKvPieceFits, KvStaging::Reserve). Built with
// -DKVSHARD_BUILD_FUZZERS=ON and clang; see comm/CMakeLists.txt and docs/comm.md.
//
// An input is the byte stream a receiving connection sees, parsed the way tcp_kv_session.cc's
// Session parses it: a hello (and its token), then transfer and piece frames, each piece followed
// by its payload. Besides never crashing, what must hold:
//   - whatever decodes re-encodes to the same bytes;
//   - a piece header that decodes claims exactly KvPieceBytes of payload, and one that fits the
//     receive geometry is no larger than the whole pool;
//   - the staging never holds (staged + arriving) more than the pool's bytes or more transfers
//     than the pool's blocks, and a piece of a transfer the stream did not name is never staged.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"
#include "comm/tcp_kv_wire.h"

namespace {

using kvshard::KvPiece;
using kvshard::KvPieceHeader;
using kvshard::KvReceiveGeometry;
using kvshard::Status;
namespace internal = kvshard::internal;

[[noreturn]] void Fail(const char* what) {
    std::fprintf(stderr, "kv_wire_fuzz: %s\n", what);
    std::abort();
}

// A small pool, so that geometry checks reject most of what the fuzzer makes up.
KvReceiveGeometry Geometry() {
    KvReceiveGeometry g;
    g.num_layers = 4;
    g.head_begin = 1;
    g.head_end = 3;
    g.block_size = 4;
    g.head_dim = 8;
    g.dtype = kvshard::KvDtype::kFp32;
    g.num_blocks = 8;
    return g;
}

// A geometry made of input bytes: its validation must be total, and a piece it accepts must be no
// larger than the pool it describes.
void CheckGeometryFromBytes(const uint8_t* data, size_t size, const KvPieceHeader& header) {
    if (size < 25) return;
    KvReceiveGeometry g;
    std::memcpy(&g.num_layers, data, 4);
    std::memcpy(&g.head_begin, data + 4, 4);
    std::memcpy(&g.head_end, data + 8, 4);
    std::memcpy(&g.block_size, data + 12, 4);
    std::memcpy(&g.head_dim, data + 16, 4);
    int32_t blocks = 0;
    std::memcpy(&blocks, data + 20, 4);
    g.num_blocks = blocks;
    kvshard::Result<kvshard::KvDtype> dtype = kvshard::KvDtypeFromWireCode(data[24]);
    if (!dtype.ok()) return;
    g.dtype = *dtype;
    if (!kvshard::ValidateKvReceiveGeometry(g).ok()) return;
    const int64_t pool = kvshard::KvReceiveGeometryBytes(g);
    if (pool <= 0) Fail("a valid geometry has no bytes");
    if (kvshard::ValidateKvPieceFits(header, g).ok() && kvshard::KvPieceBytes(header) > pool) {
        Fail("a piece that fits is larger than the pool");
    }
}

class Stream {
  public:
    Stream(const uint8_t* data, size_t size) : data_(data), size_(size) {}
    size_t left() const { return size_ - at_; }
    const uint8_t* here() const { return data_ + at_; }
    bool Take(void* out, size_t n) {
        if (left() < n) return false;
        std::memcpy(out, data_ + at_, n);
        at_ += n;
        return true;
    }
    size_t Skip(size_t n) {
        n = std::min(n, left());
        at_ += n;
        return n;
    }

  private:
    const uint8_t* data_;
    size_t size_;
    size_t at_ = 0;
};

void CheckAck(const uint8_t* data, size_t size) {
    if (size < internal::kKvAckFrameHeaderBytes) return;
    std::array<uint8_t, internal::kKvAckFrameHeaderBytes> header{};
    std::memcpy(header.data(), data, header.size());
    kvshard::Result<internal::DecodedKvAckHeader> ack = internal::DecodeKvAckFrameHeader(header);
    if (!ack.ok()) return;
    if (ack->message_bytes > internal::kMaxKvAckMessageBytes) Fail("ack message over the limit");
    const size_t available = size - header.size();
    if (ack->message_bytes > available || ack->code == kvshard::StatusCode::kOk) return;
    const std::string message(reinterpret_cast<const char*>(data + header.size()),
                              ack->message_bytes);
    const std::string again =
        internal::EncodeKvAckFrame(ack->transfer_id, Status(ack->code, message));
    if (again.size() != header.size() + ack->message_bytes ||
        std::memcmp(again.data(), data, again.size()) != 0) {
        Fail("an ack does not re-encode to its bytes");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    CheckAck(data, size);

    Stream in(data, size);
    std::array<uint8_t, internal::kKvHelloHeaderBytes> hello{};
    if (!in.Take(hello.data(), hello.size())) return 0;
    kvshard::Result<uint16_t> token_bytes = internal::DecodeKvHelloHeader(hello);
    if (!token_bytes.ok()) return 0;
    if (*token_bytes > internal::kMaxKvTokenBytes) Fail("token over the limit");
    std::string token(*token_bytes, '\0');
    if (!in.Take(token.data(), token.size())) return 0;
    const std::string hello_again = internal::EncodeKvHello(token);
    if (hello_again.size() != hello.size() + token.size() ||
        std::memcmp(hello_again.data(), hello.data(), hello.size()) != 0 ||
        hello_again.compare(hello.size(), std::string::npos, token) != 0) {
        Fail("a hello does not re-encode to its bytes");
    }
    if (!internal::KvTokensEqual(token, token)) Fail("a token differs from itself");

    const KvReceiveGeometry geometry = Geometry();
    const int64_t pool_bytes = kvshard::KvReceiveGeometryBytes(geometry);
    kvshard::KvTransportOptions options;
    options.max_staged_bytes = pool_bytes * 4;  // the geometry must be what bounds it
    internal::KvStaging staging(options, "fuzz");
    if (!staging.SetGeometry(geometry).ok()) Fail("the fuzzer's geometry is invalid");

    std::optional<uint64_t> named;
    for (int frames = 0; frames < 64; ++frames) {
        internal::KvPieceFrameHeader frame{};
        if (!in.Take(frame.data(), internal::kKvFrameMagicBytes)) break;
        kvshard::Result<internal::KvFrameKind> kind = internal::DecodeKvFrameKind(frame.data());
        if (!kind.ok()) break;
        const size_t rest = internal::KvFrameHeaderBytes(*kind) - internal::kKvFrameMagicBytes;
        if (!in.Take(frame.data() + internal::kKvFrameMagicBytes, rest)) break;
        if (*kind == internal::KvFrameKind::kTransfer) {
            internal::KvTransferFrame t{};
            std::copy_n(frame.begin(), t.size(), t.begin());
            kvshard::Result<uint64_t> id = internal::DecodeKvTransferFrame(t);
            if (!id.ok()) break;
            if (internal::EncodeKvTransferFrame(*id) != t) {
                Fail("a transfer frame does not re-encode to its bytes");
            }
            named = *id;
            continue;
        }
        if (*kind == internal::KvFrameKind::kOffer) {
            // The decoders of the shared-memory frames are total too; a receiver opens no
            // region for the fuzzer, so the stream ends here.
            std::array<uint8_t, internal::kKvOfferFrameHeaderBytes> o{};
            std::copy_n(frame.begin(), o.size(), o.begin());
            (void)internal::DecodeKvOfferFrameHeader(o);
            break;
        }
        if (*kind == internal::KvFrameKind::kChunk) {
            internal::KvChunkFrame c{};
            std::copy_n(frame.begin(), c.size(), c.begin());
            kvshard::Result<internal::KvChunk> chunk = internal::DecodeKvChunkFrame(c);
            if (chunk.ok() && internal::EncodeKvChunkFrame(*chunk) != c) {
                Fail("a chunk frame does not re-encode to its bytes");
            }
            break;  // outside a piece: the receiver closes
        }
        kvshard::Result<internal::DecodedKvPieceFrame> piece =
            internal::DecodeKvPieceFrameHeader(frame);
        if (!piece.ok()) break;
        const KvPieceHeader& h = piece->header;
        if (internal::KvPieceFrameTransferId(frame) != h.transfer_id) Fail("transfer id differs");
        if (internal::EncodeKvPieceFrameHeader(
                h, piece->payload_bytes, piece->payload_hash,
                static_cast<uint8_t>((piece->in_region ? internal::kKvPieceInRegion : 0) |
                                     (piece->uncredited ? internal::kKvPieceUncredited : 0))) !=
            frame) {
            Fail("a piece header does not re-encode to its bytes");
        }
        if (piece->payload_bytes != static_cast<uint64_t>(kvshard::KvPieceBytes(h))) {
            Fail("a decoded piece's length differs from its header's formula");
        }
        CheckGeometryFromBytes(in.here(), in.left(), h);
        const bool fits = kvshard::ValidateKvPieceFits(h, geometry).ok();
        if (fits && kvshard::KvPieceBytes(h) > pool_bytes) Fail("a fitting piece exceeds the pool");
        if (named != h.transfer_id) break;  // the receiver refuses it and closes
        if (piece->in_region) break;        // no region offered: refused and closed
        const Status reserved = staging.Reserve(h);
        if (reserved.ok() && !fits) Fail("a piece that does not fit was reserved");
        if (staging.staged_bytes() + staging.arriving_bytes() > pool_bytes) {
            Fail("staging holds more than the pool");
        }
        if (!reserved.ok()) {
            if (reserved.code() == kvshard::StatusCode::kInvalidArgument) break;
            in.Skip(static_cast<size_t>(piece->payload_bytes));  // drained
            continue;
        }
        KvPiece whole;
        whole.header = h;
        const size_t n = static_cast<size_t>(piece->payload_bytes);
        if (in.left() < n) {
            staging.Unreserve(h);  // the connection ended mid-payload
            break;
        }
        whole.data.assign(in.here(), in.here() + n);
        in.Skip(n);
        if (internal::KvPayloadHash(whole.data) != piece->payload_hash) {
            staging.Unreserve(h);  // closed as malformed
            break;
        }
        const Status committed = staging.Commit(std::move(whole));
        if (!committed.ok()) Fail("a reserved piece of an open transfer was not committed");
        if (staging.staged_bytes() > pool_bytes) Fail("staging holds more than the pool");
    }
    if (staging.arriving_bytes() != 0) Fail("a reservation was left behind");
    return 0;
}
