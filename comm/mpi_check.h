// Checked MPI calls, private to comm/ (only in builds with KVSHARD_WITH_MPI). Communicators use
// MPI_ERRORS_RETURN, so every call's code is turned into a Status with MPI's own error text.
#pragma once

#include <mpi.h>

#include <string>
#include <string_view>

#include "common/status.h"

namespace kvshard::internal {

inline Status MpiStatus(int code, std::string_view call) {
    if (code == MPI_SUCCESS) return Status::Ok();
    char text[MPI_MAX_ERROR_STRING] = {};
    int length = 0;
    if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
    return Status(StatusCode::kUnavailable,
                  std::string(call) + " failed: MPI error " + std::to_string(code) + " (" +
                      std::string(text, static_cast<size_t>(length)) + ")");
}

}  // namespace kvshard::internal

#define KV_MPI_RETURN_IF_ERROR(call) \
    KV_RETURN_IF_ERROR(::kvshard::internal::MpiStatus((call), #call))
