// Pieces shared by the SentencePiece and byte-level BPE tokenizers: a piece -> id map with
// string_view lookup, the split of text on special-token pieces, and the token type of an id.
// Internal to model/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer.h"
#include "model/tokenizer_data.h"

namespace kvshard {

struct PieceHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};

// Piece text -> id. When a piece occurs twice in a vocabulary the later id wins, as in llama.cpp.
using PieceMap = std::unordered_map<std::string, int32_t, PieceHash, std::equal_to<>>;

PieceMap BuildPieceMap(const std::vector<std::string>& tokens);

// The lookup tables every tokenizer kind keeps: piece -> id, and the decoded bytes of each id
// (token_bytes_, filled by the subclass's constructor: the decoding differs by kind).
class TableTokenizer : public Tokenizer {
  public:
    std::string TokenBytes(int32_t id) const final;
    int32_t PieceToId(std::string_view piece) const final;

  protected:
    explicit TableTokenizer(std::shared_ptr<const TokenizerData> data);

    PieceMap piece_to_id_;
    std::vector<std::string> token_bytes_;  // TokenBytes of every id
};

// The type of token `id` (kNormal when `data.types` is empty). REQUIRES: id in range.
inline TokenType TypeOf(const TokenizerData& data, int32_t id) {
    return data.types.empty() ? TokenType::kNormal : data.types[static_cast<size_t>(id)];
}

// A piece of the input text: either raw text to run through the tokenizer model, or a special
// token found verbatim in the text.
struct TextFragment {
    std::string_view text;
    int32_t token = -1;  // >= 0: `text` is the piece of this special token
};

// Splits text on the pieces of special tokens, as llama.cpp's tokenizer_st_partition does:
// tokens are tried longest piece first, and each one splits every raw fragment left so far at
// all of its occurrences. User-defined tokens are always split out (Hugging Face and llama.cpp
// both do); control and unknown tokens only when `parse_special`.
class SpecialTokenSplitter {
  public:
    explicit SpecialTokenSplitter(const TokenizerData& data);

    // Fragments in text order; raw fragments are never empty. Views point into `text`.
    std::vector<TextFragment> Split(std::string_view text, bool parse_special) const;

  private:
    struct Special {
        std::string piece;
        int32_t id;
        bool always;  // user-defined: split even without parse_special
    };
    std::vector<Special> specials_;  // longest piece first
};

}  // namespace kvshard
