// TokenizerData: everything needed to build a Tokenizer, independent of where it was read from
// (GGUF metadata, Hugging Face tokenizer.json, llama2.c tokenizer.bin).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvshard {

class GgufFile;

enum class TokenizerKind {
    kSentencePiece,  // SentencePiece-style BPE over pieces with scores, byte fallback (Llama 2)
    kByteLevelBpe,   // GPT-2 style byte-level BPE with ranked merges and a pre-tokenizer regex
};

// GGUF's token type numbering.
enum class TokenType : int32_t {
    kUndefined = 0,
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6,
};

struct TokenizerData {
    TokenizerKind kind = TokenizerKind::kSentencePiece;
    std::vector<std::string> tokens;  // pieces as stored (SentencePiece "▁", byte-level unicode)
    std::vector<float> scores;        // SentencePiece merge scores (empty for byte-level BPE)
    std::vector<TokenType> types;     // empty means all kNormal
    std::vector<std::string> merges;  // byte-level BPE: "left right", highest priority first
    // Pre-tokenizer of byte-level BPE, named as llama.cpp's tokenizer.ggml.pre does:
    // "gpt-2" (default), "smollm" (digits split one by one, then GPT-2), "llama-bpe" (Llama 3).
    std::string pre = "gpt-2";
    int32_t bos_id = -1;
    int32_t eos_id = -1;
    int32_t unk_id = -1;
    int32_t pad_id = -1;
    bool add_bos = false;           // prepend BOS when encoding a prompt
    bool add_space_prefix = false;  // SentencePiece dummy prefix: a space before the text
    std::string chat_template;
    std::string source;  // the file it was read from, for error messages
};

// Reads tokenizer.ggml.* keys. Errors name the file and key.
Result<TokenizerData> TokenizerDataFromGguf(const GgufFile& gguf);
// Reads a Hugging Face tokenizer.json (model.type "BPE"; byte-level when its pre-tokenizer or
// decoder is ByteLevel, SentencePiece-style when it has byte_fallback and the ▁ metaspace) and,
// when present beside it, tokenizer_config.json (bos/eos, add_bos_token, chat_template).
Result<TokenizerData> ReadTokenizerJson(const std::string& path);
// Reads llama2.c's tokenizer.bin: int32 max_token_length, then per token {f32 score, i32 len,
// bytes}. `vocab_size` comes from the checkpoint header. BOS=1, EOS=2, dummy prefix on.
Result<TokenizerData> ReadLlama2cTokenizer(const std::string& path, int64_t vocab_size);
// Writes `data` as a Hugging Face tokenizer.json (and returns the text) so that
// ReadTokenizerJson(WriteTokenizerJson(d)) round-trips; used by `kvshard convert`.
std::string TokenizerJsonText(const TokenizerData& data);
// The tokenizer_config.json that goes beside it: bos/eos/unk/pad tokens, add_bos_token and
// chat_template, which tokenizer.json has no place for. With both files in one folder,
// ReadTokenizerJson gives back `data` for byte-level BPE (all but `source`; token types other
// than normal, control, user-defined and unknown read back as normal). For SentencePiece the
// scores are written as merges and read back as negative merge ranks: the same encodings, not
// the same numbers.
std::string TokenizerConfigJsonText(const TokenizerData& data);

}  // namespace kvshard
