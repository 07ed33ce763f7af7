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

class StreamHolder {
  public:
    StreamHolder() { KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
    ~StreamHolder() { cudaStreamDestroy(stream_); }
    StreamHolder(const StreamHolder&) = delete;
    StreamHolder& operator=(const StreamHolder&) = delete;
    cudaStream_t get() const { return stream_; }

  private:
    cudaStream_t stream_ = nullptr;
};

}  // namespace

int NcclVersion() {
    int version = 0;
    KV_NCCL_CHECK(ncclGetVersion(&version));
    return version;
}

Status AllReduceSumSingleRank(float* host_data, int64_t n) {
    if (DeviceCount() == 0) return Status(StatusCode::kUnavailable, "no CUDA device");
    if (n < 0) return InvalidArgument("n=" + std::to_string(n) + " must be >= 0");
    SetDevice(0);
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    DeviceBuffer buffer(bytes);
    buffer.CopyFromHost(host_data, bytes);
    StreamHolder stream;
    NcclComm comm(0);
    ncclResult_t result = ncclAllReduce(buffer.data(), buffer.data(), static_cast<size_t>(n),
                                        ncclFloat, ncclSum, comm.get(), stream.get());
    if (result == ncclSuccess) {
        const cudaError_t err = cudaStreamSynchronize(stream.get());
        if (err != cudaSuccess) {
            comm.Abort();
            return Internal(std::string("cudaStreamSynchronize after ncclAllReduce: ") +
                            cudaGetErrorString(err));
        }
    } else {
        comm.Abort();
        return Internal(std::string("ncclAllReduce: ") + ncclGetErrorString(result));
    }
    buffer.CopyToHost(host_data, bytes);
    return Status::Ok();
}

}  // namespace kvshard::cuda
