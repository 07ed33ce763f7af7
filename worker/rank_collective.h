// The collective of one tensor-parallel rank whose buffers are its backend's memory, and how it
// is chosen (docs/cuda.md "Tensor parallelism on GPUs"):
//
//   kHost    the CPU backend: backend memory is host memory, the host collective (Local, Gloo,
//            Mpi) is used as it is.
//   kNccl    the CUDA backend, every rank of the instance on a GPU of its own, a build with NCCL
//            and an NCCL unique id shared by the ranks: NCCL queued on the backend's own stream
//            (CollectiveConfig::nccl_stream_ordered), so an all-reduce is ordered with the step's
//            kernels without a host wait; the logits' AllGather waits once per step, with the
//            deadline.
//   kStaged  anything else on a device (two ranks on one GPU, where NCCL refuses to run, or no
//            NCCL): the host collective behind StagedCollective (worker/staged_collective.h).
//
// Every rank of an instance must choose the same path: the choice depends only on what every
// rank is told alike (the backend, the instance's devices, whether an id was handed out). The
// rule itself is config/collective_path.h's, which the serving config's device plan applies too.
//
// The ModelRunner takes its collective when it is made, and the backend is made inside
// MakeModelRunner: so a rank is given a RankCollective first (rank and size known), and the
// collective of its path is attached once the runner, and with it the backend, exists.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "comm/collective.h"
#include "config/collective_path.h"
#include "kernels/backend.h"

namespace kvshard {

struct CollectivePathInputs {
    BackendKind backend = BackendKind::kCpu;
    int tp = 1;
    // The GPU of each rank (empty: not known, taken as shared).
    std::vector<int> devices;
    // A build with CUDA (and so NCCL), and an NCCL unique id the ranks share (or one that can be
    // made for them, in one process).
    bool nccl_available = false;
    // Stage even where the buffers are host memory or NCCL could run: how the staged path is
    // exercised on the CPU, and a way around a broken NCCL on a device.
    bool force_staged = false;
};

// DecideCollectivePath (config/collective_path.h) for a rank of `in.backend`.
CollectivePath ChooseCollectivePath(const CollectivePathInputs& in);

// A Collective whose implementation is attached after it is handed out. Before Attach every
// operation fails (kInternal, naming the rank); an Abort before Attach aborts what is attached.
// Thread-safety: operations and Attach on the rank's thread; Abort from any thread.
class RankCollective final : public Collective {
  public:
    RankCollective(int rank, int size) : rank_(rank), size_(size) {}

    // REQUIRES: `target` has this rank and size; called once. Ownership: `owned` is kept;
    // `borrowed` must outlive this object.
    void Attach(std::unique_ptr<Collective> owned);
    void Attach(Collective* borrowed);
    bool attached() const { return target_.load() != nullptr; }

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    Status AllReduceSum(float* data, int64_t count) override;
    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override;
    Status Broadcast(void* data, int64_t bytes, int root) override;
    Status Barrier() override;
    void Abort(const std::string& reason) override;
    // The attached collective's count, plus AddGraphAllReduceBytes'.
    int64_t bytes_all_reduced() const override;
    // Adds `bytes` to bytes_all_reduced: the all-reduces a replayed CUDA graph launched (NCCL's,
    // recorded by the capture: the replay never calls the collective, so it cannot count them),
    // or, negative, those a discarded capture queued and the collective counted but that never
    // ran. REQUIRES: the attached collective counts its calls, not the graphs' launches (NCCL).
    void AddGraphAllReduceBytes(int64_t bytes);

  private:
    Status Unattached(std::string_view what) const;

    const int rank_;
    const int size_;
    std::unique_ptr<Collective> owned_;
    std::atomic<Collective*> target_{nullptr};
    std::mutex mu_;             // Attach against Abort
    std::string abort_reason_;  // guarded by mu_; an Abort before Attach
    std::atomic<int64_t> graph_bytes_{0};
};

struct BackendCollectiveOptions {
    CollectivePath path = CollectivePath::kHost;
    int rank = 0, size = 1;
    // kHost, kStaged: this rank's host collective (not owned; outlives the result).
    Collective* host = nullptr;
    // kNccl: the id every rank shares, and how long any wait may take.
    std::string nccl_unique_id = {};
    int64_t timeout_ms = 60'000;
};

// Attaches to `rank_collective` the collective of `options.path` for a rank whose runner, and so
// `backend`, now exists: kHost the host collective itself (borrowed), kStaged a StagedCollective
// over it, kNccl an NCCL communicator on the CUDA backend's stream. kNccl is collective over the
// instance's ranks (each calls this at once, from its own thread or process).
// Errors: InvalidArgument for a missing host collective or kNccl on a backend that is not CUDA;
// NCCL's (then nothing is attached and the rank's operations keep failing).
Status AttachBackendCollective(const BackendCollectiveOptions& options, Backend& backend,
                               RankCollective& rank_collective);

}  // namespace kvshard
