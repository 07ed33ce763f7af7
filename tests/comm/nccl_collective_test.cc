// The NCCL communicator on real GPUs: one thread per device (up to 4), device buffers. Skips
// without a device; the argument checks run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "comm/collective.h"
#include "common/build_config.h"
#include "common/device.h"
#include "tests/comm/collective_test_util.h"

namespace kvshard {
namespace {

#if KVSHARD_WITH_CUDA

CollectiveConfig NcclConfig(const std::string& id, int rank, int size, int64_t timeout_ms) {
    CollectiveConfig config;
    config.kind = CollectiveConfig::Kind::kNccl;
    config.nccl_unique_id = id;
    config.rank = rank;
    config.size = size;
    config.cuda_device = rank;
    config.timeout_ms = timeout_ms;
    return config;
}

// One rank's work: copies to the device, runs the collectives, copies back.
struct RankOutput {
    Status status;
    std::vector<float> reduced, gathered;
    std::string broadcast;
    int64_t bytes_all_reduced = 0;
};

// Odd ranks queue their operations on a stream of the caller's, even ranks on the
// communicator's own.
Status RunRank(const std::string& id, int rank, int size, int64_t count, RankOutput* out) {
    KV_RETURN_IF_ERROR(SetDevice(rank));
    DeviceStream stream;
    if (rank % 2 == 1) {
        KV_ASSIGN_OR_RETURN(stream, DeviceStream::Create());
    }
    CollectiveConfig config = NcclConfig(id, rank, size, 60'000);
    config.cuda_stream = stream.get();
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Collective> c, MakeCollective(config));
    const std::vector<float> input = testing::RankInput(rank, count, 3);
    const size_t bytes = input.size() * sizeof(float);
    // Released before the communicator.
    KV_ASSIGN_OR_RETURN(DeviceBuffer data, DeviceBuffer::Allocate(bytes));
    KV_ASSIGN_OR_RETURN(DeviceBuffer gathered,
                        DeviceBuffer::Allocate(bytes * static_cast<size_t>(size)));
    KV_ASSIGN_OR_RETURN(DeviceBuffer text, DeviceBuffer::Allocate(16));
    KV_RETURN_IF_ERROR(data.CopyFromHost(input.data(), bytes));
    Status status = c->AllGather(data.floats(), count, gathered.floats());
    if (status.ok()) status = c->AllReduceSum(data.floats(), count);
    std::string message = rank == 0 ? "from rank zero.." : std::string(16, '?');
    KV_RETURN_IF_ERROR(text.CopyFromHost(message.data(), 16));
    if (status.ok()) status = c->Broadcast(text.data(), 16, 0);
    if (status.ok()) status = c->Barrier();
    out->reduced.resize(input.size());
    out->gathered.resize(input.size() * static_cast<size_t>(size));
    KV_RETURN_IF_ERROR(data.CopyToHost(out->reduced.data(), bytes));
    KV_RETURN_IF_ERROR(gathered.CopyToHost(out->gathered.data(), gathered.bytes()));
    KV_RETURN_IF_ERROR(text.CopyToHost(message.data(), 16));
    out->broadcast = message;
    out->bytes_all_reduced = c->bytes_all_reduced();
    return status;
}

TEST(NcclCollectiveGpu, CollectivesAcrossDevices) {
    const int devices = DeviceCount();
    if (devices == 0) GTEST_SKIP() << "no CUDA device";
    const int size = std::min(devices, 4);
    constexpr int64_t kCount = 10'001;
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    std::vector<RankOutput> outputs(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
        threads.emplace_back(
            [&, r] { outputs[r].status = RunRank(*id, r, size, kCount, &outputs[r]); });
    }
    for (std::thread& t : threads) t.join();

    // NCCL adds in its own order: equal to the rank-order sum within float rounding, and the
    // same bits on every rank.
    const std::vector<float> expected = testing::RankOrderSum(size, kCount, 3);
    for (int r = 0; r < size; ++r) {
        ASSERT_TRUE(outputs[r].status.ok()) << "rank " << r << ": " << outputs[r].status.ToString();
        EXPECT_TRUE(testing::SameBits(outputs[r].reduced, outputs[0].reduced)) << "rank " << r;
        for (int64_t i = 0; i < kCount; ++i) {
            ASSERT_NEAR(outputs[r].reduced[i], expected[i], 1e-5f * (1 + std::fabs(expected[i])))
                << "rank " << r << " element " << i;
        }
        for (int from = 0; from < size; ++from) {
            const std::vector<float> sent = testing::RankInput(from, kCount, 3);
            EXPECT_TRUE(
                std::equal(sent.begin(), sent.end(), outputs[r].gathered.begin() + from * kCount))
                << "rank " << r << " gathered from " << from;
        }
        EXPECT_EQ(outputs[r].broadcast, "from rank zero..");
        EXPECT_EQ(outputs[r].bytes_all_reduced, kCount * 4);
    }
}

// A group of two with only one member never forms: the deadline ends the wait, and the
// communicator is aborted instead of hanging.
TEST(NcclCollectiveGpu, MissingPeerTimesOut) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    const Status status = MakeCollective(NcclConfig(*id, 0, 2, 2'000)).status();
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
}

// The runner's mode: all-reduces queued on the caller's (compute) stream without a host wait,
// the next waiting call bounding them; and host buffers, staged through device memory.
TEST(NcclCollectiveGpu, StreamOrderedAndHostBuffers) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(SetDevice(0).ok());
    Result<std::string> id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    Result<DeviceStream> stream = DeviceStream::Create();
    ASSERT_TRUE(stream.ok());
    CollectiveConfig config = NcclConfig(*id, 0, 1, 60'000);
    config.cuda_stream = stream->get();
    config.nccl_stream_ordered = true;
    Result<std::unique_ptr<Collective>> c = MakeCollective(config);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    constexpr int64_t kCount = 4096;
    const std::vector<float> input = testing::RankInput(0, kCount, 3);
    const size_t bytes = input.size() * sizeof(float);
    Result<DeviceBuffer> data = DeviceBuffer::Allocate(bytes);
    Result<DeviceBuffer> gathered = DeviceBuffer::Allocate(bytes);
    ASSERT_TRUE(data.ok() && gathered.ok());
    ASSERT_TRUE(data->CopyFromHost(input.data(), bytes).ok());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*c)->AllReduceSum(data->floats(), kCount).ok());
    // Waits for the stream: the three queued all-reduces have run when it returns.
    ASSERT_TRUE((*c)->AllGather(data->floats(), kCount, gathered->floats()).ok());
    std::vector<float> out(input.size());
    ASSERT_TRUE(gathered->CopyToHost(out.data(), bytes).ok());
    EXPECT_EQ(out, input);  // one rank: sums of one value
    EXPECT_EQ((*c)->bytes_all_reduced(), 3 * kCount * 4);

