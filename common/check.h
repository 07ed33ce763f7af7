// KV_CHECK: fail fast on broken invariants, printing file, line, the condition and the values.
// Not for input errors: those return a Status (common/status.h).
#pragma once

#include <sstream>
#include <string>

namespace kvshard::internal {

class CheckFailure {
public:
    CheckFailure(const char* file, int line, const char* condition);
    [[noreturn]] ~CheckFailure();
    template <typename T>
    CheckFailure& operator<<(const T& value) {
        stream_ << value;
        return *this;
    }

private:
    std::ostringstream stream_;
};

// Lets `KV_CHECK(x) << "more"` compile to nothing on the success path.
struct Voidify {
    void operator&(const CheckFailure&) {}
};

}  // namespace kvshard::internal

#define KV_CHECK(cond)                     \
    (cond) ? (void)0                       \
           : ::kvshard::internal::Voidify() & \
                 ::kvshard::internal::CheckFailure(__FILE__, __LINE__, #cond)

#define KV_CHECK_OP(a, op, b)                                                              \
    ((a)op(b)) ? (void)0                                                                   \
               : ::kvshard::internal::Voidify() &                                          \
                     ::kvshard::internal::CheckFailure(__FILE__, __LINE__, #a " " #op " " #b) \
                         << "(" << (a) << " vs " << (b) << ") "

#define KV_CHECK_EQ(a, b) KV_CHECK_OP(a, ==, b)
#define KV_CHECK_NE(a, b) KV_CHECK_OP(a, !=, b)
#define KV_CHECK_LT(a, b) KV_CHECK_OP(a, <, b)
#define KV_CHECK_LE(a, b) KV_CHECK_OP(a, <=, b)
#define KV_CHECK_GT(a, b) KV_CHECK_OP(a, >, b)
#define KV_CHECK_GE(a, b) KV_CHECK_OP(a, >=, b)
