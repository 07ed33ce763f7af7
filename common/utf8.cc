#include "common/utf8.h"

namespace kvshard {

size_t Utf8SequenceLength(uint8_t lead) {
    if (lead < 0x80) return 1;
    if (lead >= 0xC2 && lead <= 0xDF) return 2;
    if (lead >= 0xE0 && lead <= 0xEF) return 3;
    if (lead >= 0xF0 && lead <= 0xF4) return 4;
    return 0;
}

namespace {

// Length of a valid sequence at s[pos], 0 if invalid, SIZE_MAX if valid so far but cut short.
size_t ValidSequenceAt(std::string_view s, size_t pos) {
    const auto b0 = static_cast<uint8_t>(s[pos]);
    size_t n = Utf8SequenceLength(b0);
    if (n == 0) return 0;
    for (size_t i = 1; i < n; ++i) {
        if (pos + i >= s.size()) return SIZE_MAX;
        const auto b = static_cast<uint8_t>(s[pos + i]);
        uint8_t lo = 0x80, hi = 0xBF;
        if (i == 1) {
            if (b0 == 0xE0) lo = 0xA0;  // overlong
            if (b0 == 0xED) hi = 0x9F;  // surrogates
            if (b0 == 0xF0) lo = 0x90;  // overlong
            if (b0 == 0xF4) hi = 0x8F;  // > U+10FFFF
        }
        if (b < lo || b > hi) return 0;
    }
    return n;
}

}  // namespace

size_t Utf8CompletePrefix(std::string_view s) {
    size_t pos = 0;
    while (pos < s.size()) {
        size_t n = ValidSequenceAt(s, pos);
        if (n == SIZE_MAX) return pos;
        pos += (n == 0) ? 1 : n;
    }
    return pos;
}

bool IsValidUtf8(std::string_view s) {
    size_t pos = 0;
    while (pos < s.size()) {
        size_t n = ValidSequenceAt(s, pos);
        if (n == 0 || n == SIZE_MAX) return false;
        pos += n;
    }
    return true;
}

void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
        out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
        out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
        out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
        out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
        out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
        out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
        out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
        out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
}

uint32_t DecodeUtf8(std::string_view s, size_t* pos) {
    size_t n = ValidSequenceAt(s, *pos);
    if (n == 0 || n == SIZE_MAX) {
        *pos += 1;
        return 0xFFFD;
    }
    const auto b0 = static_cast<uint8_t>(s[*pos]);
    uint32_t cp = (n == 1) ? b0 : (b0 & (0x7F >> n));
    for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (static_cast<uint8_t>(s[*pos + i]) & 0x3F);
    *pos += n;
    return cp;
}

}  // namespace kvshard
