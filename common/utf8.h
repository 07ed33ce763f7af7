// UTF-8 helpers shared by the tokenizers, the streaming decoder and request validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvshard {

// Length of the UTF-8 sequence that starts with byte `lead` (1..4), or 0 if `lead` cannot start
// a sequence (a continuation byte or an invalid lead).
size_t Utf8SequenceLength(uint8_t lead);

// Length of the longest prefix of `s` that holds only complete, valid UTF-8 sequences, stopping
// before an incomplete sequence at the end. Invalid bytes in the middle count as complete (one
// byte each) so that a stream never stalls on bad data.
size_t Utf8CompletePrefix(std::string_view s);

// True when `s` is entirely valid UTF-8 (no overlongs, no surrogates, no values past U+10FFFF).
bool IsValidUtf8(std::string_view s);

// Appends the UTF-8 encoding of `cp` (REQUIRES: cp <= 0x10FFFF).
void AppendUtf8(uint32_t cp, std::string* out);

// Decodes one code point at s[*pos], advancing *pos; invalid bytes decode as U+FFFD (one byte).
uint32_t DecodeUtf8(std::string_view s, size_t* pos);

}  // namespace kvshard
