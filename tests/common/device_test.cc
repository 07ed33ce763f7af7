// The device layer (common/device.h) where it can be tested without a GPU: the answers of a
// machine without a device (this CI machine; a build without CUDA) and the handles' ownership.
// Suites that need a device carry "Gpu" in their names and skip without one.
#include "common/device.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "common/build_config.h"

namespace kvshard {
namespace {

TEST(Device, DeviceCountDoesNotFailWithoutADriver) {
    const int count = DeviceCount();
    EXPECT_GE(count, 0);
    EXPECT_EQ(DeviceCount(), count);  // asking again gives the same answer
#if !KVSHARD_WITH_CUDA
    EXPECT_EQ(count, 0);
#endif
}

TEST(Device, ZeroByteBufferNeedsNoDevice) {
    Result<DeviceBuffer> buffer = DeviceBuffer::Allocate(0);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    EXPECT_EQ(buffer->data(), nullptr);
    EXPECT_EQ(buffer->floats(), nullptr);
    EXPECT_EQ(buffer->bytes(), 0u);
    EXPECT_TRUE(buffer->CopyFromHost(nullptr, 0).ok());
    EXPECT_TRUE(buffer->CopyToHost(nullptr, 0).ok());
}

TEST(Device, CopiesLargerThanTheBufferAreInvalid) {
    DeviceBuffer empty;
    char byte = 0;
    EXPECT_EQ(empty.CopyFromHost(&byte, 1).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(empty.CopyToHost(&byte, 1).code(), StatusCode::kInvalidArgument);
}

TEST(Device, EmptyHandlesMoveAndDestroy) {
    DeviceBuffer buffer;
    DeviceBuffer moved(std::move(buffer));
    moved = DeviceBuffer();
    EXPECT_EQ(moved.data(), nullptr);
    DeviceStream stream;
    EXPECT_EQ(stream.get(), nullptr);  // the legacy default stream
    DeviceStream moved_stream(std::move(stream));
    moved_stream = DeviceStream();
    EXPECT_EQ(moved_stream.get(), nullptr);
}

// What a machine without a device answers: errors, not crashes.
TEST(Device, WithoutADeviceEverythingElseFails) {
    if (DeviceCount() > 0) GTEST_SKIP() << "a device is present";
    EXPECT_EQ(SetDevice(0).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(SetDevice(-1).code(), StatusCode::kInvalidArgument);
    EXPECT_FALSE(DeviceBuffer::Allocate(4).ok());
    EXPECT_FALSE(DeviceStream::Create().ok());
    EXPECT_FALSE(SynchronizeDevice().ok());
}

TEST(DeviceGpu, SetDeviceRejectsADeviceThatDoesNotExist) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    EXPECT_TRUE(SetDevice(0).ok());
    EXPECT_EQ(SetDevice(DeviceCount()).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(SetDevice(-1).code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(SetDevice(0).ok());  // the failed calls left no error behind
}

TEST(DeviceGpu, BufferRoundTripsThroughTheDevice) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(SetDevice(0).ok());
    const std::vector<float> host = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f};
    Result<DeviceBuffer> buffer = DeviceBuffer::Allocate(host.size() * sizeof(float));
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    ASSERT_NE(buffer->data(), nullptr);
    ASSERT_TRUE(buffer->CopyFromHost(host.data(), host.size() * sizeof(float)).ok());
    DeviceBuffer moved = std::move(buffer).value();  // ownership moves, the memory stays
    std::vector<float> back(host.size());
    ASSERT_TRUE(moved.CopyToHost(back.data(), back.size() * sizeof(float)).ok());
    EXPECT_EQ(back, host);
    EXPECT_EQ(moved.CopyToHost(back.data(), moved.bytes() + 1).code(),
              StatusCode::kInvalidArgument);
}

TEST(DeviceGpu, StreamOfItsOwnRunsAndIsDone) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(SetDevice(0).ok());
    Result<DeviceStream> stream = DeviceStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    EXPECT_NE(stream->get(), nullptr);
    ASSERT_TRUE(SynchronizeStream(stream->get()).ok());
    Result<bool> done = StreamIsDone(stream->get());
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    EXPECT_TRUE(*done);  // nothing queued after the synchronize
    EXPECT_TRUE(SynchronizeDevice().ok());
}

}  // namespace
}  // namespace kvshard
