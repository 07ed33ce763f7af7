// Helpers for the tokenizer tests: loading tokenizers from the shared fixtures, hand-built
// vocabularies.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "model/tokenizer_data.h"

namespace kvshard::testing {

// The tokenizer of a GGUF file; fails the test (and returns nullptr) on any error.
inline std::unique_ptr<Tokenizer> GgufTokenizer(const std::string& path) {
    auto gguf = GgufFile::Open(path);
    EXPECT_TRUE(gguf.ok()) << gguf.status().ToString();
    if (!gguf.ok()) return nullptr;
    auto data = TokenizerDataFromGguf(**gguf);
    EXPECT_TRUE(data.ok()) << data.status().ToString();
    if (!data.ok()) return nullptr;
    auto tok = Tokenizer::Create(std::move(data).value());
    EXPECT_TRUE(tok.ok()) << tok.status().ToString();
    return tok.ok() ? std::move(tok).value() : nullptr;
}

inline std::unique_ptr<Tokenizer> CreateOrFail(TokenizerData data) {
    auto tok = Tokenizer::Create(std::move(data));
    EXPECT_TRUE(tok.ok()) << tok.status().ToString();
    return tok.ok() ? std::move(tok).value() : nullptr;
}

inline std::string JoinIds(const std::vector<int32_t>& ids) {
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i > 0) s += ' ';
        s += std::to_string(ids[i]);
    }
    return s;
}

inline EncodeOptions WithBos() {
    EncodeOptions o;
    o.add_bos = true;
    return o;
}

inline EncodeOptions ParseSpecial() {
    EncodeOptions o;
    o.parse_special = true;
    return o;
}

}  // namespace kvshard::testing
