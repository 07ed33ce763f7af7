#include "comm/collective.h"

#include <cstring>

#include "comm/collective_impls.h"
#include "comm/local_collective.h"
#include "common/build_config.h"

namespace kvshard {
namespace {

#if KVSHARD_WITH_CUDA && KVSHARD_WITH_MPI
// Rank 0 of the MPI group makes the NCCL id and broadcasts it with a status byte in front, so
// that the other ranks learn about a failure instead of joining a communicator that never forms.
Result<std::unique_ptr<Collective>> MakeNcclThroughMpi(const CollectiveConfig& config) {
    CollectiveConfig mpi_config = config;
    mpi_config.kind = CollectiveConfig::Kind::kMpi;
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Collective> mpi, internal::MakeMpiCollective(mpi_config));
    std::string message(1 + internal::kNcclUniqueIdBytes, '\0');
    Status made;
    if (mpi->rank() == 0) {
        Result<std::string> id = internal::MakeNcclUniqueId();
        if (id.ok()) {
            message[0] = 1;
            std::memcpy(message.data() + 1, id->data(), internal::kNcclUniqueIdBytes);
        } else {
            made = id.status();
        }
    }
    KV_RETURN_IF_ERROR(mpi->Broadcast(message.data(), static_cast<int64_t>(message.size()), 0)
                           .WithContext("broadcasting the NCCL unique id"));
    if (!made.ok()) return made;
    if (message[0] != 1) {
        return Status(StatusCode::kUnavailable, "MPI rank 0 could not create an NCCL unique id");
    }
    return internal::MakeNcclCollective(config, message.substr(1), mpi->rank(), mpi->size());
}
#endif

}  // namespace

Result<std::unique_ptr<Collective>> MakeCollective(const CollectiveConfig& config) {
    switch (config.kind) {
        case CollectiveConfig::Kind::kLocal:
            if (config.local_group == nullptr) {
                return InvalidArgument("local collective: no LocalGroup given");
            }
            if (config.rank < 0 || config.rank >= config.local_group->size()) {
                return InvalidArgument("local collective: rank " + std::to_string(config.rank) +
                                       " outside a group of " +
                                       std::to_string(config.local_group->size()));
            }
            return config.local_group->Collective(config.rank);
        case CollectiveConfig::Kind::kMpi:
#if KVSHARD_WITH_MPI
            return internal::MakeMpiCollective(config);
#else
            return Unimplemented(
                "MPI collective: this kvshard was built without MPI "
                "(KVSHARD_WITH_MPI=OFF)");
#endif
        case CollectiveConfig::Kind::kGloo:
            if (config.gloo_store == nullptr) {
                return InvalidArgument("Gloo collective: no store given to meet in");
            }
            if (config.size < 1 || config.rank < 0 || config.rank >= config.size) {
                return InvalidArgument("Gloo collective: rank " + std::to_string(config.rank) +
                                       " of a group of " + std::to_string(config.size));
            }
            if (config.timeout_ms <= 0) {
                return InvalidArgument("Gloo collective: timeout_ms " +
                                       std::to_string(config.timeout_ms) + " must be > 0");
            }
#if KVSHARD_WITH_GLOO
            return internal::MakeGlooCollective(config);
#else
            return Unimplemented(
                "Gloo collective: this kvshard was built without Gloo "
                "(KVSHARD_WITH_GLOO=OFF; Debian: libgloo-dev)");
#endif
        case CollectiveConfig::Kind::kNccl:
#if KVSHARD_WITH_CUDA
            if (!config.nccl_unique_id.empty()) {
                return internal::MakeNcclCollective(config, config.nccl_unique_id, config.rank,
                                                    config.size);
            }
#if KVSHARD_WITH_MPI
            return MakeNcclThroughMpi(config);
#else
            return InvalidArgument(
                "NCCL collective: no nccl_unique_id given, and this kvshard was built without "
                "MPI to bootstrap one");
#endif
#else
            return Unimplemented(
                "NCCL collective: this kvshard was built without CUDA "
                "(KVSHARD_WITH_CUDA=OFF)");
#endif
    }
    return InvalidArgument("unknown collective kind");
}

std::string_view CollectiveKindName(CollectiveConfig::Kind kind) {
    switch (kind) {
        case CollectiveConfig::Kind::kLocal:
            return "local";
        case CollectiveConfig::Kind::kMpi:
            return "mpi";
        case CollectiveConfig::Kind::kGloo:
            return "gloo";
        case CollectiveConfig::Kind::kNccl:
            return "nccl";
    }
    return "unknown";
}

Result<std::string> NewNcclUniqueId() {
#if KVSHARD_WITH_CUDA
    return internal::MakeNcclUniqueId();
#else
    return Unimplemented("NCCL: this kvshard was built without CUDA (KVSHARD_WITH_CUDA=OFF)");
#endif
}

}  // namespace kvshard
