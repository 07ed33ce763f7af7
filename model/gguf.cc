// GgufFile (model/gguf.h): the file's structure (header, metadata, tensor infos, data offsets),
// the typed accessors over its metadata, and the mapping between ggml type ids and DType. The
// values themselves are read by model/gguf_reader.h.
#include "model/gguf.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "model/gguf_reader.h"

namespace kvshard {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int kMaxDims = 4;
constexpr uint64_t kMaxAlignment = 1u << 20;
// Limits far above any real model (the largest models have a few thousand tensors) that keep a
// corrupted count from allocating gigabytes before the bytes run out.
constexpr uint64_t kMaxKvs = 1u << 20;
constexpr uint64_t kMaxTensors = 1u << 20;

using internal::GgufCursor;
using internal::PrintableGgufName;
using internal::QuoteGgufKey;
using internal::ReadGgufValue;

}  // namespace

// ggml type ids of the formats gguf.h does not name (ggml.h's enum ggml_type).
constexpr uint32_t kGgmlTypeQ5_0 = 6;
constexpr uint32_t kGgmlTypeQ5_1 = 7;
constexpr uint32_t kGgmlTypeQ2_K = 10;
constexpr uint32_t kGgmlTypeQ3_K = 11;
constexpr uint32_t kGgmlTypeQ4_K = 12;
constexpr uint32_t kGgmlTypeQ5_K = 13;
constexpr uint32_t kGgmlTypeQ6_K = 14;
constexpr uint32_t kGgmlTypeQ8_K = 15;

std::optional<DType> DTypeFromGgmlType(uint32_t ggml_type) {
    switch (ggml_type) {
        case kGgmlTypeF32:
            return DType::kF32;
        case kGgmlTypeF16:
            return DType::kF16;
        case kGgmlTypeQ4_0:
            return DType::kQ4_0;
        case kGgmlTypeQ4_1:
            return DType::kQ4_1;
        case kGgmlTypeQ8_0:
            return DType::kQ8_0;
        case kGgmlTypeBF16:
            return DType::kBF16;
        case kGgmlTypeQ5_0:
            return DType::kQ5_0;
        case kGgmlTypeQ5_1:
            return DType::kQ5_1;
        case kGgmlTypeQ2_K:
            return DType::kQ2_K;
        case kGgmlTypeQ3_K:
            return DType::kQ3_K;
        case kGgmlTypeQ4_K:
            return DType::kQ4_K;
        case kGgmlTypeQ5_K:
            return DType::kQ5_K;
        case kGgmlTypeQ6_K:
            return DType::kQ6_K;
        case kGgmlTypeQ8_K:
            return DType::kQ8_K;
        default:
            return std::nullopt;
    }
}

uint32_t GgmlTypeOf(DType dtype) {
    switch (dtype) {
        case DType::kF32:
            return kGgmlTypeF32;
        case DType::kF16:
            return kGgmlTypeF16;
        case DType::kBF16:
            return kGgmlTypeBF16;
        case DType::kQ8_0:
            return kGgmlTypeQ8_0;
        case DType::kQ4_0:
            return kGgmlTypeQ4_0;
        case DType::kQ4_1:
            return kGgmlTypeQ4_1;
        case DType::kQ5_0:
            return kGgmlTypeQ5_0;
        case DType::kQ5_1:
            return kGgmlTypeQ5_1;
        case DType::kQ2_K:
            return kGgmlTypeQ2_K;
        case DType::kQ3_K:
            return kGgmlTypeQ3_K;
        case DType::kQ4_K:
            return kGgmlTypeQ4_K;
        case DType::kQ5_K:
            return kGgmlTypeQ5_K;
        case DType::kQ6_K:
            return kGgmlTypeQ6_K;
        case DType::kQ8_K:
            return kGgmlTypeQ8_K;
    }
    return kGgmlTypeF32;
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
    KV_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
    std::unique_ptr<GgufFile> file(new GgufFile());
    file->file_ = std::move(mapped);
    KV_RETURN_IF_ERROR(file->Parse());
    return file;
}

