// SocketKvPairChannel (comm/socket_kv_pair_channel.h): the test pair link over TCP.
#include "comm/socket_kv_pair_channel.h"

// clang-format off
#include <utility>  // Boost 1.74's asio needs it first
#include <boost/asio.hpp>
// clang-format on

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>
#include <vector>

#include "comm/kv_nccl_pairs.h"
#include "comm/tcp_listen.h"
#include "common/host_port.h"

namespace kvshard {
namespace {

using tcp = boost::asio::ip::tcp;
using Clock = KvPairChannel::Clock;

constexpr std::array<char, 4> kHelloMagic = {'K', 'V', 'P', 'L'};
constexpr std::array<char, 4> kDataMagic = {'K', 'V', 'P', 'D'};
constexpr size_t kHelloBytes = 4 + kKvNcclUniqueIdBytes;
constexpr size_t kDataHeaderBytes = 4 + 8;
// Between two connection attempts of the sender while the receiver is not listening yet.
constexpr auto kConnectRetry = std::chrono::milliseconds(20);

// The test link's fault knob (header): whether this process's send number `n` (1-based) fails.
// InvalidArgument naming the variable for a value that is not a list of positive numbers.
Result<bool> SendFailsByKnob(uint64_t n) {
    static const Result<std::vector<uint64_t>> listed = []() -> Result<std::vector<uint64_t>> {
        const char* env = std::getenv(kSocketKvPairFailSendsVariable.data());
        std::vector<uint64_t> out;
        if (env == nullptr || *env == '\0') return out;
        std::string_view rest(env);
        while (!rest.empty()) {
            const size_t comma = rest.find(',');
            const std::string_view item = rest.substr(0, comma);
            uint64_t v = 0;
            const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
            if (ec != std::errc() || end != item.data() + item.size() || v == 0) {
                return InvalidArgument(std::string(kSocketKvPairFailSendsVariable) + "='" + env +
                                       "': not a list of send numbers from 1, such as 2 or 2,5");
            }
            out.push_back(v);
            rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
        }
        return out;
    }();
    KV_RETURN_IF_ERROR(listed.status());
    return std::find(listed->begin(), listed->end(), n) != listed->end();
}

std::atomic<uint64_t> g_sends{0};  // this process's sends on the socket link, for the knob

std::string RandomHex(size_t bytes) {
    std::string raw(bytes, '\0');
    size_t got = 0;
    while (got < bytes) {
        const ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<size_t>(n);
    }
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out;
    for (char c : raw) {
        out.push_back(kDigits[(static_cast<unsigned char>(c) >> 4) & 15]);
        out.push_back(kDigits[static_cast<unsigned char>(c) & 15]);
    }
    return out;
}

Result<HostPort> AddressOf(const std::string& id) {
    if (!IsSocketKvPairId(id)) {
        return InvalidArgument("KV pair socket link: the pair's id (" + std::to_string(id.size()) +
                               " bytes) is not one NewSocketKvPairId made");
    }
    const size_t begin = kSocketKvPairIdPrefix.size();
    const size_t end = id.find(' ', begin);
    if (end == std::string::npos)
        return InvalidArgument("KV pair socket link: the pair's id names no address");
    Result<HostPort> hp = ParseHostPort(std::string_view(id).substr(begin, end - begin));
    if (!hp.ok()) return hp.status().WithContext("KV pair socket link");
    return hp;
}

class SocketKvPairChannel final : public KvPairChannel {
  public:
    SocketKvPairChannel(std::string id, HostPort where, int rank)
        : id_(std::move(id)),
          where_(std::move(where)),
          rank_(rank),
          socket_(io_),
          acceptor_(io_),
          who_("KV pair socket rank " + std::to_string(rank) + " (" + where_.host + ":" +
               std::to_string(where_.port) + ")") {}

    ~SocketKvPairChannel() override { CloseAll(); }

    Status Listen() { return internal::ListenOn(acceptor_, where_.host, where_.port); }

    Status Send(const void* src, size_t bytes, Clock::time_point deadline) override {
        if (rank_ != 0) return InvalidArgument(who_ + ": Send on the receiving rank");
        KV_RETURN_IF_ERROR(BeginCall());
        Status st = connected_ ? Status::Ok() : Connect(deadline);
        if (st.ok()) {
            const uint64_t n = ++g_sends;
            Result<bool> fails = SendFailsByKnob(n);
            if (!fails.ok()) {
                st = fails.status();
            } else if (*fails) {
                st = Unavailable(who_ + ": send " + std::to_string(n) +
                                 " of this process failed by " +
                                 std::string(kSocketKvPairFailSendsVariable) + " (a test's fault)");
            }
        }
        if (st.ok()) {
            std::array<uint8_t, kDataHeaderBytes> header{};
            std::memcpy(header.data(), kDataMagic.data(), kDataMagic.size());
            const uint64_t n = bytes;
            for (int i = 0; i < 8; ++i) header[4 + i] = static_cast<uint8_t>(n >> (8 * i));
            const std::array<boost::asio::const_buffer, 2> buffers = {
                boost::asio::buffer(header), boost::asio::buffer(src, bytes)};
            st =
                Transfer([&](auto handler) { boost::asio::async_write(socket_, buffers, handler); },
                         deadline, "send of " + std::to_string(bytes) + " bytes");
        }
        return EndCall(st);
    }

