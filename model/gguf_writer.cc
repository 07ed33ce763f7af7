#include "model/gguf_writer.h"

#include <cstring>
#include <fstream>

#include "common/check.h"
#include "model/gguf.h"

namespace kvshard {
namespace {

template <typename T>
void Put(std::string* out, T v) {
    char buf[sizeof(T)];
    std::memcpy(buf, &v, sizeof(T));
    out->append(buf, sizeof(T));
}

void PutString(std::string* out, std::string_view s) {
    Put<uint64_t>(out, s.size());
    out->append(s);
}

std::string ArrayHeader(GgufValueType elem, size_t count) {
    std::string s;
    Put<uint32_t>(&s, static_cast<uint32_t>(elem));
    Put<uint64_t>(&s, count);
    return s;
}

}  // namespace

GgufWriter::GgufWriter(uint64_t alignment) : alignment_(alignment) {
    KV_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0) << alignment;
    if (alignment != 32) AddUInt32("general.alignment", static_cast<uint32_t>(alignment));
}

void GgufWriter::AddRaw(std::string_view key, GgufValueType type, std::string encoded_value) {
    std::string kv;
    PutString(&kv, key);
    Put<uint32_t>(&kv, static_cast<uint32_t>(type));
    kv += encoded_value;
    kvs_.push_back(std::move(kv));
}

void GgufWriter::AddUInt32(std::string_view key, uint32_t v) {
    std::string e;
    Put(&e, v);
    AddRaw(key, GgufValueType::kU32, std::move(e));
}

void GgufWriter::AddInt32(std::string_view key, int32_t v) {
    std::string e;
    Put(&e, v);
    AddRaw(key, GgufValueType::kI32, std::move(e));
}

void GgufWriter::AddUInt64(std::string_view key, uint64_t v) {
    std::string e;
    Put(&e, v);
    AddRaw(key, GgufValueType::kU64, std::move(e));
}

void GgufWriter::AddFloat32(std::string_view key, float v) {
    std::string e;
    Put(&e, v);
    AddRaw(key, GgufValueType::kF32, std::move(e));
}

void GgufWriter::AddBool(std::string_view key, bool v) {
    std::string e;
    Put<uint8_t>(&e, v ? 1 : 0);
    AddRaw(key, GgufValueType::kBool, std::move(e));
}

void GgufWriter::AddString(std::string_view key, std::string_view v) {
    std::string e;
    PutString(&e, v);
    AddRaw(key, GgufValueType::kString, std::move(e));
}

void GgufWriter::AddStringArray(std::string_view key, const std::vector<std::string>& v) {
    std::string e = ArrayHeader(GgufValueType::kString, v.size());
    for (const std::string& s : v) PutString(&e, s);
    AddRaw(key, GgufValueType::kArray, std::move(e));
}

void GgufWriter::AddFloat32Array(std::string_view key, const std::vector<float>& v) {
    std::string e = ArrayHeader(GgufValueType::kF32, v.size());
    for (float f : v) Put(&e, f);
    AddRaw(key, GgufValueType::kArray, std::move(e));
}

void GgufWriter::AddInt32Array(std::string_view key, const std::vector<int32_t>& v) {
    std::string e = ArrayHeader(GgufValueType::kI32, v.size());
    for (int32_t i : v) Put(&e, i);
    AddRaw(key, GgufValueType::kArray, std::move(e));
}

void GgufWriter::AddTensor(std::string_view name, DType dtype, std::vector<int64_t> shape,
                           std::string bytes) {
    TensorInfo info;
    info.shape = shape;
    KV_CHECK_EQ(bytes.size(), static_cast<size_t>(info.NumRows()) * RowBytes(dtype, info.NumCols()))
        << name;
    AddTensorWithGgmlType(name, GgmlTypeOf(dtype), std::move(shape), std::move(bytes));
}

void GgufWriter::AddTensorFromFloats(std::string_view name, DType dtype, std::vector<int64_t> shape,
                                     const std::vector<float>& values) {
    TensorInfo info;
    info.shape = shape;
    KV_CHECK_EQ(static_cast<int64_t>(values.size()), info.NumElements()) << name;
    std::string bytes(static_cast<size_t>(info.NumRows()) * RowBytes(dtype, info.NumCols()), '\0');
    QuantizeRows(dtype, values.data(), info.NumRows(), info.NumCols(),
                 reinterpret_cast<uint8_t*>(bytes.data()));
    AddTensor(name, dtype, std::move(shape), std::move(bytes));
}

void GgufWriter::AddTensorWithGgmlType(std::string_view name, uint32_t ggml_type,
                                       std::vector<int64_t> shape, std::string bytes) {
    tensors_.push_back({std::string(name), ggml_type, std::move(shape), std::move(bytes)});
}

std::string GgufWriter::Serialize() const {
    std::string out;
    Put<uint32_t>(&out, 0x46554747);  // "GGUF"
    Put<uint32_t>(&out, version_);
    Put<uint64_t>(&out, tensors_.size());
    Put<uint64_t>(&out, kvs_.size());
    for (const std::string& kv : kvs_) out += kv;
    auto align = [&](uint64_t n) { return (n + alignment_ - 1) / alignment_ * alignment_; };
    uint64_t offset = 0;
    for (const Tensor& t : tensors_) {
        PutString(&out, t.name);
        Put<uint32_t>(&out, static_cast<uint32_t>(t.shape.size()));
        for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) {
            Put<uint64_t>(&out, static_cast<uint64_t>(*it));  // innermost first
        }
        Put<uint32_t>(&out, t.ggml_type);
        Put<uint64_t>(&out, offset);
        offset = align(offset + t.bytes.size());
    }
    out.resize(align(out.size()), '\0');
    for (const Tensor& t : tensors_) {
        out += t.bytes;
        out.resize(align(out.size()), '\0');
    }
    return out;
}

Status GgufWriter::WriteFile(const std::string& path) const {
    const std::string bytes = Serialize();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) return NotFound(path + ": cannot create");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) return Internal(path + ": write failed");
    return Status::Ok();
}

}  // namespace kvshard
