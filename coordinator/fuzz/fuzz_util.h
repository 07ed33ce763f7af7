// Shared by the HTTP front end's fuzzers: a small byte-level tokenizer (ids 0-255 are bytes;
// <|im_start|> 256 and <|im_end|> 257 are control tokens) and a check that aborts with a message.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "model/bpe_tokenizer.h"
#include "model/tokenizer.h"

namespace kvshard::fuzz {

#define KVSHARD_FUZZ_CHECK(cond)                                                          \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            std::abort();                                                                 \
        }                                                                                 \
    } while (0)

inline std::unique_ptr<Tokenizer> ByteTokenizer() {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    d.tokens.push_back("<|im_start|>");
    d.tokens.push_back("<|im_end|>");
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.types[256] = TokenType::kControl;
    d.types[257] = TokenType::kControl;
    d.eos_id = 257;
    auto tok = Tokenizer::Create(std::move(d));
    KVSHARD_FUZZ_CHECK(tok.ok());
    return std::move(tok).value();
}

}  // namespace kvshard::fuzz
