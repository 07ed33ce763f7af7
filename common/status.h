// Status and Result<T>: how recoverable failures travel in kvshard (bad files, bad configs, bad
// requests, transport timeouts). Broken invariants use KV_CHECK (common/check.h) instead.
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "common/check.h"

namespace kvshard {

enum class StatusCode {
    kOk,
    kInvalidArgument,  // the caller's input is wrong (request, flag, config value)
    kNotFound,         // a file, tensor, key or id does not exist
    kDataLoss,         // a file is truncated or corrupted
    kUnimplemented,    // a valid input kvshard does not support (tensor type, architecture)
    kOutOfRange,       // a value outside what the model or cache can hold
    kResourceExhausted,
    kUnavailable,
    kDeadlineExceeded,
    kAborted,  // the operation was abandoned because its group failed (a peer aborted, timed out)
    kInternal,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
public:
    Status() = default;
    Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

    static Status Ok() { return Status(); }
    bool ok() const { return code_ == StatusCode::kOk; }
    StatusCode code() const { return code_; }
    const std::string& message() const { return message_; }
    // "NotFound: <message>" or "OK".
    std::string ToString() const;
    // Returns a copy whose message is "<context>: <message>".
    Status WithContext(std::string_view context) const;

private:
    StatusCode code_ = StatusCode::kOk;
    std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
public:
    Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
    Result(Status status) : v_(std::move(status)) {  // NOLINT
        KV_CHECK(!std::get<Status>(v_).ok()) << "Result built from an OK status";
    }

    bool ok() const { return std::holds_alternative<T>(v_); }
    const Status& status() const {
        static const Status kOk;
        return ok() ? kOk : std::get<Status>(v_);
    }
    // REQUIRES: ok().
    T& value() & {
        KV_CHECK(ok()) << status().ToString();
        return std::get<T>(v_);
    }
    const T& value() const& {
        KV_CHECK(ok()) << status().ToString();
        return std::get<T>(v_);
    }
    T&& value() && {
        KV_CHECK(ok()) << status().ToString();
        return std::get<T>(std::move(v_));
    }
    T& operator*() & { return value(); }
    const T& operator*() const& { return value(); }
    T* operator->() { return &value(); }
    const T* operator->() const { return &value(); }

private:
    std::variant<T, Status> v_;
};

}  // namespace kvshard

#define KV_CONCAT_INNER(a, b) a##b
#define KV_CONCAT(a, b) KV_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` is not OK.
#define KV_RETURN_IF_ERROR(expr)                    \
    do {                                            \
        ::kvshard::Status kv_status_ = (expr);      \
        if (!kv_status_.ok()) return kv_status_;    \
    } while (0)

// `KV_ASSIGN_OR_RETURN(auto x, ResultExpr());` binds the value or returns the error.
#define KV_ASSIGN_OR_RETURN(lhs, expr) \
    KV_ASSIGN_OR_RETURN_IMPL(KV_CONCAT(kv_result_, __LINE__), lhs, expr)
#define KV_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
    auto tmp = (expr);                           \
    if (!tmp.ok()) return tmp.status();          \
    lhs = std::move(tmp).value()
