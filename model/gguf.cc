#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace kvshard {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int kMaxDims = 4;
constexpr int kMaxArrayNesting = 8;
constexpr uint64_t kMaxAlignment = 1u << 20;
// Limits far above any real model (the largest vocabularies have ~256K tokens, the largest
// models a few thousand tensors) that keep a corrupted count from allocating gigabytes before
// the bytes run out.
constexpr uint64_t kMaxArrayElements = 1u << 24;
constexpr uint64_t kMaxKvs = 1u << 20;
constexpr uint64_t kMaxTensors = 1u << 20;

using enum GgufValueType;

// Smallest encoded size of one value of `type`, so a count can be checked against the bytes left
// before anything is allocated for it. 0 for an unknown type.
size_t MinEncodedSize(GgufValueType type) {
    switch (type) {
        case kU8:
        case kI8:
        case kBool:
            return 1;
        case kU16:
        case kI16:
            return 2;
        case kU32:
        case kI32:
        case kF32:
            return 4;
        case kU64:
        case kI64:
        case kF64:
        case kString:
            return 8;
        case kArray:
            return 12;
        default:
            return 0;
    }
}

// A bounds-checked little-endian reader over the mapped bytes. Every read either succeeds or
// returns DataLoss naming the file, what was being read and the offset.
class Cursor {
  public:
    Cursor(const uint8_t* data, size_t size, const std::string& path)
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

// Reads one scalar of an integer GGUF type, widened to int64.
Status ReadInt(Cursor& c, GgufValueType type, const std::string& what, int64_t* out) {
    switch (type) {
        case kU8: {
            uint8_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        case kI8: {
            int8_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        case kU16: {
            uint16_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        case kI16: {
            int16_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        case kU32: {
            uint32_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        case kI32: {
            int32_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        case kU64: {
            uint64_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
                return c.Error(what + ": uint64 value " + std::to_string(v) +
                               " does not fit in int64");
            }
            *out = static_cast<int64_t>(v);
            return Status::Ok();
        }
        case kI64: {
            int64_t v = 0;
            KV_RETURN_IF_ERROR(c.Read(&v, what));
            *out = v;
            return Status::Ok();
        }
        default:
            return c.Error(what + ": type " + std::to_string(static_cast<uint32_t>(type)) +
                           " is not an integer type");
    }
}

bool IsIntType(GgufValueType t) {
    return t == kU8 || t == kI8 || t == kU16 || t == kI16 || t == kU32 || t == kI32 || t == kU64 ||
           t == kI64;
}

Status ReadFloat(Cursor& c, GgufValueType type, const std::string& what, double* out) {
    if (type == kF32) {
        float v = 0;
        KV_RETURN_IF_ERROR(c.Read(&v, what));
        *out = v;
    } else {
        double v = 0;
        KV_RETURN_IF_ERROR(c.Read(&v, what));
        *out = v;
    }
    return Status::Ok();
}

Status ReadBool(Cursor& c, const std::string& what, bool* out) {
    uint8_t v = 0;
    KV_RETURN_IF_ERROR(c.Read(&v, what));
    if (v > 1) return c.Error(what + ": bool value " + std::to_string(v));
    *out = v != 0;
    return Status::Ok();
}

// Reads the elements of an array value. Arrays of arrays are walked (to stay in bounds) but not
// kept: `*kept` is false then.
Status ReadArray(Cursor& c, const std::string& what, int depth, GgufValue::Array* out, bool* kept) {
    if (depth > kMaxArrayNesting) return c.Error(what + ": arrays nested too deeply");
    GgufValueType elem_type{};
    uint64_t count = 0;
    KV_RETURN_IF_ERROR(c.Read(&elem_type, what + " element type"));
    KV_RETURN_IF_ERROR(c.Read(&count, what + " element count"));
    const size_t min_size = MinEncodedSize(elem_type);
    if (min_size == 0) {
        return c.Error(what + ": unknown array element type " +
                       std::to_string(static_cast<uint32_t>(elem_type)));
    }
    KV_RETURN_IF_ERROR(c.CheckCount(count, min_size, kMaxArrayElements, what + " element"));
    *kept = true;
    if (IsIntType(elem_type)) {
        std::vector<int64_t> v(count);
        for (uint64_t i = 0; i < count; ++i) KV_RETURN_IF_ERROR(ReadInt(c, elem_type, what, &v[i]));
        *out = std::move(v);
    } else if (elem_type == kF32 || elem_type == kF64) {
        std::vector<double> v(count);
        for (uint64_t i = 0; i < count; ++i) {
            KV_RETURN_IF_ERROR(ReadFloat(c, elem_type, what, &v[i]));
        }
        *out = std::move(v);
    } else if (elem_type == kBool) {
        std::vector<bool> v(count);
        for (uint64_t i = 0; i < count; ++i) {
            bool b = false;
            KV_RETURN_IF_ERROR(ReadBool(c, what, &b));
            v[i] = b;
        }
        *out = std::move(v);
    } else if (elem_type == kString) {
        // Grown as strings are read, so memory follows the bytes actually there.
        std::vector<std::string> v;
        v.reserve(std::min<uint64_t>(count, 1u << 16));
        for (uint64_t i = 0; i < count; ++i) {
            KV_RETURN_IF_ERROR(c.ReadString(&v.emplace_back(), what));
        }
        *out = std::move(v);
    } else {  // kArray
        *kept = false;
        for (uint64_t i = 0; i < count; ++i) {
            GgufValue::Array inner;
            bool inner_kept = false;
            KV_RETURN_IF_ERROR(ReadArray(c, what, depth + 1, &inner, &inner_kept));
        }
    }
    return Status::Ok();
}

// Reads one value of `type`; `*kept` is false for values GgufValue cannot hold (nested arrays).
Status ReadValue(Cursor& c, GgufValueType type, const std::string& what, GgufValue* out,
                 bool* kept) {
    *kept = true;
    if (IsIntType(type)) {
        int64_t v = 0;
        KV_RETURN_IF_ERROR(ReadInt(c, type, what, &v));
        out->value = v;
    } else if (type == kF32 || type == kF64) {
        double v = 0;
        KV_RETURN_IF_ERROR(ReadFloat(c, type, what, &v));
        out->value = v;
    } else if (type == kBool) {
        bool v = false;
        KV_RETURN_IF_ERROR(ReadBool(c, what, &v));
        out->value = v;
    } else if (type == kString) {
        std::string v;
        KV_RETURN_IF_ERROR(c.ReadString(&v, what));
        out->value = std::move(v);
    } else if (type == kArray) {
        GgufValue::Array a;
        KV_RETURN_IF_ERROR(ReadArray(c, what, 0, &a, kept));
        out->value = std::move(a);
    } else {
        return c.Error(what + ": unknown value type " +
                       std::to_string(static_cast<uint32_t>(type)));
    }
    return Status::Ok();
}

// A name read from the file, fit for an error message: a corrupted length can make it long
// binary garbage, so it is cut and non-printable bytes are escaped.
std::string Printable(std::string_view name) {
    constexpr size_t kMaxChars = 80;
    std::string out;
    for (size_t i = 0; i < name.size() && i < kMaxChars; ++i) {
        const unsigned char c = static_cast<unsigned char>(name[i]);
        if (c >= 0x20 && c < 0x7F) {
            out += static_cast<char>(c);
        } else {
            static const char kHex[] = "0123456789abcdef";
            out += "\\x";
            out += kHex[c >> 4];
            out += kHex[c & 15];
        }
    }
    if (name.size() > kMaxChars) out += "...";
    return out;
}

std::string QuoteKey(std::string_view key) { return "key '" + Printable(key) + "'"; }

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
    Cursor c(file_.data(), file_.size(), p);

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
        KV_RETURN_IF_ERROR(c.Read(&type, QuoteKey(key) + " type"));
        GgufValue value;
        bool kept = false;
        KV_RETURN_IF_ERROR(ReadValue(c, type, QuoteKey(key), &value, &kept));
        if (metadata_.count(key) != 0) return c.Error("duplicate " + QuoteKey(key));
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
        const std::string what = "tensor '" + Printable(t.name) + "'";
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
            return Unimplemented(p + ": tensor '" + Printable(t.name) + "' has ggml type " +
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
            return DataLoss(p + ": tensor '" + Printable(t.name) + "' data [" +
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
    if (v == nullptr) return NotFound(f.path() + ": " + QuoteKey(key) + " not found");
    if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double> ||
                  std::is_same_v<T, bool> || std::is_same_v<T, std::string>) {
        if (const T* t = std::get_if<T>(&v->value)) return t;
    } else if (const auto* a = std::get_if<GgufValue::Array>(&v->value)) {
        if (const T* t = std::get_if<T>(a)) return t;
    }
    return InvalidArgument(f.path() + ": " + QuoteKey(key) + " is not " + type_name);
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