    std::vector<float> host = input, host_gathered(input.size());
    ASSERT_TRUE((*c)->AllReduceSum(host.data(), kCount).ok());
    ASSERT_TRUE((*c)->AllGather(host.data(), kCount, host_gathered.data()).ok());
    std::string text = "host bytes";
    ASSERT_TRUE((*c)->Broadcast(text.data(), static_cast<int64_t>(text.size()), 0).ok());
    EXPECT_EQ(host, input);
    EXPECT_EQ(host_gathered, input);
    EXPECT_EQ(text, "host bytes");
}

TEST(NcclCollective, StreamOrderedNeedsTheCallersStream) {
    CollectiveConfig config = NcclConfig(std::string(128, '\0'), 0, 1, 1'000);
    config.nccl_stream_ordered = true;
    const Status status = MakeCollective(config).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("nccl_stream_ordered"), std::string::npos) << status.ToString();
}

TEST(NcclCollective, RejectsABadUniqueId) {
    const Status status = MakeCollective(NcclConfig("short", 0, 1, 1'000)).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
}

#else

TEST(NcclCollective, UnimplementedWithoutCuda) {
    CollectiveConfig config;
    config.kind = CollectiveConfig::Kind::kNccl;
    EXPECT_EQ(MakeCollective(config).status().code(), StatusCode::kUnimplemented);
    EXPECT_EQ(NewNcclUniqueId().status().code(), StatusCode::kUnimplemented);
}

#endif

}  // namespace
}  // namespace kvshard
