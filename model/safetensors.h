// Reader and writer of safetensors files (Hugging Face's weight format): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw tensor bytes.
// Files are memory-mapped; every offset is bounds-checked, so a truncated or corrupted file
// yields DataLoss naming the file. Tensor names are kept as stored (Hugging Face names).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/mapped_file.h"
#include "common/status.h"
#include "model/tensor.h"

namespace kvshard {

// One .safetensors file.
class SafetensorsFile {
  public:
    // Errors name the path: NotFound, DataLoss (header length or JSON malformed, offsets outside
    // the data, byte counts that do not match the shape), Unimplemented (dtypes other than F32,
    // F16, BF16, naming the tensor and dtype).
    static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

    const std::string& path() const { return file_.path(); }
    const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
    const TensorInfo* FindTensor(std::string_view name) const;
    // __metadata__ string entries.
    const std::unordered_map<std::string, std::string>& metadata() const { return metadata_; }

  private:
    SafetensorsFile() = default;
    Status Parse();

    MappedFile file_;
    std::vector<TensorInfo> tensors_;
    std::unordered_map<std::string, size_t> index_;
    std::unordered_map<std::string, std::string> metadata_;
};

// The tensors of a model stored in one model.safetensors or in shards listed by
// model.safetensors.index.json ({"weight_map": {tensor name: shard file name}}).
class SafetensorsModel {
  public:
    // `path`: a .safetensors file or an index .json. Shard names are relative to the index's
    // folder. Every tensor the weight map names must be in its shard (DataLoss otherwise); a
    // tensor in two shards is DataLoss.
    static Result<std::unique_ptr<SafetensorsModel>> Open(const std::string& path);

    const std::string& path() const { return path_; }
    const TensorInfo* FindTensor(std::string_view name) const;
    std::vector<std::string> TensorNames() const;  // sorted
    // The shard holding tensor `name`, for error messages ("" when absent).
    std::string FileOf(std::string_view name) const;

  private:
    SafetensorsModel() = default;

    std::string path_;
    std::vector<std::unique_ptr<SafetensorsFile>> shards_;
    std::unordered_map<std::string, std::pair<size_t, const TensorInfo*>> index_;
};

// Name of a safetensors dtype ("F32", "F16", "BF16"). REQUIRES: dtype is one of those.
std::string_view SafetensorsDTypeName(DType dtype);

// One tensor to write. `fill` writes exactly the tensor's bytes (NumElements * element size, in
// `dtype`, row-major) into the buffer it is given; it is called once, in order, so a writer never
// holds more than one tensor in memory.
struct SafetensorsWriteEntry {
    std::string name;
    DType dtype = DType::kF32;  // F32, F16 or BF16
    std::vector<int64_t> shape;
    std::function<void(uint8_t* out)> fill;
};

// Writes `entries` in order to `path`, with `metadata` as __metadata__ (omitted when empty).
Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsWriteEntry>& entries,
                        const std::vector<std::pair<std::string, std::string>>& metadata = {});
// Bytes the data section of `entries` takes (what the shard file holds after the header).
uint64_t SafetensorsDataBytes(const SafetensorsWriteEntry& entry);

}  // namespace kvshard
