#include "common/status.h"

#include <cstdio>

namespace kvshard {

std::string_view StatusCodeName(StatusCode code) {
    switch (code) {
        case StatusCode::kOk: return "OK";
        case StatusCode::kInvalidArgument: return "InvalidArgument";
        case StatusCode::kNotFound: return "NotFound";
        case StatusCode::kDataLoss: return "DataLoss";
        case StatusCode::kUnimplemented: return "Unimplemented";
        case StatusCode::kOutOfRange: return "OutOfRange";
        case StatusCode::kResourceExhausted: return "ResourceExhausted";
        case StatusCode::kUnavailable: return "Unavailable";
        case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
        case StatusCode::kAborted: return "Aborted";
        case StatusCode::kInternal: return "Internal";
    }
    return "Unknown";
}

std::string Status::ToString() const {
    if (ok()) return "OK";
    return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status Status::WithContext(std::string_view context) const {
    if (ok()) return *this;
    return Status(code_, std::string(context) + ": " + message_);
}

namespace internal {

CheckFailure::CheckFailure(const char* file, int line, const char* condition) {
    stream_ << file << ":" << line << ": check failed: " << condition << " ";
}

CheckFailure::~CheckFailure() {
    std::fprintf(stderr, "%s\n", stream_.str().c_str());
    std::fflush(stderr);
    std::abort();
}

}  // namespace internal
}  // namespace kvshard
