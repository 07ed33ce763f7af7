// KV pieces (comm/kv_transport.h) and the TCP transport's frames (comm/tcp_kv_wire.h): the byte
// formulas, the dtype's wire codes, validation of each field, and each frame's round trip and
// refusal of corruption.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/tcp_kv_wire.h"
#include "tests/comm/kv_transport_test_util.h"

// The helpers of kv_transport_test_util.h, and its aliases (Clock: the steady clock).
namespace kvshard::testing {
namespace {

TEST(KvPiece, ByteFormulas) {
    struct Case {
        KvDtype dtype;
        int32_t blocks, layers, heads, block_size, head_dim;
        int64_t element_bytes, layer_bytes;
    };
    const Case cases[] = {
        {KvDtype::kFp32, 3, 2, 4, 16, 64, 4, 2 * 4 * 16 * 64 * 4},
        {KvDtype::kInt8, 3, 2, 4, 16, 64, 1, 2 * 4 * 16 * 64 + 2 * 4 * 16 * 4},
        {KvDtype::kFp8, 1, 5, 1, 32, 128, 1, 2 * 32 * 128 + 2 * 32 * 4},
        {KvDtype::kFp32, 1, 1, 1, 1, 1, 4, 8},
    };
    for (const Case& c : cases) {
        KvPieceHeader h;
        h.dtype = c.dtype;
        h.num_blocks = c.blocks;
        h.layer_begin = 7;
        h.layer_end = 7 + c.layers;
        h.head_begin = 2;
        h.head_end = 2 + c.heads;
        h.block_size = c.block_size;
        h.head_dim = c.head_dim;
        EXPECT_EQ(KvDtypeBytes(c.dtype), c.element_bytes);
        EXPECT_EQ(KvPieceLayerBytes(h), c.layer_bytes);
        EXPECT_EQ(KvPieceBytes(h), int64_t{c.blocks} * c.layers * c.layer_bytes);
    }
}

// The wire keeps its explicit byte values (a peer of another build decodes the same dtype), and a
// byte that names no dtype is refused before anything is sized from it.
TEST(KvPiece, DtypeWireCodesAreStableAndCheckedOnDecode) {
    const std::pair<KvDtype, uint8_t> cases[] = {{KvDtype::kFp32, 0},
                                                 {KvDtype::kInt8, 1},
                                                 {KvDtype::kFp8, 2},
                                                 {KvDtype::kFp16, 3},
                                                 {KvDtype::kBf16, 4}};
    for (const auto& [dtype, code] : cases) {
        EXPECT_EQ(KvDtypeWireCode(dtype), code) << KvDtypeName(dtype);
        EXPECT_EQ(KvDtypeFromWireCode(code).value(), dtype) << int(code);
    }
    for (int code : {5, 9, 255}) {
        Result<KvDtype> bad = KvDtypeFromWireCode(static_cast<uint8_t>(code));
        ASSERT_FALSE(bad.ok()) << code;
        EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
        EXPECT_NE(bad.status().message().find("dtype=" + std::to_string(code)), std::string::npos);
    }
}

TEST(KvPiece, ValidateRejectsEachBadField) {
    struct Case {
        const char* name;
        void (*mutate)(KvPiece&);
        const char* message_part;
    };
    const Case cases[] = {
        {"negative layer", [](KvPiece& p) { p.header.layer_begin = -1; }, "layer_begin=-1"},
        {"empty layers", [](KvPiece& p) { p.header.layer_end = p.header.layer_begin; }, "layers"},
        {"negative head", [](KvPiece& p) { p.header.head_begin = -2; }, "head_begin=-2"},
        {"inverted heads", [](KvPiece& p) { p.header.head_end = 0; }, "heads"},
        {"no blocks", [](KvPiece& p) { p.header.num_blocks = 0; }, "num_blocks=0"},
        {"block size", [](KvPiece& p) { p.header.block_size = -4; }, "block_size=-4"},
        {"head dim", [](KvPiece& p) { p.header.head_dim = 0; }, "head_dim=0"},
        {"short data", [](KvPiece& p) { p.data.pop_back(); }, "data bytes"},
        {"long data", [](KvPiece& p) { p.data.push_back(0); }, "data bytes"},
        {"overflowing sizes",
         [](KvPiece& p) {
             p.header.num_blocks = 1 << 30;
             p.header.block_size = 1 << 30;
         },
         "exceeds"},
    };
    ASSERT_TRUE(ValidateKvPiece(Piece(1, 0, 2, 1, 3)).ok());
    for (const Case& c : cases) {
        KvPiece piece = Piece(1, 0, 2, 1, 3);
        c.mutate(piece);
        const Status status = ValidateKvPiece(piece);
        EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.name;
        EXPECT_NE(status.message().find(c.message_part), std::string::npos)
            << c.name << ": " << status.message();
    }
}

TEST(KvPiece, WireHeaderRoundTripsAndRejectsCorruption) {
    const KvPiece piece = Piece(0x0102030405060708ull, 3, 5, 1, 2);
    const internal::KvPieceFrameHeader bytes =
        internal::EncodeKvPieceFrameHeader(piece.header, piece.data.size(), 0xdeadbeef01234567ull);
    Result<internal::DecodedKvPieceFrame> decoded = internal::DecodeKvPieceFrameHeader(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->header, piece.header);
    EXPECT_EQ(decoded->payload_bytes, piece.data.size());
    EXPECT_EQ(decoded->payload_hash, 0xdeadbeef01234567ull);
    EXPECT_FALSE(decoded->in_region);

    struct Case {
        size_t offset;
        uint8_t value;
        StatusCode code;
    };
    const Case cases[] = {
        {0, 'X', StatusCode::kDataLoss},        // magic
        {4, 1, StatusCode::kUnimplemented},     // version (1: before the handshake)
        {6, 5, StatusCode::kInvalidArgument},   // dtype (codes 0-4)
        {7, 2, StatusCode::kDataLoss},          // unknown flag
        {20, 0, StatusCode::kInvalidArgument},  // layer_end 0 < layer_begin
        {44, 0xff, StatusCode::kDataLoss},      // payload length vs header
    };
    for (const Case& c : cases) {
        internal::KvPieceFrameHeader bad = bytes;
        bad[c.offset] = c.value;
        EXPECT_EQ(internal::DecodeKvPieceFrameHeader(bad).status().code(), c.code) << c.offset;
    }
}

TEST(KvPiece, HelloAndTransferFramesRoundTripAndRejectCorruption) {
    const std::string hello = internal::EncodeKvHello("tok");
    ASSERT_EQ(hello.size(), internal::kKvHelloHeaderBytes + 3);
    std::array<uint8_t, internal::kKvHelloHeaderBytes> h{};
    std::copy_n(hello.begin(), h.size(), h.begin());
    ASSERT_EQ(internal::DecodeKvHelloHeader(h).value(), 3);
    auto bad_hello = [&](size_t offset, uint8_t value) {
        auto b = h;
        b[offset] = value;
        return internal::DecodeKvHelloHeader(b).status().code();
    };
    EXPECT_EQ(bad_hello(0, 'X'), StatusCode::kDataLoss);
    EXPECT_EQ(bad_hello(4, 1), StatusCode::kUnimplemented);
    EXPECT_EQ(bad_hello(7, 0xff), StatusCode::kDataLoss);  // a 65 KB token
    EXPECT_TRUE(internal::KvTokensEqual("abc", "abc"));
    EXPECT_FALSE(internal::KvTokensEqual("abc", "abd"));
    EXPECT_FALSE(internal::KvTokensEqual("abc", "ab"));

    const internal::KvTransferFrame t = internal::EncodeKvTransferFrame(0x1122334455667788ull);
    EXPECT_EQ(internal::DecodeKvFrameKind(t.data()).value(), internal::KvFrameKind::kTransfer);
    EXPECT_EQ(internal::DecodeKvTransferFrame(t).value(), 0x1122334455667788ull);
    auto bad_transfer = [&](size_t offset, uint8_t value) {
        auto b = t;
        b[offset] = value;
        return internal::DecodeKvTransferFrame(b).status().code();
    };
    EXPECT_EQ(bad_transfer(0, 'X'), StatusCode::kDataLoss);
    EXPECT_EQ(bad_transfer(5, 1), StatusCode::kUnimplemented);
    EXPECT_EQ(bad_transfer(6, 1), StatusCode::kDataLoss);
    const uint8_t garbage[4] = {'K', 'V', 'S', 'X'};
    EXPECT_EQ(internal::DecodeKvFrameKind(garbage).status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace kvshard::testing
