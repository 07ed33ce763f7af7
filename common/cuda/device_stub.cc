// common/device.h in a build without CUDA (KVSHARD_WITH_CUDA=OFF): there is no device. Empty
// buffers and the handles' destructors work; everything that needs a device is Unavailable.
#include <string>
#include <string_view>

#include "common/device.h"
#include "common/device_peer.h"

namespace kvshard {
namespace {

Status NoCuda(std::string_view what) {
    return Unavailable(std::string(what) +
                       ": this kvshard was built without CUDA "
                       "(KVSHARD_WITH_CUDA=OFF)");
}

Status CheckCopy(std::string_view what, size_t bytes, size_t capacity) {
    if (bytes > capacity) {
        return InvalidArgument(std::string(what) + " of " + std::to_string(bytes) +
                               " bytes with a " + std::to_string(capacity) + "-byte device buffer");
    }
    return bytes == 0 ? Status::Ok() : NoCuda(what);
}

}  // namespace

int DeviceCount() { return 0; }

DeviceQuery QueryDevices() {
    return {.devices = {}, .error = "this kvshard was built without CUDA (KVSHARD_WITH_CUDA=OFF)"};
}

bool DevicesCanAccessPeer(int, int) { return false; }

Status SetDevice(int device) {
    return InvalidArgument("CUDA device " + std::to_string(device) +
                           " does not exist (0 visible: built without CUDA)");
}

Status SynchronizeDevice() { return NoCuda("SynchronizeDevice"); }
Status SynchronizeStream(StreamHandle) { return NoCuda("SynchronizeStream"); }
Result<bool> StreamIsDone(StreamHandle) { return NoCuda("StreamIsDone"); }

Result<DeviceStream> DeviceStream::Create() { return NoCuda("DeviceStream::Create"); }
DeviceStream::~DeviceStream() = default;
DeviceStream::DeviceStream(DeviceStream&& other) noexcept : stream_(other.stream_) {
    other.stream_ = nullptr;
}
DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept {
    stream_ = other.stream_;
    if (this != &other) other.stream_ = nullptr;
    return *this;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
    if (bytes == 0) return DeviceBuffer();
    return NoCuda("DeviceBuffer::Allocate(" + std::to_string(bytes) + " bytes)");
}
DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_) {
    other.data_ = nullptr;
    other.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
        data_ = other.data_;
        bytes_ = other.bytes_;
        other.data_ = nullptr;
        other.bytes_ = 0;
    }
    return *this;
}

Status DeviceBuffer::CopyFromHost(const void*, size_t bytes) {
    return CheckCopy("CopyFromHost", bytes, bytes_);
}
Status DeviceBuffer::CopyToHost(void*, size_t bytes) const {
    return CheckCopy("CopyToHost", bytes, bytes_);
}

}  // namespace kvshard
