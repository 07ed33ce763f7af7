// StagedCollective: a host-memory collective (Local, Gloo or Mpi; comm/collective.h) for a rank
// whose buffers are a backend's memory (kernels/backend.h): each call waits for the backend's
// stream (the ops that wrote the buffer have run), copies the buffer out to the host, runs the
// host collective there and copies the result back. It is how ranks that share one GPU, or a
// build without NCCL, run tensor-parallel on devices (docs/cuda.md "Tensor parallelism on GPUs"),
// and, on the CPU backend (where the copies are memcpy), how the path is tested without a GPU.
//
// Results are the host collective's: the same bits as a tp group of that kind on the CPU (Local,
// Gloo and Mpi add in rank order). Cost per call: a stream synchronization and two copies of the
// payload over the host link, besides the host collective's own.
//
// Ownership: neither the host collective nor the backend is owned; both outlive this object.
// Thread-safety: as Collective: the rank's thread calls the operations (the backend's one
// thread); Abort() may be called from any thread and aborts the host collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/collective.h"
#include "kernels/backend.h"

namespace kvshard {

class StagedCollective final : public Collective {
  public:
    StagedCollective(Collective& host, Backend& backend) : host_(host), backend_(backend) {}

    int rank() const override { return host_.rank(); }
    int size() const override { return host_.size(); }

    // REQUIRES (every operation): the buffers are `backend`'s memory.
    Status AllReduceSum(float* data, int64_t count) override;
    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override;
    Status Broadcast(void* data, int64_t bytes, int root) override;
    Status Barrier() override { return host_.Barrier(); }
    void Abort(const std::string& reason) override { host_.Abort(reason); }
    int64_t bytes_all_reduced() const override { return bytes_all_reduced_; }

  private:
    // Copies `bytes` of backend memory at `src` into staging_ (grown to hold `bytes` + `extra`),
    // after everything queued on the backend has run.
    Status CopyOut(const void* src, size_t bytes, size_t extra);
    // Copies `bytes` of host memory at `src` to backend memory `dst` and waits for the copy (so
    // that staging_ may be reused).
    Status CopyIn(void* dst, const void* src, size_t bytes);

    Collective& host_;
    Backend& backend_;
    std::vector<uint8_t> staging_;  // the rank thread's only
    int64_t bytes_all_reduced_ = 0;
};

}  // namespace kvshard
