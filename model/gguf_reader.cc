// GGUF values (model/gguf_reader.h): scalars widened to int64 or double, strings, and arrays
// (nested ones walked but not kept), every count checked against the bytes left before anything is
// allocated for it.
#include "model/gguf_reader.h"

#include <limits>
#include <type_traits>
#include <utility>

namespace kvshard::internal {
namespace {

constexpr int kMaxArrayNesting = 8;
// A limit far above any real model (the largest vocabularies have ~256K tokens) that keeps a
// corrupted count from allocating gigabytes before the bytes run out.
constexpr uint64_t kMaxArrayElements = 1u << 24;

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

// Reads one T and widens it to int64 (which holds every integer type's values but uint64's).
template <typename T>
Status ReadWidened(GgufCursor& c, const std::string& what, int64_t* out) {
    T v = 0;
    KV_RETURN_IF_ERROR(c.Read(&v, what));
    *out = v;
    return Status::Ok();
}

// Reads one scalar of an integer GGUF type, widened to int64.
Status ReadInt(GgufCursor& c, GgufValueType type, const std::string& what, int64_t* out) {
    switch (type) {
        case kU8:
            return ReadWidened<uint8_t>(c, what, out);
        case kI8:
            return ReadWidened<int8_t>(c, what, out);
        case kU16:
            return ReadWidened<uint16_t>(c, what, out);
        case kI16:
            return ReadWidened<int16_t>(c, what, out);
        case kU32:
            return ReadWidened<uint32_t>(c, what, out);
        case kI32:
            return ReadWidened<int32_t>(c, what, out);
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
        case kI64:
            return ReadWidened<int64_t>(c, what, out);
        default:
            return c.Error(what + ": type " + std::to_string(static_cast<uint32_t>(type)) +
                           " is not an integer type");
    }
}

bool IsIntType(GgufValueType t) {
    return t == kU8 || t == kI8 || t == kU16 || t == kI16 || t == kU32 || t == kI32 || t == kU64 ||
           t == kI64;
}

Status ReadFloat(GgufCursor& c, GgufValueType type, const std::string& what, double* out) {
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

Status ReadBool(GgufCursor& c, const std::string& what, bool* out) {
    uint8_t v = 0;
    KV_RETURN_IF_ERROR(c.Read(&v, what));
    if (v > 1) return c.Error(what + ": bool value " + std::to_string(v));
    *out = v != 0;
    return Status::Ok();
}

// Reads the elements of an array value. Arrays of arrays are walked (to stay in bounds) but not
// kept: `*kept` is false then.
Status ReadArray(GgufCursor& c, const std::string& what, int depth, GgufValue::Array* out,
                 bool* kept) {
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

}  // namespace

Status ReadGgufValue(GgufCursor& c, GgufValueType type, const std::string& what, GgufValue* out,
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

std::string PrintableGgufName(std::string_view name) {
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

std::string QuoteGgufKey(std::string_view key) { return "key '" + PrintableGgufName(key) + "'"; }

}  // namespace kvshard::internal
