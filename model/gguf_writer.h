// GgufWriter: builds a GGUF v3 file in memory, for tests and synthetic models. The output is what
// GgufFile reads: metadata in insertion order, tensor infos, then tensor data at aligned offsets.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/gguf.h"
#include "model/tensor.h"

namespace kvshard {

class GgufWriter {
  public:
    // `alignment` of tensor data; written as general.alignment when it is not the default 32.
    explicit GgufWriter(uint64_t alignment = 32);

    void set_version(uint32_t version) { version_ = version; }

    void AddUInt32(std::string_view key, uint32_t v);
    void AddInt32(std::string_view key, int32_t v);
    void AddUInt64(std::string_view key, uint64_t v);
    void AddFloat32(std::string_view key, float v);
    void AddBool(std::string_view key, bool v);
    void AddString(std::string_view key, std::string_view v);
    void AddStringArray(std::string_view key, const std::vector<std::string>& v);
    void AddFloat32Array(std::string_view key, const std::vector<float>& v);
    void AddInt32Array(std::string_view key, const std::vector<int32_t>& v);
    // A value whose encoding (everything after the type id) the caller built: for tests of odd
    // or malformed values.
    void AddRaw(std::string_view key, GgufValueType type, std::string encoded_value);

    // `shape` is row-major (outermost first, as TensorInfo); `bytes` is the data in `dtype`'s
    // layout (see QuantizeRows).
    void AddTensor(std::string_view name, DType dtype, std::vector<int64_t> shape,
                   std::string bytes);
    // Encodes `values` (row-major, NumElements floats) as `dtype`.
    void AddTensorFromFloats(std::string_view name, DType dtype, std::vector<int64_t> shape,
                             const std::vector<float>& values);
    // Any ggml type id, including ones kvshard does not read.
    void AddTensorWithGgmlType(std::string_view name, uint32_t ggml_type,
                               std::vector<int64_t> shape, std::string bytes);

    std::string Serialize() const;
    Status WriteFile(const std::string& path) const;

  private:
    struct Tensor {
        std::string name;
        uint32_t ggml_type;
        std::vector<int64_t> shape;
        std::string bytes;
    };

    uint32_t version_ = 3;
    uint64_t alignment_;
    std::vector<std::string> kvs_;  // each: key, type id, value, encoded
    std::vector<Tensor> tensors_;
};

}  // namespace kvshard
