// MpiRuntime: MPI for this process (MPI_Init_thread / MPI_Finalize), owned by one object that the
// process creates before any MPI communicator (CollectiveConfig::Kind::kMpi) and destroys after
// the last one. A plain header: callers need neither mpi.h nor an MPI build.
#pragma once

#include <memory>

#include "common/status.h"

namespace kvshard {

// Thread-safety: create and destroy on the main thread; the accessors may be called anywhere.
class MpiRuntime {
  public:
    // Initializes MPI asking for MPI_THREAD_MULTIPLE and requiring at least
    // MPI_THREAD_SERIALIZED (one thread at a time may call MPI, whichever thread it is). When MPI
    // is already initialized, the runtime leaves finalizing to whoever initialized it.
    // Unimplemented in a build without MPI (common/build_config.h: KVSHARD_WITH_MPI).
    static Result<std::unique_ptr<MpiRuntime>> Init();

    // MPI_Finalize. If an MPI operation of this process was abandoned at its deadline and never
    // completed, finalizing could wait forever for the peer that failed; the job is ended with
    // MPI_Abort instead (mpirun then stops every rank and reports the failure).
    ~MpiRuntime();
    MpiRuntime(const MpiRuntime&) = delete;
    MpiRuntime& operator=(const MpiRuntime&) = delete;

    int world_rank() const { return world_rank_; }
    int world_size() const { return world_size_; }
    // MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE, as MPI granted.
    int thread_level() const { return thread_level_; }

    // True when this process was started by mpirun/mpiexec (Open MPI or PMI environment), so a
    // CLI can default to MPI collectives.
    static bool LaunchedByMpirun();

    // Ends every process of the job with `exit_code` (MPI_Abort on MPI_COMM_WORLD).
    [[noreturn]] static void AbortJob(int exit_code);

  private:
    MpiRuntime() = default;

    bool owns_init_ = false;
    int world_rank_ = 0;
    int world_size_ = 1;
    int thread_level_ = 0;
};

namespace internal {
// Called by a communicator whose operation could not be completed or cancelled (comm/ only).
void NoteAbandonedMpiOperation();
}  // namespace internal

}  // namespace kvshard