    Status Recv(void* dst, size_t bytes, Clock::time_point deadline) override {
        if (rank_ != 1) return InvalidArgument(who_ + ": Recv on the sending rank");
        KV_RETURN_IF_ERROR(BeginCall());
        Status st = connected_ ? Status::Ok() : Accept(deadline);
        std::array<uint8_t, kDataHeaderBytes> header{};
        const std::string what = "receive of " + std::to_string(bytes) + " bytes";
        if (st.ok()) {
            st = Transfer(
                [&](auto handler) {
                    boost::asio::async_read(socket_, boost::asio::buffer(header), handler);
                },
                deadline, what);
        }
        if (st.ok()) {
            uint64_t n = 0;
            for (int i = 0; i < 8; ++i) n |= uint64_t{header[4 + i]} << (8 * i);
            if (std::memcmp(header.data(), kDataMagic.data(), kDataMagic.size()) != 0) {
                st = DataLoss(who_ + ": " + what + ": not a KV pair frame");
            } else if (n != bytes) {
                st = DataLoss(who_ + ": " + what + ": the sender sent " + std::to_string(n) +
                              " (transfers out of order)");
            }
        }
        if (st.ok() && bytes > 0) {
            st = Transfer(
                [&](auto handler) {
                    boost::asio::async_read(socket_, boost::asio::buffer(dst, bytes), handler);
                },
                deadline, what);
        }
        return EndCall(st);
    }

    void Abort(const Status& why) override {
        std::lock_guard lock(mu_);
        if (failed_.ok()) failed_ = Aborted(who_ + " aborted: " + why.ToString());
        if (in_call_) {
            // The caller's thread runs io_: close there, which ends its operation at once.
            boost::asio::post(io_, [this] { CloseAll(); });
        } else {
            CloseAll();
        }
    }

    int rank() const override { return rank_; }

  private:
    Status BeginCall() {
        std::lock_guard lock(mu_);
        if (!failed_.ok()) return failed_;
        in_call_ = true;
        return Status::Ok();
    }

    // Records the call's error as the channel's failure (the first one wins) and closes.
    Status EndCall(const Status& st) {
        std::lock_guard lock(mu_);
        in_call_ = false;
        if (!st.ok() && failed_.ok()) failed_ = st;
        if (!failed_.ok()) {
            CloseAll();
            return failed_;
        }
        return Status::Ok();
    }

    Status Failure() {
        std::lock_guard lock(mu_);
        return failed_;
    }

    void CloseAll() {
        boost::system::error_code ignored;
        socket_.close(ignored);
        acceptor_.close(ignored);
    }

    // Runs io_ on this thread until `done` or `deadline`; past the deadline closes the sockets so
    // that the pending operation completes. Returns whether `done` came first.
    bool RunUntil(const bool& done, Clock::time_point deadline) {
        io_.restart();
        while (!done && Clock::now() < deadline) {
            if (io_.run_one_until(deadline) == 0 && io_.stopped()) break;
        }
        if (done) return true;
        CloseAll();
        io_.restart();
        while (!done && io_.run_one() != 0) {
        }
        return false;
    }

    // One asynchronous read or write started by `start(handler)`, run to its end.
    template <typename Start>
    Status Transfer(Start start, Clock::time_point deadline, const std::string& what) {
        bool done = false;
        boost::system::error_code ec;
        start([&](const boost::system::error_code& e, size_t) {
            ec = e;
            done = true;
        });
        if (!RunUntil(done, deadline)) {
            return Status(StatusCode::kDeadlineExceeded,
                          who_ + ": " + what + ": not done by the deadline");
        }
        if (!ec) return Status::Ok();
        {
            std::lock_guard lock(mu_);
            if (!failed_.ok()) return failed_;  // Abort closed the socket under the operation
        }
        if (ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset ||
            ec == boost::asio::error::broken_pipe) {
            return Unavailable(who_ + ": " + what + ": the peer closed the connection (" +
                               ec.message() + ")");
        }
        return Unavailable(who_ + ": " + what + ": " + ec.message());
    }

