// The factories behind MakeCollective (comm/collective.h), private to comm/. Each exists only in
// builds with its library: MakeMpiCollective with KVSHARD_WITH_MPI (comm/mpi_collective.cc), the
// NCCL functions with KVSHARD_WITH_CUDA (comm/nccl_collective.cc).
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

// A communicator of `size` ranks sharing `unique_id` (kNcclUniqueIdBytes bytes), as `rank`.
Result<std::unique_ptr<Collective>> MakeNcclCollective(const CollectiveConfig& config,
                                                       const std::string& unique_id, int rank,
                                                       int size);
Result<std::string> MakeNcclUniqueId();

}  // namespace kvshard::internal
