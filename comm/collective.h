// Collective: the communicator a worker of a tensor-parallel instance uses to combine partial
// results with the other ranks of its instance. Four implementations, built by MakeCollective:
//
//   kLocal  worker threads of one process (comm/local_collective.h); host memory.
//   kMpi    one process per rank, launched by `mpirun` (Open MPI); host memory.
//   kGloo   one process per rank, started any way at all (by the coordinator, by hand, as pods):
//           the ranks meet in a key-value store (comm/collective_store.h; the coordinator's, over
//           the registration channel) and talk over Gloo's TCP pairs; host memory.
//   kNccl   one process or thread per GPU; device memory on the communicator's device (host
//           memory is accepted too: it is copied through a device buffer of the communicator's,
//           and the call waits).
//
// A rank whose buffers are a backend's memory (a GPU's) and whose peers share its GPU, or a build
// without NCCL, wraps one of the host kinds in the host-staged collective of worker/
// (worker/staged_collective.h), which copies through the backend.
//
// Determinism: AllReduceSum leaves bit-identical results on every rank, and the result does not
// depend on timing. Local, Mpi and Gloo all add the ranks' values element by element in rank
// order 0, 1, ..., size-1, so a thread group, an MPI job and a Gloo group of the same size produce
// the same bits. Nccl
// uses NCCL's reduction (identical on every rank, stable for a fixed topology, not in rank order).
// Why it matters: tensor parallelism must not change greedy tokens (docs/comm.md).
//
// Failure: no call waits forever. Every call has a deadline (CollectiveConfig::timeout_ms); a
// timeout or an Abort() breaks the communicator, and every later call on it returns the error
// (kDeadlineExceeded or kAborted) at once. A Local group breaks for all of its ranks together.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/device.h"
#include "common/status.h"

namespace kvshard {

class CollectiveStore;
class LocalGroup;

// REQUIRES (every method): all ranks of the group make the same sequence of calls with the same
// counts, sizes and roots; a mismatch is an error (Local reports it, Mpi and Nccl may time out).
// Thread-safety: one thread per rank calls the operations; Abort() may be called from any thread.
class Collective {
  public:
    virtual ~Collective() = default;

    virtual int rank() const = 0;
    virtual int size() const = 0;

    // data[i] = sum over ranks r (in order 0..size-1) of rank r's data[i], on every rank.
    virtual Status AllReduceSum(float* data, int64_t count) = 0;
    // recv[r * count_per_rank + i] = rank r's send[i] (rank-major). recv holds size() *
    // count_per_rank floats and must not overlap send.
    virtual Status AllGather(const float* send, int64_t count_per_rank, float* recv) = 0;
    // Copies `bytes` bytes of `data` on rank `root` into `data` on every other rank.
    virtual Status Broadcast(void* data, int64_t bytes, int root) = 0;
    // Returns once every rank has entered Barrier.
    virtual Status Barrier() = 0;

    // Breaks the communicator: pending and later calls return kAborted. Local peers return at
    // once; Mpi, Gloo and Nccl peers return when their own deadline passes. Idempotent.
    virtual void Abort(const std::string& reason) = 0;

    // Payload bytes (count * sizeof(float)) of the AllReduceSum calls that succeeded on this rank:
    // the communication volume tensor parallelism costs, independent of the algorithm.
    virtual int64_t bytes_all_reduced() const = 0;
};

struct CollectiveConfig {
    enum class Kind { kLocal, kMpi, kGloo, kNccl };
    Kind kind = Kind::kLocal;

    // Every wait of an Mpi, Gloo or Nccl call ends by this many milliseconds after the call
    // began (a Local group has its own, set when the group is created). kGloo: the rendezvous
    // (every rank's key in the store, every pair connected) too.
    int64_t timeout_ms = 60'000;

    // kLocal: the group (LocalGroup::Create) and this thread's rank in it.
    std::shared_ptr<LocalGroup> local_group;
    // kLocal: rank in local_group. kNccl with nccl_unique_id, kGloo: rank in the group.
    int rank = 0;

    // kGloo: rank, size, and the store the group meets in: the same store for every rank of
    // the group, holding no other group's keys (a fresh one per formation). Creating the
    // communicator waits until every rank of the group created its own (timeout_ms).
    std::shared_ptr<CollectiveStore> gloo_store;
    // kGloo: where this rank's TCP pairs listen, an address or host name the peers can reach
    // ("127.0.0.1" when every rank runs on one machine) ...
    std::string gloo_host = "127.0.0.1";
    // ... or, when not empty, the network interface whose address they use (e.g. "eth0"). Empty
    // here: GLOO_SOCKET_IFNAME from the environment, if set, names it.
    std::string gloo_iface;
    // kGloo: AllReduceSum payloads of at least this many bytes use the two-phase algorithm, as
    // mpi_two_phase_min_bytes does for kMpi.
    int64_t gloo_two_phase_min_bytes = 64 * 1024;

    // kMpi, and kNccl bootstrapped through MPI: the ranks of MPI_COMM_WORLD with the same
    // mpi_color form one group, ordered by world rank; -1: the whole world. Creating one is
    // collective over MPI_COMM_WORLD (every process calls MakeCollective in the same order).
    // REQUIRES: an MpiRuntime (comm/mpi_runtime.h) alive in this process.
    int mpi_color = -1;
    // kMpi: AllReduceSum payloads of at least this many bytes use the two-phase algorithm
    // (reduce-scatter + all-gather, 2 × bytes × (size-1)/size per rank) instead of one
    // all-gather (bytes × (size-1) per rank); both add in rank order.
    int64_t mpi_two_phase_min_bytes = 64 * 1024;

    // kNccl, kGloo: group size. kNccl: the id every rank of the group shares (NewNcclUniqueId()
    // on one rank, passed to the others, e.g. by the coordinator). Empty nccl_unique_id: bootstrap
    // through MPI instead (rank 0 of the MPI group makes the id and broadcasts it; rank and size
    // come from MPI).
    int size = 0;
    std::string nccl_unique_id;
    int cuda_device = 0;
    // kNccl: the stream (on cuda_device) the operations are queued on; nullptr: a stream of the
    // communicator's own. Every operation has completed on the stream when the call returns,
    // unless nccl_stream_ordered says otherwise.
    StreamHandle cuda_stream = nullptr;
    // kNccl with a cuda_stream that is the caller's compute stream (a backend's): AllReduceSum on
    // device memory returns once the operation is queued there (the caller's later work on the
    // stream runs after it, with no host wait per all-reduce). AllGather, Broadcast and Barrier
    // still return only when the stream has run everything queued before them, polling with the
    // deadline: the one wait of a step (the logits' AllGather) bounds every all-reduce queued
    // before it, and a lost peer aborts the communicator instead of leaving the stream hung.
    bool nccl_stream_ordered = false;
};

// Builds the communicator `config` describes. Unimplemented for kMpi, kGloo or kNccl in a build
// without MPI, Gloo or CUDA (common/build_config.h); InvalidArgument for a bad rank, size, id or
// store; kGloo: DeadlineExceeded naming what was missing when the group did not meet in time.

Result<std::unique_ptr<Collective>> MakeCollective(const CollectiveConfig& config);

// Stable names of the kinds ("local", "mpi", "gloo", "nccl"), for logs.
std::string_view CollectiveKindName(CollectiveConfig::Kind kind);

// A fresh NCCL unique id (ncclGetUniqueId) as bytes, for CollectiveConfig::nccl_unique_id.
// Unimplemented in a build without CUDA.
Result<std::string> NewNcclUniqueId();

}  // namespace kvshard