    // Rank 0: connects (retrying while the receiver is not listening yet) and says hello.
    Status Connect(Clock::time_point deadline) {
        boost::system::error_code ec;
        const auto address = boost::asio::ip::make_address(where_.host, ec);
        if (ec) return InvalidArgument(who_ + ": '" + where_.host + "' is not an IP address");
        const tcp::endpoint endpoint(address, where_.port);
        for (;;) {
            KV_RETURN_IF_ERROR(Failure());
            bool done = false;
            socket_ = tcp::socket(io_);
            socket_.async_connect(endpoint, [&](const boost::system::error_code& e) {
                ec = e;
                done = true;
            });
            if (!RunUntil(done, deadline)) {
                return Status(StatusCode::kDeadlineExceeded,
                              who_ + ": the receiving rank did not accept by the deadline");
            }
            if (!ec) break;
            {
                std::lock_guard lock(mu_);
                if (!failed_.ok()) return failed_;
            }
            if (Clock::now() + kConnectRetry >= deadline) {
                return Status(StatusCode::kDeadlineExceeded,
                              who_ + ": could not connect by the deadline (" + ec.message() + ")");
            }
            boost::asio::steady_timer wait(io_, kConnectRetry);
            bool waited = false;
            wait.async_wait([&](const boost::system::error_code&) { waited = true; });
            RunUntil(waited, deadline);
        }
        socket_.set_option(tcp::no_delay(true), ec);
        std::string hello(kHelloMagic.begin(), kHelloMagic.end());
        hello += id_;
        KV_RETURN_IF_ERROR(Transfer(
            [&](auto handler) {
                boost::asio::async_write(socket_, boost::asio::buffer(hello), handler);
            },
            deadline, "hello"));
        connected_ = true;
        return Status::Ok();
    }

    // Rank 1: accepts connections until one says hello with this pair's id.
    Status Accept(Clock::time_point deadline) {
        for (;;) {
            KV_RETURN_IF_ERROR(Failure());
            tcp::socket peer(io_);
            bool done = false;
            boost::system::error_code ec;
            acceptor_.async_accept(peer, [&](const boost::system::error_code& e) {
                ec = e;
                done = true;
            });
            if (!RunUntil(done, deadline)) {
                return Status(StatusCode::kDeadlineExceeded,
                              who_ + ": the sending rank did not connect by the deadline");
            }
            if (ec) {
                std::lock_guard lock(mu_);
                if (!failed_.ok()) return failed_;
                return Unavailable(who_ + ": accept: " + ec.message());
            }
            std::string hello(kHelloBytes, '\0');
            bool read = false;
            boost::asio::async_read(peer, boost::asio::buffer(hello),
                                    [&](const boost::system::error_code& e, size_t) {
                                        ec = e;
                                        read = true;
                                    });
            if (!RunUntil(read, deadline)) {
                return Status(StatusCode::kDeadlineExceeded,
                              who_ + ": no hello from the sending rank by the deadline");
            }
            if (!ec &&
                hello.compare(0, kHelloMagic.size(), kHelloMagic.data(), kHelloMagic.size()) == 0 &&
                hello.compare(kHelloMagic.size(), std::string::npos, id_) == 0) {
                peer.set_option(tcp::no_delay(true), ec);
                socket_ = std::move(peer);
                boost::system::error_code ignored;
                acceptor_.close(ignored);  // one connection per pair
                connected_ = true;
                return Status::Ok();
            }
            // Not this pair's sender: drop it and keep listening.
        }
    }

    const std::string id_;
    const HostPort where_;
    const int rank_;
    boost::asio::io_context io_;  // run only by the caller of Send/Recv
    tcp::socket socket_;
    tcp::acceptor acceptor_;
    const std::string who_;
    bool connected_ = false;  // the caller's thread only
    std::mutex mu_;
    Status failed_;         // guarded by mu_
    bool in_call_ = false;  // guarded by mu_
};

}  // namespace

bool IsSocketKvPairId(const std::string& id) {
    return id.size() == kKvNcclUniqueIdBytes &&
           std::string_view(id).substr(0, kSocketKvPairIdPrefix.size()) == kSocketKvPairIdPrefix;
}

Result<std::string> NewSocketKvPairId(const std::string& host) {
    boost::asio::io_context io;
    tcp::acceptor probe(io);
    KV_RETURN_IF_ERROR(internal::ListenOn(probe, host, 0).WithContext("KV pair socket id"));
    const uint16_t port = probe.local_endpoint().port();
    boost::system::error_code ignored;
    probe.close(ignored);
    std::string id = std::string(kSocketKvPairIdPrefix) + host + ":" + std::to_string(port) + " " +
                     RandomHex(32);
    if (id.size() > kKvNcclUniqueIdBytes)
        return InvalidArgument("KV pair socket id: host '" + host + "' is too long");
    id.resize(kKvNcclUniqueIdBytes, '\0');
    return id;
}

Result<std::unique_ptr<KvPairChannel>> MakeSocketKvPairChannel(const std::string& id, int rank) {
    if (rank != 0 && rank != 1)
        return InvalidArgument("KV pair socket link: rank " + std::to_string(rank) +
                               " is not 0 (sends) or 1 (receives)");
    KV_ASSIGN_OR_RETURN(HostPort where, AddressOf(id));
    auto channel = std::make_unique<SocketKvPairChannel>(id, where, rank);
    if (rank == 1) KV_RETURN_IF_ERROR(channel->Listen());
    return std::unique_ptr<KvPairChannel>(std::move(channel));
}

}  // namespace kvshard
