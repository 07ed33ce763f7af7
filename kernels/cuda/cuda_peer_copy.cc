// CudaBackend's peer copies (PeerCopy, kernels/backend.h): the in-process KV handoff between two
// GPUs of one process, queued on the receiving backend's stream with cudaMemcpyPeerAsync.
#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_backend.h"

namespace kvshard::cuda {
namespace {

Status PeerStatus(cudaError_t err, const std::string& what) {
    return Unavailable("cuda backend: " + what + ": CUDA error " + std::to_string(int(err)) + " (" +
                       cudaGetErrorName(err) + "): " + cudaGetErrorString(err));
}

// Enables access from device `to` to device `from`'s memory once per pair in this process, where
// the hardware has it (NVLink or PCIe peer-to-peer); without it cudaMemcpyPeerAsync still copies,
// staged by the driver.
void EnablePeerAccessOnce(int to, int from) {
    static std::mutex mu;
    static std::set<std::pair<int, int>> tried;
    std::lock_guard<std::mutex> lock(mu);
    if (!tried.insert({to, from}).second) return;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, to, from) != cudaSuccess || can == 0) {
        (void)cudaGetLastError();
        return;
    }
    cudaSetDevice(to);
    const cudaError_t err = cudaDeviceEnablePeerAccess(from, 0);
    if (err != cudaSuccess) (void)cudaGetLastError();  // e.g. already enabled: not an error here
}

}  // namespace

bool CudaBackend::CanCopyFromPeer(const Backend& src) const {
    return dynamic_cast<const CudaBackend*>(&src) != nullptr;
}

Status CudaBackend::CopyFromPeer(void* dst, const Backend& src, const void* src_data,
                                 size_t bytes) {
    const auto* peer = dynamic_cast<const CudaBackend*>(&src);
    if (peer == nullptr) {
        return InvalidArgument("cuda backend: a peer copy from the " + src.Describe() +
                               " backend (only from another CUDA backend)");
    }
    if (bytes == 0) return Status::Ok();
    if (!first_error_.ok()) return first_error_;
    if (peer->device() != device_) EnablePeerAccessOnce(device_, peer->device());
    cudaSetDevice(device_);
    const cudaError_t err =
        peer->device() == device_
            ? cudaMemcpyAsync(dst, src_data, bytes, cudaMemcpyDeviceToDevice, stream_)
            : cudaMemcpyPeerAsync(dst, device_, src_data, peer->device(), bytes, stream_);
    if (err != cudaSuccess) {
        return PeerStatus(err, "peer copy of " + std::to_string(bytes) + " bytes from GPU " +
                                   std::to_string(peer->device()) + " to GPU " +
                                   std::to_string(device_));
    }
    return Status::Ok();
}

}  // namespace kvshard::cuda
