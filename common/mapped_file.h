// A read-only memory map of a whole file (RAII). Model weights are read through it so a rank only
// touches the pages of the tensors (or tensor slices) it uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvshard {

class MappedFile {
  public:
    // Maps `path` read-only. A missing or unreadable file is NotFound naming the path.
    static Result<MappedFile> Open(const std::string& path);

    MappedFile() = default;
    MappedFile(MappedFile&& other) noexcept;
    MappedFile& operator=(MappedFile&& other) noexcept;
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    ~MappedFile();

    const uint8_t* data() const { return data_; }
    size_t size() const { return size_; }
    const std::string& path() const { return path_; }

  private:
    std::string path_;
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
};

// Tells the kernel that the pages under [data, data + bytes) (rounded out to whole pages) are not
// needed now: on a read-only file mapping they leave the process's resident memory and are read
// from the file again if touched. For weights copied out of a mapping at load. Safe on any other
// memory (heap, anonymous mappings): what the pages hold is kept (at most moved to swap).
void ReleaseMappedPages(const void* data, size_t bytes);

// Reads a whole (small) file into a string: configs, tokenizer.json.
Result<std::string> ReadFileToString(const std::string& path);

}  // namespace kvshard
