// The factories behind MakeCollective (comm/collective.h), private to comm/. Each exists only in
// builds with its library: MakeMpiCollective with KVSHARD_WITH_MPI (comm/mpi_collective.cc),
// MakeGlooCollective with KVSHARD_WITH_GLOO (comm/gloo_collective.cc), the NCCL functions with
// KVSHARD_WITH_CUDA (comm/nccl_collective.cc).
#pragma once

#include <memory>
#include <string>

#include "comm/collective.h"
#include "common/status.h"

namespace kvshard::internal {

// NCCL_UNIQUE_ID_BYTES, without including nccl.h (nccl_collective.cc asserts they agree).
inline constexpr size_t kNcclUniqueIdBytes = 128;

// A communicator over the MPI group `config` selects (mpi_color). Collective over
// MPI_COMM_WORLD.
Result<std::unique_ptr<Collective>> MakeMpiCollective(const CollectiveConfig& config);

// A communicator of config.size ranks meeting in config.gloo_store, as config.rank. REQUIRES:
// the fields checked by MakeCollective (store set, 0 <= rank < size, timeout_ms > 0).
Result<std::unique_ptr<Collective>> MakeGlooCollective(const CollectiveConfig& config);

// A communicator of `size` ranks sharing `unique_id` (kNcclUniqueIdBytes bytes), as `rank`.
Result<std::unique_ptr<Collective>> MakeNcclCollective(const CollectiveConfig& config,
                                                       const std::string& unique_id, int rank,
                                                       int size);
Result<std::string> MakeNcclUniqueId();

}  // namespace kvshard::internal
