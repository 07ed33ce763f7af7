// Writer and Reader: the field encoding of kvshard's frames (comm/plan_codec.h), shared by the
// codec of steps (step_codec.cc) and of the control messages (plan_codec.cc). Internal to comm/.
//
// Every field is little-endian fixed width: integers as they are, floats as their bits, a bool
// as one byte (0 or 1), a Status code as uint32, a count as uint32, a string as its count and
// bytes. A Reader never reads past its bytes: the first problem is kept (DataLoss naming the
// field and the byte) and every later read returns zero.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/check.h"
#include "common/status.h"

namespace kvshard::wire {

class Writer {
  public:
    explicit Writer(std::string* out) : out_(out) {}

    template <typename T>
    void Fixed(T value) {
        static_assert(std::is_integral_v<T>);
        using U = std::make_unsigned_t<T>;
        auto bits = static_cast<U>(value);
        for (size_t i = 0; i < sizeof(T); ++i) {
            out_->push_back(static_cast<char>(bits & 0xFF));
            bits = static_cast<U>(bits >> 8);
        }
    }
    void F32(float value) {
        uint32_t bits = 0;
        std::memcpy(&bits, &value, sizeof(bits));
        Fixed(bits);
    }
    void F64(double value) {
        uint64_t bits = 0;
        std::memcpy(&bits, &value, sizeof(bits));
        Fixed(bits);
    }
    void Bool(bool value) { out_->push_back(value ? 1 : 0); }
    void Count(size_t n) {
        KV_CHECK_LE(n, size_t{UINT32_MAX}) << "too many elements for a frame";
        Fixed(static_cast<uint32_t>(n));
    }
    void String(const std::string& s) {
        Count(s.size());
        out_->append(s);
    }
    template <typename T>
    void Ints(const std::vector<T>& values) {
        Count(values.size());
        for (T v : values) Fixed(v);
    }

  private:
    std::string* out_;
};

// Reads fields from a payload. The first problem is remembered and later reads return zeros,
// so a decoder reads straight through and checks status() once at the end.
class Reader {
  public:
    explicit Reader(std::string_view bytes) : bytes_(bytes) {}

    const Status& status() const { return status_; }

    template <typename T>
    T Fixed(const char* field) {
        static_assert(std::is_integral_v<T>);
        if (!Need(sizeof(T), field)) return T{};
        std::make_unsigned_t<T> bits = 0;
        for (size_t i = 0; i < sizeof(T); ++i) {
            bits |= static_cast<std::make_unsigned_t<T>>(static_cast<uint8_t>(bytes_[pos_ + i]))
                    << (8 * i);
        }
        pos_ += sizeof(T);
        return static_cast<T>(bits);
    }
    float F32(const char* field) {
        const auto bits = Fixed<uint32_t>(field);
        float value = 0;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
    double F64(const char* field) {
        const auto bits = Fixed<uint64_t>(field);
        double value = 0;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
    bool Bool(const char* field) {
        const auto byte = Fixed<uint8_t>(field);
        if (byte > 1) Fail(std::string(field) + ": bool byte " + std::to_string(byte));
        return byte == 1;
    }
    StatusCode Code(const char* field) {
        const auto code = Fixed<uint32_t>(field);
        if (code > static_cast<uint32_t>(StatusCode::kInternal)) {
            Fail(std::string(field) + ": " + std::to_string(code) + " is no status code");
            return StatusCode::kInternal;
        }
        return static_cast<StatusCode>(code);
    }
    // An element count, refused when the remaining bytes cannot hold that many elements of at
    // least `min_element_bytes` each: what makes the reserve() calls below safe.
    uint32_t Count(const char* field, size_t min_element_bytes, uint32_t max = UINT32_MAX) {
        const auto n = Fixed<uint32_t>(field);
        if (status_.ok() && n > max) {
            Fail(std::string(field) + ": " + std::to_string(n) + " elements, at most " +
                 std::to_string(max) + " allowed");
            return 0;
        }
        if (status_.ok() && n > (bytes_.size() - pos_) / min_element_bytes) {
            Fail(std::string(field) + ": " + std::to_string(n) + " elements of at least " +
                 std::to_string(min_element_bytes) + " bytes, but only " +
                 std::to_string(bytes_.size() - pos_) + " bytes remain");
            return 0;
        }
        return n;
    }
    std::string String(const char* field) {
        const uint32_t n = Count(field, 1);
        if (!status_.ok()) return {};
        std::string s(bytes_.substr(pos_, n));
        pos_ += n;
        return s;
    }
    template <typename T>
    std::vector<T> Ints(const char* field) {
        const uint32_t n = Count(field, sizeof(T));
        std::vector<T> values;
        values.reserve(n);
        for (uint32_t i = 0; i < n && status_.ok(); ++i) values.push_back(Fixed<T>(field));
        return values;
    }
    void Finish() {
        if (status_.ok() && pos_ != bytes_.size()) {
            Fail(std::to_string(bytes_.size() - pos_) + " bytes after the last field");
        }
    }
    // Fails the decode (the first failure is kept).
    void Fail(std::string message) {
        if (status_.ok()) {
            status_ = DataLoss("malformed payload at byte " + std::to_string(pos_) + ": " +
                               std::move(message));
        }
    }

  private:
    bool Need(size_t n, const char* field) {
        if (!status_.ok()) return false;
        if (bytes_.size() - pos_ < n) {
            Fail(std::string(field) + ": truncated (needs " + std::to_string(n) + " bytes, " +
                 std::to_string(bytes_.size() - pos_) + " remain)");
            return false;
        }
        return true;
    }

    std::string_view bytes_;
    size_t pos_ = 0;
    Status status_;
};

}  // namespace kvshard::wire
