// Byte-level BPE (GPT-2, SmolLM2, Llama 3), encoding exactly as llama.cpp does: the text is cut
// into pieces by the pre-tokenizer regexes of data.pre (PCRE2, Unicode properties), each piece's
// bytes are mapped to printable characters by GPT-2's bytes_to_unicode table, and adjacent
// symbols are merged by merge rank (lowest first, ties leftmost) until no merge applies.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/tokenizer.h"
#include "model/tokenizer_util.h"

namespace kvshard {

class PreTokenizer;

// GPT-2's bytes_to_unicode: byte b -> the UTF-8 of the character that stands for it.
const std::array<std::string, 256>& ByteLevelEncodeTable();
// The inverse: a byte-level piece back to raw bytes. Characters outside the table are kept as
// their UTF-8 bytes.
std::string ByteLevelDecode(std::string_view piece);
// The regexes llama.cpp applies, in order, for pre-tokenizer `pre`; empty if kvshard does not
// know it. Accepts llama.cpp's names ("gpt-2", "smollm", "llama-bpe", and aliases that share a
// regex with them).
std::vector<std::string> PreTokenizerRegexes(std::string_view pre);

class BpeTokenizer final : public TableTokenizer {
  public:
    // REQUIRES: data.kind == kByteLevelBpe and the checks of Tokenizer::Create passed.
    // Unimplemented for an unknown pre-tokenizer; InvalidArgument for a malformed merge.
    static Result<std::unique_ptr<Tokenizer>> Create(std::shared_ptr<const TokenizerData> data);
    ~BpeTokenizer() override;

    std::vector<int32_t> Encode(std::string_view text, const EncodeOptions& options) const override;

  private:
    explicit BpeTokenizer(std::shared_ptr<const TokenizerData> data);

    // Appends the ids of one pre-tokenized piece (raw bytes).
    void EncodeWord(std::string_view word, std::vector<int32_t>* out) const;

    struct Merge {
        int32_t rank;
        int32_t result;  // id of the merged piece, -1 if it is not in the vocabulary
    };
    static uint64_t PairKey(int32_t left, int32_t right) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
               static_cast<uint32_t>(right);
    }

    std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> merge
    std::unique_ptr<PreTokenizer> pre_tokenizer_;
    bool ignore_merges_ = false;  // Llama 3: a piece that is a whole token is not merged
    SpecialTokenSplitter specials_;
};

}  // namespace kvshard