Status GgufFile::Parse() {
    const std::string& p = file_.path();
    GgufCursor c(file_.data(), file_.size(), p);

    uint32_t magic = 0;
    KV_RETURN_IF_ERROR(c.Read(&magic, "magic"));
    if (magic != kGgufMagic) return DataLoss(p + ": not a GGUF file (bad magic)");
    KV_RETURN_IF_ERROR(c.Read(&version_, "version"));
    if (version_ != 2 && version_ != 3) {
        return Unimplemented(p + ": GGUF version " + std::to_string(version_) +
                             " is not supported (2 and 3 are)");
    }
    uint64_t tensor_count = 0;
    uint64_t kv_count = 0;
    KV_RETURN_IF_ERROR(c.Read(&tensor_count, "tensor count"));
    KV_RETURN_IF_ERROR(c.Read(&kv_count, "metadata count"));
    // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes.
    KV_RETURN_IF_ERROR(c.CheckCount(kv_count, 13, kMaxKvs, "metadata"));

    for (uint64_t i = 0; i < kv_count; ++i) {
        std::string key;
        KV_RETURN_IF_ERROR(c.ReadString(&key, "metadata key #" + std::to_string(i)));
        GgufValueType type{};
        KV_RETURN_IF_ERROR(c.Read(&type, QuoteGgufKey(key) + " type"));
        GgufValue value;
        bool kept = false;
        KV_RETURN_IF_ERROR(ReadGgufValue(c, type, QuoteGgufKey(key), &value, &kept));
        if (metadata_.count(key) != 0) return c.Error("duplicate " + QuoteGgufKey(key));
        if (!kept) continue;  // nested arrays: nothing kvshard reads
        keys_.push_back(key);
        metadata_.emplace(std::move(key), std::move(value));
    }

    if (const GgufValue* a = Find("general.alignment")) {
        const int64_t* v = std::get_if<int64_t>(&a->value);
        if (v == nullptr || *v <= 0 || static_cast<uint64_t>(*v) > kMaxAlignment ||
            (*v & (*v - 1)) != 0) {
            return DataLoss(p + ": general.alignment must be a power of two up to " +
                            std::to_string(kMaxAlignment));
        }
        alignment_ = static_cast<uint64_t>(*v);
    }

    // A tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
    KV_RETURN_IF_ERROR(c.CheckCount(tensor_count, 24, kMaxTensors, "tensor"));
    std::vector<uint64_t> offsets;
    offsets.reserve(tensor_count);
    tensors_.reserve(tensor_count);
    for (uint64_t i = 0; i < tensor_count; ++i) {
        TensorInfo t;
        KV_RETURN_IF_ERROR(c.ReadString(&t.name, "tensor name #" + std::to_string(i)));
        const std::string what = "tensor '" + PrintableGgufName(t.name) + "'";
        uint32_t n_dims = 0;
        KV_RETURN_IF_ERROR(c.Read(&n_dims, what + " dimension count"));
        if (n_dims > kMaxDims) {
            return c.Error(what + " has " + std::to_string(n_dims) + " dimensions (at most " +
                           std::to_string(kMaxDims) + ")");
        }
        t.shape.resize(n_dims);
        int64_t num_elements = 1;
        for (uint32_t d = 0; d < n_dims; ++d) {
            uint64_t dim = 0;
            KV_RETURN_IF_ERROR(c.Read(&dim, what + " dimension"));
            if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
                __builtin_mul_overflow(num_elements, static_cast<int64_t>(dim), &num_elements)) {
                return c.Error(what + " has an invalid dimension " + std::to_string(dim));
            }
            t.shape[n_dims - 1 - d] = static_cast<int64_t>(dim);  // GGUF: innermost first
        }
        uint32_t ggml_type = 0;
        KV_RETURN_IF_ERROR(c.Read(&ggml_type, what + " type"));
        uint64_t offset = 0;
        KV_RETURN_IF_ERROR(c.Read(&offset, what + " offset"));
        std::optional<DType> dtype = DTypeFromGgmlType(ggml_type);
        if (!dtype) {
            return Unimplemented(p + ": tensor '" + PrintableGgufName(t.name) + "' has ggml type " +
                                 std::to_string(ggml_type) +
                                 ", which kvshard does not read (F32, F16, BF16, Q8_0, Q4_0, "
                                 "Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, Q8_K are supported)");
        }
        t.dtype = *dtype;
        const int64_t cols = t.NumCols();
        if (cols % BlockElements(t.dtype) != 0) {
            return DataLoss(p + ": " + what + " of type " + std::string(DTypeName(t.dtype)) +
                            " has a row of " + std::to_string(cols) +
                            " elements, not a multiple of its block size");
        }
        // Rows * row bytes cannot overflow size_t: num_elements fits int64 and every block type
        // takes at most 4 bytes per element (F32; the Q types under 1.2).
        const uint64_t bytes = static_cast<uint64_t>(t.NumRows()) * RowBytes(t.dtype, cols);
        if (bytes > file_.size()) {
            return DataLoss(p + ": " + what + " needs " + std::to_string(bytes) +
                            " bytes, more than the whole file");
        }
        t.num_bytes = bytes;
        if (offset % alignment_ != 0) {
            return DataLoss(p + ": " + what + " offset " + std::to_string(offset) +
                            " is not a multiple of the alignment " + std::to_string(alignment_));
        }
        if (tensor_index_.count(t.name) != 0) return DataLoss(p + ": duplicate " + what);
        tensor_index_.emplace(t.name, tensors_.size());
        tensors_.push_back(std::move(t));
        offsets.push_back(offset);
    }

    const uint64_t infos_end = c.pos();
    const uint64_t data_start = (infos_end + alignment_ - 1) / alignment_ * alignment_;
    const uint64_t size = file_.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
        TensorInfo& t = tensors_[i];
        const uint64_t offset = offsets[i];
        if (data_start > size || offset > size - data_start ||
            t.num_bytes > size - data_start - offset) {
            return DataLoss(p + ": tensor '" + PrintableGgufName(t.name) + "' data [" +
                            std::to_string(data_start) + " + " + std::to_string(offset) + ", +" +
                            std::to_string(t.num_bytes) + ") lies past the end of the file (" +
                            std::to_string(size) + " bytes)");
        }
        t.data = file_.data() + data_start + offset;
    }
    // Every value and tensor info is copied out of the header: its pages (~1.8 MB for a 49k
    // vocabulary's tokens and merges) need not stay resident.
    ReleaseMappedPages(file_.data(), static_cast<size_t>(infos_end));
    return Status::Ok();
}

