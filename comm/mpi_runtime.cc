#include "comm/mpi_runtime.h"

#include <atomic>
#include <cstdlib>

#include "common/build_config.h"
#include "common/logging.h"

#if KVSHARD_WITH_MPI
#include "comm/mpi_check.h"
#endif

namespace kvshard {
namespace {

std::atomic<bool> g_abandoned_operation{false};

}  // namespace

void internal::NoteAbandonedMpiOperation() { g_abandoned_operation.store(true); }

bool MpiRuntime::LaunchedByMpirun() {
    for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
        if (std::getenv(name) != nullptr) return true;
    }
    return false;
}

#if KVSHARD_WITH_MPI

Result<std::unique_ptr<MpiRuntime>> MpiRuntime::Init() {
    std::unique_ptr<MpiRuntime> runtime(new MpiRuntime());
    int initialized = 0;
    KV_MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
    if (initialized) {
        KV_MPI_RETURN_IF_ERROR(MPI_Query_thread(&runtime->thread_level_));
    } else {
        // Errors inside MPI_Init_thread are fatal under MPI's default handler; there is no
        // communicator yet to ask for MPI_ERRORS_RETURN on.
        KV_MPI_RETURN_IF_ERROR(
            MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &runtime->thread_level_));
        runtime->owns_init_ = true;
        KV_MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    }
    if (runtime->thread_level_ < MPI_THREAD_SERIALIZED) {
        return Status(StatusCode::kUnavailable,
                      "MPI grants thread level " + std::to_string(runtime->thread_level_) +
                          "; kvshard needs MPI_THREAD_SERIALIZED or better");
    }
    KV_MPI_RETURN_IF_ERROR(MPI_Comm_rank(MPI_COMM_WORLD, &runtime->world_rank_));
    KV_MPI_RETURN_IF_ERROR(MPI_Comm_size(MPI_COMM_WORLD, &runtime->world_size_));
    return runtime;
}

MpiRuntime::~MpiRuntime() {
    if (!owns_init_) return;
    if (g_abandoned_operation.load()) {
        spdlog::error(
            "MPI rank {}: an MPI operation was abandoned at its deadline; ending the "
            "job with MPI_Abort instead of waiting in MPI_Finalize",
            world_rank_);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const int code = MPI_Finalize();
    if (code != MPI_SUCCESS) {
        spdlog::error("MPI rank {}: {}", world_rank_,
                      internal::MpiStatus(code, "MPI_Finalize").ToString());
    }
}

void MpiRuntime::AbortJob(int exit_code) {
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

#else  // !KVSHARD_WITH_MPI

Result<std::unique_ptr<MpiRuntime>> MpiRuntime::Init() {
    return Unimplemented("this kvshard was built without MPI (KVSHARD_WITH_MPI=OFF)");
}

MpiRuntime::~MpiRuntime() = default;

void MpiRuntime::AbortJob(int exit_code) { std::_Exit(exit_code); }

#endif  // KVSHARD_WITH_MPI

}  // namespace kvshard
