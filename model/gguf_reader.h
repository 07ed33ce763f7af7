// Reading GGUF-encoded values (model/gguf.h; the format: ggml's docs/gguf.md): a bounds-checked
// little-endian cursor over the mapped file, and the typed values, strings and arrays of the
// metadata. Internal to model/: GgufFile::Parse (gguf.cc) reads the file's structure with them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "common/status.h"
#include "model/gguf.h"

namespace kvshard::internal {

// A bounds-checked little-endian reader over the mapped bytes. Every read either succeeds or
// returns DataLoss naming the file, what was being read and the offset.
class GgufCursor {
  public:
    GgufCursor(const uint8_t* data, size_t size, const std::string& path)
        : data_(data), size_(size), path_(path) {}

    size_t pos() const { return pos_; }
    size_t remaining() const { return size_ - pos_; }

    Status Error(const std::string& what) const {
        return DataLoss(path_ + ": " + what + " (at byte " + std::to_string(pos_) + ")");
    }

    Status Need(size_t n, const std::string& what) const {
        if (remaining() < n) return Error("file truncated while reading " + what);
        return Status::Ok();
    }

    template <typename T>
    Status Read(T* out, const std::string& what) {
        KV_RETURN_IF_ERROR(Need(sizeof(T), what));
        std::memcpy(out, data_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return Status::Ok();
    }

    Status ReadString(std::string* out, const std::string& what) {
        uint64_t len = 0;
        KV_RETURN_IF_ERROR(Read(&len, what + " length"));
        if (len > remaining()) {
            return Error(what + " length " + std::to_string(len) + " exceeds the " +
                         std::to_string(remaining()) + " bytes left");
        }
        out->assign(reinterpret_cast<const char*>(data_ + pos_), len);
        pos_ += len;
        return Status::Ok();
    }

    // Checks that `count` (at most `max_count`) values of at least `min_size` bytes each can
    // still follow.
    Status CheckCount(uint64_t count, size_t min_size, uint64_t max_count,
                      const std::string& what) const {
        if (count > max_count) {
            return Error(what + " count " + std::to_string(count) + " exceeds the limit of " +
                         std::to_string(max_count));
        }
        if (min_size == 0 || count > remaining() / min_size) {
            return Error(what + " count " + std::to_string(count) + " is impossible with " +
                         std::to_string(remaining()) + " bytes left");
        }
        return Status::Ok();
    }

  private:
    const uint8_t* data_;
    size_t size_;
    const std::string& path_;
    size_t pos_ = 0;
};

// Reads one value of `type`; `*kept` is false for values GgufValue cannot hold (nested arrays).
Status ReadGgufValue(GgufCursor& c, GgufValueType type, const std::string& what, GgufValue* out,
                     bool* kept);

// A name read from the file, fit for an error message: a corrupted length can make it long
// binary garbage, so it is cut and non-printable bytes are escaped.
std::string PrintableGgufName(std::string_view name);

// "key 'NAME'", NAME made printable.
std::string QuoteGgufKey(std::string_view key);

}  // namespace kvshard::internal
