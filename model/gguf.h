// Reader of GGUF v3 files (llama.cpp's model format): header, typed metadata, tensor infos and
// aligned tensor data, all read from a memory map. Every offset and length is bounds-checked, so a
// truncated or corrupted file yields a DataLoss status naming the file and what was wrong.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "common/mapped_file.h"
#include "common/status.h"
#include "model/tensor.h"

namespace kvshard {

// GGUF metadata value type ids: the u32 stored before each metadata value and in array headers.
enum class GgufValueType : uint32_t {
    kU8 = 0,
    kI8 = 1,
    kU16 = 2,
    kI16 = 3,
    kU32 = 4,
    kI32 = 5,
    kF32 = 6,
    kBool = 7,
    kString = 8,
    kArray = 9,
    kU64 = 10,
    kI64 = 11,
    kF64 = 12,
};

// One metadata value. Integers of every width are widened to int64 (uint64 above INT64_MAX is
// rejected), floats to double; arrays keep their element kind.
struct GgufValue {
    using Array = std::variant<std::vector<int64_t>, std::vector<double>, std::vector<std::string>,
                               std::vector<bool>>;
    std::variant<int64_t, double, bool, std::string, Array> value;
};

// ggml type ids of the tensor types kvshard reads (GGUF tensor infos store these).
inline constexpr uint32_t kGgmlTypeF32 = 0;
inline constexpr uint32_t kGgmlTypeF16 = 1;
inline constexpr uint32_t kGgmlTypeQ4_0 = 2;
inline constexpr uint32_t kGgmlTypeQ4_1 = 3;
inline constexpr uint32_t kGgmlTypeQ8_0 = 8;
inline constexpr uint32_t kGgmlTypeBF16 = 30;
// nullopt for ggml types kvshard does not read (K-quants, IQ types, ...).
std::optional<DType> DTypeFromGgmlType(uint32_t ggml_type);
uint32_t GgmlTypeOf(DType dtype);

class GgufFile {
  public:
    // Opens and parses `path`. Errors name the path: NotFound, DataLoss (bad magic, truncated,
    // offsets past the end, absurd counts), Unimplemented (version != 2/3, unknown tensor type).
    static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);

    const std::string& path() const { return file_.path(); }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }

    bool Has(std::string_view key) const;
    // Typed getters: NotFound when the key is absent, InvalidArgument when its type differs.
    Result<std::string> GetString(std::string_view key) const;
    Result<int64_t> GetInt(std::string_view key) const;
    Result<double> GetFloat(std::string_view key) const;  // also accepts integers
    Result<bool> GetBool(std::string_view key) const;
    Result<std::vector<std::string>> GetStringArray(std::string_view key) const;
    Result<std::vector<double>> GetFloatArray(std::string_view key) const;
    Result<std::vector<int64_t>> GetIntArray(std::string_view key) const;
    const GgufValue* Find(std::string_view key) const;
    const std::vector<std::string>& keys() const { return keys_; }  // in file order

    const std::vector<TensorInfo>& tensors() const { return tensors_; }
    const TensorInfo* FindTensor(std::string_view name) const;

    // Frees every metadata value, for a reader that has taken what it needs (a tokenizer's
    // tables are most of them: ~3.5 MB for a 49k vocabulary); afterwards no key is found. The
    // tensors stay.
    void DropMetadata();

  private:
    GgufFile() = default;
    Status Parse();

    MappedFile file_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    std::vector<std::string> keys_;
    std::unordered_map<std::string, GgufValue> metadata_;
    std::vector<TensorInfo> tensors_;
    std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace kvshard
