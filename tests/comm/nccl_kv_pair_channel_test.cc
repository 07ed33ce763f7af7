// The NCCL KvPairChannel (comm/nccl_kv_pair_channel.h) under the transfer protocol
// (comm/kv_pair_protocol.h) on real GPUs: a prefill rank and a decode rank on two devices, the
// sender's thread sending and the receiver announcing then receiving into device memory. Skips
// without the devices (NCCL refuses two ranks of one communicator on one GPU); the argument
// checks run wherever CUDA is built in. Without KVSHARD_WITH_CUDA this file has no tests.
#include "common/build_config.h"

#if KVSHARD_WITH_CUDA

#include <gtest/gtest.h>

#include <future>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/kv_pair_protocol.h"
#include "comm/nccl_kv_pair_channel.h"
#include "common/device.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kBytesPerBlock = 4096 + 7;  // not a multiple of anything NCCL likes
constexpr int kTransfers = 3;

NcclKvPairChannelConfig Config(const std::string& id, int rank, int64_t init_timeout_ms = 60'000) {
    NcclKvPairChannelConfig config;
    config.nccl_unique_id = id;
    config.rank = rank;
    config.cuda_device = rank;
    config.init_timeout_ms = init_timeout_ms;
    return config;
}

uint8_t Pattern(int transfer, size_t i) { return static_cast<uint8_t>(i * 131 + 7 * transfer + 1); }

// Holds kTransfers transfers of 1, 2, 3 blocks in device buffers until the receiver is finished
// (the sender is published through `started`, nullptr when setting up failed), then closes the
// sender; every transfer must have been sent by then.
Status RunSender(const std::string& id, std::promise<KvPairSender*>* started,
                 std::future<void> finished) {
    std::vector<std::promise<Status>> done(kTransfers);
    std::vector<DeviceBuffer> buffers;
    std::unique_ptr<KvPairChannel> channel;
    std::unique_ptr<KvPairSender> sender;
    const Status set_up = [&]() -> Status {
        KV_RETURN_IF_ERROR(SetDevice(0));
        KV_ASSIGN_OR_RETURN(channel, MakeNcclKvPairChannel(Config(id, 0)));
        for (int t = 1; t <= kTransfers; ++t) {
            const size_t bytes = static_cast<size_t>(t * kBytesPerBlock);
            KV_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(bytes));
            std::vector<uint8_t> host(bytes);
            for (size_t i = 0; i < bytes; ++i) host[i] = Pattern(t, i);
            KV_RETURN_IF_ERROR(buffer.CopyFromHost(host.data(), bytes));
            buffers.push_back(std::move(buffer));
        }
        sender = std::make_unique<KvPairSender>(channel.get(), 60'000, kTransfers);
        for (int t = 1; t <= kTransfers; ++t) {
            KV_RETURN_IF_ERROR(
                sender->Offer({static_cast<uint64_t>(t), t, kBytesPerBlock}, buffers[t - 1].data(),
                              [&done, t](const Status& s) { done[t - 1].set_value(s); }));
        }
        return Status::Ok();
    }();
    started->set_value(set_up.ok() ? sender.get() : nullptr);
    if (!set_up.ok()) return set_up;
    finished.wait();  // the receiver no longer calls Ready
    sender.reset();   // ends whatever was not sent (Aborted)
    for (auto& d : done) KV_RETURN_IF_ERROR(d.get_future().get());
    return Status::Ok();
}

TEST(NcclKvPairChannelGpu, ProtocolMovesTransfersBetweenTwoDevices) {
    if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << DeviceCount() << " visible";
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    std::promise<KvPairSender*> started;
    std::promise<void> finished;
    Status sender_status;
    std::thread prefill([&] { sender_status = RunSender(*id, &started, finished.get_future()); });
    Status receiver_status = [&]() -> Status {
        KV_RETURN_IF_ERROR(SetDevice(1));
        KV_ASSIGN_OR_RETURN(std::unique_ptr<KvPairChannel> channel,
                            MakeNcclKvPairChannel(Config(*id, 1)));
        KvPairSender* sender = started.get_future().get();
        if (sender == nullptr) return Internal("the sender did not start");
        KvPairReceiver receiver(
            channel.get(), {kTransfers, kBytesPerBlock},
            [sender](uint64_t t) { return sender->Ready(t); }, 60'000);
        for (int t = 1; t <= kTransfers; ++t) {
            const size_t bytes = static_cast<size_t>(t * kBytesPerBlock);
            KV_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(bytes));
            KV_RETURN_IF_ERROR(receiver.Receive({static_cast<uint64_t>(t), t, kBytesPerBlock},
                                                buffer.data(), bytes));
            std::vector<uint8_t> host(bytes);
            KV_RETURN_IF_ERROR(buffer.CopyToHost(host.data(), bytes));
            for (size_t i = 0; i < bytes; ++i) {
                if (host[i] != Pattern(t, i)) {
                    return Internal("transfer " + std::to_string(t) + " byte " + std::to_string(i) +
                                    " differs");
                }
            }
        }
        return Status::Ok();
    }();
    finished.set_value();
    prefill.join();
    EXPECT_TRUE(sender_status.ok()) << sender_status.ToString();
    EXPECT_TRUE(receiver_status.ok()) << receiver_status.ToString();
}

// A pair with only one member never forms: the deadline ends the wait, no hang.
TEST(NcclKvPairChannelGpu, MissingPeerTimesOut) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    const Clock::time_point start = Clock::now();
    const Status status = MakeNcclKvPairChannel(Config(*id, 1, 2'000)).status();
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
}

// A worker closing its pairs ends a join still waiting for its peer at the next poll, not after
// init_timeout_ms (KvPairHandoff::MakerOf's `cancelled`).
TEST(NcclKvPairChannelGpu, CancelledJoinEndsAtOnce) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    const Clock::time_point start = Clock::now();
    NcclKvPairChannelConfig config = Config(*id, 1, 120'000);
    config.cancelled = [start] { return Clock::now() - start > std::chrono::milliseconds(300); };
    const Status status = MakeNcclKvPairChannel(config).status();
    EXPECT_EQ(status.code(), StatusCode::kAborted) << status.ToString();
    EXPECT_NE(status.message().find("cancelled"), std::string::npos)
        << status.ToString();
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
}

TEST(NcclKvPairChannel, RejectsBadArguments) {
    struct Case {
        const char* name;
        NcclKvPairChannelConfig config;
        StatusCode code;
    };
    const std::string id(128, '\0');
    NcclKvPairChannelConfig no_device = Config(id, 0);
    no_device.cuda_device = DeviceCount();
    const Case cases[] = {
        {"short id", Config("short", 0), StatusCode::kInvalidArgument},
        {"rank 2", Config(id, 2), StatusCode::kInvalidArgument},
        {"rank -1", Config(id, -1), StatusCode::kInvalidArgument},
        {"timeout", Config(id, 0, 0), StatusCode::kInvalidArgument},
        {"device beyond those visible", no_device, StatusCode::kUnavailable},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(MakeNcclKvPairChannel(c.config).status().code(), c.code) << c.name;
    }
}

}  // namespace
}  // namespace kvshard

#endif  // KVSHARD_WITH_CUDA
