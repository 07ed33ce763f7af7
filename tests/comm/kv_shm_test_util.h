// Helpers shared by the shared-memory KV path's tests (kv_shm_test.cc, kv_shm_refusal_test.cc,
// kv_shm_dead_peer_test.cc): large pieces of one shape, a region of the smallest size, counts of
// this process's region descriptors, region mappings and open descriptors (the tests compare them
// before and after), a hand-written receiver's handshake, and RawSender, a sender on a raw socket
// that offers a region of its own making. Builds on kv_transport_test_util.h (In, Tcp).
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <fstream>
#include <string>

#include "comm/kv_transport.h"
#include "comm/shm_region.h"
#include "comm/tcp_kv_wire.h"
#include "common/check.h"
#include "tests/comm/kv_transport_test_util.h"

namespace kvshard::testing {

// `blocks` blocks of 4 layers x 6 heads x 4 slots x 8 dims of f32: 1.5 KiB a block-layer.
inline KvPiece Piece(uint64_t transfer_id, int32_t blocks) {
    KvPiece piece;
    piece.header = {.transfer_id = transfer_id,
                    .layer_begin = 0,
                    .layer_end = 4,
                    .head_begin = 0,
                    .head_end = 6,
                    .num_blocks = blocks,
                    .block_size = 4,
                    .head_dim = 8,
                    .dtype = KvDtype::kFp32};
    piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
    for (size_t i = 0; i < piece.data.size(); ++i) {
        piece.data[i] = static_cast<uint8_t>((i * 2654435761u) >> 13 ^ transfer_id);
    }
    return piece;
}

inline KvTransportOptions SmallRegion() {
    KvTransportOptions options;
    options.shm_region_bytes = internal::kMinKvShmRegionBytes;  // 4 slots of 16 KiB
    return options;
}

inline constexpr char kRegionFile[] = "/memfd:kvshard-kv-";

// Descriptors of this process open on a region (the receiver's, and the sender's).
inline int ShmDescriptors() {
    int n = 0;
    DIR* dir = opendir("/proc/self/fd");
    KV_CHECK(dir != nullptr);
    while (dirent* e = readdir(dir)) {
        char target[512] = {};
        const std::string path = std::string("/proc/self/fd/") + e->d_name;
        const ssize_t len = readlink(path.c_str(), target, sizeof(target) - 1);
        if (len > 0 && std::string(target, len).rfind(kRegionFile, 0) == 0) ++n;
    }
    closedir(dir);
    return n;
}

// Every descriptor this process has open.
inline int OpenDescriptors() {
    int n = 0;
    DIR* dir = opendir("/proc/self/fd");
    KV_CHECK(dir != nullptr);
    while (dirent* e = readdir(dir)) {
        if (e->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n - 1;  // the directory's own
}

// Mappings of regions in this process (the receiver's, and the sender's).
inline int ShmMappings() {
    std::ifstream maps("/proc/self/maps");
    int n = 0;
    for (std::string line; std::getline(maps, line);) {
        if (line.find(kRegionFile) != std::string::npos) ++n;
    }
    return n;
}

inline bool SameHostPathAvailable() {
    if (internal::KvHostBootId().empty()) return false;
    Result<internal::KvShmSenderRegion> probe =
        internal::KvShmSenderRegion::Create(internal::kMinKvShmRegionBytes);
    return probe.ok();
}

// A hand-written receiver's side of the handshake on an accepted `socket`: reads the hello and
// answers it with this host's boot id, then reads the sender's offer of a region and accepts it.
// False when the offer does not decode; I/O errors land in `ec` (a test reads on until it is set).
inline bool AcceptHelloAndRegion(tcp::socket& socket, boost::system::error_code& ec) {
    std::array<uint8_t, internal::kKvHelloHeaderBytes> hello{};
    asio::read(socket, asio::buffer(hello), ec);
    asio::write(socket,
                asio::buffer(internal::EncodeKvAckFrame(
                    0, Status(StatusCode::kOk, internal::KvHostBootId()))),
                ec);
    std::array<uint8_t, internal::kKvOfferFrameHeaderBytes> offer{};
    asio::read(socket, asio::buffer(offer), ec);
    Result<internal::DecodedKvOfferHeader> decoded = internal::DecodeKvOfferFrameHeader(offer);
    if (!decoded.ok()) return false;
    std::string name(decoded->name_bytes, '\0');
    asio::read(socket, asio::buffer(name), ec);
    asio::write(socket, asio::buffer(internal::EncodeKvAckFrame(0, Status::Ok())), ec);
    return true;
}

// A hand-written sender on a raw socket that offers a region of its own making.
class RawSender {
  public:
    explicit RawSender(const KvTransport& receiver) : socket_(io_) {
        const std::string& e = receiver.endpoint();
        const auto port = static_cast<uint16_t>(std::stoi(e.substr(e.rfind(':') + 1)));
        socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    }

    void Write(const void* data, size_t n) {
        boost::system::error_code ignored;  // a receiver that already closed is what tests check
        asio::write(socket_, asio::buffer(data, n), ignored);
    }
    void Write(const std::string& s) { Write(s.data(), s.size()); }
    template <size_t N>
    void Write(const std::array<uint8_t, N>& a) {
        Write(a.data(), a.size());
    }

    // The next frame from the receiver: an acknowledgement's status, or OK for a credit;
    // Internal when the connection closed first.
    Status Read(bool* was_credit = nullptr) {
        std::array<uint8_t, internal::kKvAckFrameHeaderBytes> header{};
        boost::system::error_code ec;
        asio::read(socket_, asio::buffer(header), ec);
        if (ec) return Status(StatusCode::kInternal, "closed: " + ec.message());
        if (was_credit != nullptr) *was_credit = internal::IsKvCreditFrame(header.data());
        if (internal::IsKvCreditFrame(header.data())) return Status::Ok();
        Result<internal::DecodedKvAckHeader> ack = internal::DecodeKvAckFrameHeader(header);
        if (!ack.ok()) return Status(StatusCode::kInternal, ack.status().ToString());
        std::string message(ack->message_bytes, '\0');
        asio::read(socket_, asio::buffer(message), ec);
        if (ec) return Status(StatusCode::kInternal, "cut short");
        last_message_ = message;
        return Status(ack->code, message);
    }

    // Whether the receiver closed the connection (anything before the end is dropped).
    bool Closed() {
        std::array<uint8_t, 256> buffer{};
        boost::system::error_code ec;
        while (!ec) socket_.read_some(asio::buffer(buffer), ec);
        return ec == asio::error::eof || ec == asio::error::connection_reset;
    }

    // Hello, then an offer of `name` claiming `claimed` bytes; the offer's answer.
    Status HelloAndOffer(const std::string& name, uint64_t claimed) {
        Write(internal::EncodeKvHello(""));
        Status hello = Read();
        if (!hello.ok()) return hello.WithContext("hello");
        EXPECT_EQ(last_message_, internal::KvHostBootId());
        Write(internal::EncodeKvOfferFrame(name, claimed));
        return Read();
    }

    const std::string& last_message() const { return last_message_; }

  private:
    asio::io_context io_;
    tcp::socket socket_;
    std::string last_message_;
};

}  // namespace kvshard::testing

#define SKIP_WITHOUT_SHM() \
    if (!SameHostPathAvailable()) GTEST_SKIP() << "no boot id or no memfd_create here"
