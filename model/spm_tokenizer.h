// SentencePiece-style BPE (Llama 2, llama2.c), encoding exactly as llama.cpp's SPM tokenizer:
// the text, with a dummy-prefix space when add_space_prefix, has its spaces replaced by "▁" and is
// split into UTF-8 characters; then the adjacent pair whose concatenation is the vocabulary piece
// with the highest score is merged (ties: leftmost) until no pair is a piece. A symbol that is not
// a piece is emitted as its bytes through the "<0xXX>" byte tokens, or as the unknown token when
// the vocabulary has none.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/tokenizer.h"
#include "model/tokenizer_util.h"

namespace kvshard {

class SpmTokenizer final : public TableTokenizer {
  public:
    // REQUIRES: data.kind == kSentencePiece and the checks of Tokenizer::Create passed.
    static Result<std::unique_ptr<Tokenizer>> Create(std::shared_ptr<const TokenizerData> data);

    std::vector<int32_t> Encode(std::string_view text, const EncodeOptions& options) const override;

  private:
    explicit SpmTokenizer(std::shared_ptr<const TokenizerData> data);

    // Appends the ids of `text`, whose spaces are already "▁".
    void EncodeEscaped(std::string_view text, std::vector<int32_t>* out) const;
    void AppendBytes(std::string_view bytes, std::vector<int32_t>* out) const;
    float Score(int32_t id) const;

    std::array<int32_t, 256> byte_ids_;  // byte -> its "<0xXX>" token, -1 if none
    SpecialTokenSplitter specials_;
};

}  // namespace kvshard
