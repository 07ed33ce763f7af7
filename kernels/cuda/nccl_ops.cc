// NCCL: the library version and a single-rank all-reduce that exercises the NCCL path end to end.
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda_ops.h"

namespace kvshard::cuda {
namespace {

// A communicator owned by one object. Destroyed normally; aborted when the work on it failed, so
// that nothing waits on a broken communicator.
class NcclComm {
  public:
    explicit NcclComm(int device) {
        int devices[1] = {device};
        KV_NCCL_CHECK(ncclCommInitAll(&comm_, 1, devices));
    }
    ~NcclComm() {
        if (comm_ != nullptr) ncclCommDestroy(comm_);
    }
    NcclComm(const NcclComm&) = delete;
    NcclComm& operator=(const NcclComm&) = delete;

    ncclComm_t get() const { return comm_; }
    void Abort() {
        if (comm_ != nullptr) ncclCommAbort(comm_);
        comm_ = nullptr;
    }

  private:
    ncclComm_t comm_ = nullptr;
};

}  // namespace

int NcclVersion() {
    int version = 0;
    KV_NCCL_CHECK(ncclGetVersion(&version));
    return version;
}

Status AllReduceSumSingleRank(float* host_data, int64_t n) {
    if (DeviceCount() == 0) return Unavailable("no CUDA device");
    if (n < 0) return InvalidArgument("n=" + std::to_string(n) + " must be >= 0");
    KV_RETURN_IF_ERROR(SetDevice(0));
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    KV_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(bytes));
    KV_RETURN_IF_ERROR(buffer.CopyFromHost(host_data, bytes));
    KV_ASSIGN_OR_RETURN(DeviceStream stream, DeviceStream::Create());
    NcclComm comm(0);
    const ncclResult_t result = ncclAllReduce(buffer.data(), buffer.data(), static_cast<size_t>(n),
                                              ncclFloat, ncclSum, comm.get(), stream.get());
    if (result != ncclSuccess) {
        comm.Abort();
        return Internal(std::string("ncclAllReduce: ") + ncclGetErrorString(result));
    }
    const Status done = SynchronizeStream(stream.get());
    if (!done.ok()) {
        comm.Abort();
        return done.WithContext("after ncclAllReduce");
    }
    return buffer.CopyToHost(host_data, bytes);
}

}  // namespace kvshard::cuda