void GgufFile::DropMetadata() {
    keys_ = {};
    metadata_ = {};
}

bool GgufFile::Has(std::string_view key) const { return Find(key) != nullptr; }

const GgufValue* GgufFile::Find(std::string_view key) const {
    auto it = metadata_.find(std::string(key));
    return it == metadata_.end() ? nullptr : &it->second;
}

const TensorInfo* GgufFile::FindTensor(std::string_view name) const {
    auto it = tensor_index_.find(std::string(name));
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

template <typename T>
Result<const T*> GetAs(const GgufFile& f, std::string_view key, const char* type_name) {
    const GgufValue* v = f.Find(key);
    if (v == nullptr) return NotFound(f.path() + ": " + QuoteGgufKey(key) + " not found");
    if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double> ||
                  std::is_same_v<T, bool> || std::is_same_v<T, std::string>) {
        if (const T* t = std::get_if<T>(&v->value)) return t;
    } else if (const auto* a = std::get_if<GgufValue::Array>(&v->value)) {
        if (const T* t = std::get_if<T>(a)) return t;
    }
    return InvalidArgument(f.path() + ": " + QuoteGgufKey(key) + " is not " + type_name);
}

}  // namespace

Result<std::string> GgufFile::GetString(std::string_view key) const {
    KV_ASSIGN_OR_RETURN(const std::string* v, GetAs<std::string>(*this, key, "a string"));
    return *v;
}

Result<int64_t> GgufFile::GetInt(std::string_view key) const {
    KV_ASSIGN_OR_RETURN(const int64_t* v, GetAs<int64_t>(*this, key, "an integer"));
    return *v;
}

Result<double> GgufFile::GetFloat(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (v != nullptr) {
        if (const int64_t* i = std::get_if<int64_t>(&v->value)) return static_cast<double>(*i);
    }
    KV_ASSIGN_OR_RETURN(const double* d, GetAs<double>(*this, key, "a number"));
    return *d;
}

Result<bool> GgufFile::GetBool(std::string_view key) const {
    KV_ASSIGN_OR_RETURN(const bool* v, GetAs<bool>(*this, key, "a bool"));
    return *v;
}

Result<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
    KV_ASSIGN_OR_RETURN(const auto* v,
                        GetAs<std::vector<std::string>>(*this, key, "an array of strings"));
    return *v;
}

Result<std::vector<double>> GgufFile::GetFloatArray(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (v != nullptr) {
        if (const auto* a = std::get_if<GgufValue::Array>(&v->value)) {
            if (const auto* ints = std::get_if<std::vector<int64_t>>(a)) {
                return std::vector<double>(ints->begin(), ints->end());
            }
        }
    }
    KV_ASSIGN_OR_RETURN(const auto* d,
                        GetAs<std::vector<double>>(*this, key, "an array of numbers"));
    return *d;
}

Result<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
    KV_ASSIGN_OR_RETURN(const auto* v,
                        GetAs<std::vector<int64_t>>(*this, key, "an array of integers"));
    return *v;
}

}  // namespace kvshard