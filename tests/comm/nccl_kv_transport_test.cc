// NcclKvChannel (comm/nccl_kv_transport.h) on real GPUs: two ranks on two devices, one thread
// each. Skips without the devices; the argument checks run wherever CUDA is built in. Without
// KVSHARD_WITH_CUDA the channel does not exist and this file has no tests.
#include "common/build_config.h"

#if KVSHARD_WITH_CUDA

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/nccl_kv_transport.h"
#include "common/device.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;

NcclKvChannelConfig Config(const std::string& id, int rank, int64_t init_timeout_ms = 60'000) {
    NcclKvChannelConfig config;
    config.nccl_unique_id = id;
    config.rank = rank;
    config.cuda_device = rank;
    config.init_timeout_ms = init_timeout_ms;
    return config;
}

// Rank 0 sends `bytes` of a pattern to rank 1, then rank 1 sends them back; both copy out what
// they received.
Status RunRank(const std::string& id, int rank, size_t bytes, std::vector<uint8_t>* received) {
    KV_RETURN_IF_ERROR(SetDevice(rank));
    // Rank 1 moves its blocks on a stream of its own, rank 0 on the channel's.
    DeviceStream stream;
    if (rank == 1) {
        KV_ASSIGN_OR_RETURN(stream, DeviceStream::Create());
    }
    KV_ASSIGN_OR_RETURN(std::unique_ptr<NcclKvChannel> channel,
                        NcclKvChannel::Create(Config(id, rank)));
    if (channel->rank() != rank || channel->size() != 2) return Internal("rank or size");
    KV_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(bytes));
    std::vector<uint8_t> host(bytes);
    for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<uint8_t>(i * 131 + 7);
    if (rank == 1) host.assign(bytes, 0);
    KV_RETURN_IF_ERROR(buffer.CopyFromHost(host.data(), bytes));
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    const int peer = 1 - rank;
    const StreamHandle s = stream.get();
    Status status = rank == 0 ? channel->SendBlocks(buffer.data(), bytes, peer, s, deadline)
                              : channel->RecvBlocks(buffer.data(), bytes, peer, s, deadline);
    if (status.ok()) {
        if (rank == 0) {
            const std::vector<uint8_t> zeros(bytes, 0);
            KV_RETURN_IF_ERROR(buffer.CopyFromHost(zeros.data(), bytes));
        }
        status = rank == 1 ? channel->SendBlocks(buffer.data(), bytes, peer, s, deadline)
                           : channel->RecvBlocks(buffer.data(), bytes, peer, s, deadline);
    }
    received->resize(bytes);
    KV_RETURN_IF_ERROR(buffer.CopyToHost(received->data(), bytes));
    return status;
}

TEST(NcclKvChannelGpu, SendsBlocksBetweenTwoDevices) {
    if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << DeviceCount() << " visible";
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    constexpr size_t kBytes = (size_t{3} << 20) + 5;  // not a multiple of anything NCCL likes
    Status statuses[2];
    std::vector<uint8_t> received[2];
    std::thread rank1([&] { statuses[1] = RunRank(*id, 1, kBytes, &received[1]); });
    statuses[0] = RunRank(*id, 0, kBytes, &received[0]);
    rank1.join();
    ASSERT_TRUE(statuses[0].ok()) << statuses[0].ToString();
    ASSERT_TRUE(statuses[1].ok()) << statuses[1].ToString();
    std::vector<uint8_t> expected(kBytes);
    for (size_t i = 0; i < kBytes; ++i) expected[i] = static_cast<uint8_t>(i * 131 + 7);
    EXPECT_EQ(received[1], expected);  // what rank 0 sent
    EXPECT_EQ(received[0], expected);  // and rank 1 sent back
}

// A pair with only one member never forms: the deadline ends the wait and the communicator is
// aborted instead of hanging.
TEST(NcclKvChannelGpu, MissingPeerTimesOut) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    const Clock::time_point start = Clock::now();
    const Status status = NcclKvChannel::Create(Config(*id, 0, 2'000)).status();
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
}

TEST(NcclKvChannel, RejectsBadArguments) {
    struct Case {
        const char* name;
        NcclKvChannelConfig config;
        StatusCode code;
    };
    const std::string id(128, '\0');
    const Case cases[] = {
        {"short id", Config("short", 0), StatusCode::kInvalidArgument},
        {"rank 2", Config(id, 2), StatusCode::kInvalidArgument},
        {"timeout", Config(id, 0, 0), StatusCode::kInvalidArgument},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(NcclKvChannel::Create(c.config).status().code(), c.code) << c.name;
    }
    NcclKvChannelConfig no_device = Config(id, 0);
    no_device.cuda_device = 1'000;
    EXPECT_EQ(NcclKvChannel::Create(no_device).status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(NcclKvChannel::Adopt(nullptr, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard

#endif  // KVSHARD_WITH_CUDA
