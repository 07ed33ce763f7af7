// Tokenizer: text <-> token ids for SentencePiece-style BPE and byte-level BPE vocabularies.
// Thread-safety: const methods may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/tokenizer_data.h"

namespace kvshard {

class SpecialTokenSplitter;

struct EncodeOptions {
    bool add_bos = false;        // prepend BOS (callers pass the model's own add_bos by default)
    bool parse_special = false;  // turn control/user-defined token text ("<|im_start|>") into ids
};

// A piece of text to encode. Special-token text inside a `literal` piece is plain text whatever
// parse_special says: chat message content, where a user must not be able to write a control
// token (and so a turn of another role).
struct TextPiece {
    std::string text;
    bool literal = false;
};

class Tokenizer {
  public:
    // Validates `data` (ids in range, merges reference known tokens, a pre-tokenizer kvshard
    // knows) and builds the lookup tables.
    static Result<std::unique_ptr<Tokenizer>> Create(TokenizerData data);
    // The same over data shared with its other holders (ModelFile::shared_tokenizer_data), so a
    // process keeps one copy of the vocabulary and merges (~3.4 MB for a 49k vocabulary).
    static Result<std::unique_ptr<Tokenizer>> Create(std::shared_ptr<const TokenizerData> data);
    virtual ~Tokenizer() = default;

    // Text without special-token parsing is encoded exactly as llama.cpp does (its test vectors
    // pass): SentencePiece with the dummy prefix when add_space_prefix, byte fallback; byte-level
    // BPE after the pre-tokenizer regex.
    virtual std::vector<int32_t> Encode(std::string_view text,
                                        const EncodeOptions& options) const = 0;
    // The raw bytes token `id` stands for in decoded text: "▁" becomes a space, byte tokens
    // "<0x41>" become the byte, byte-level symbols map back to bytes; control tokens give "".
    // The result may be an incomplete UTF-8 sequence.
    virtual std::string TokenBytes(int32_t id) const = 0;
    // Encodes the concatenation of `pieces`. With parse_special, special-token text becomes its
    // token only where it lies wholly inside a run of non-literal pieces; the text between two
    // special tokens is encoded as one run across piece boundaries, so when the literal pieces
    // hold no special-token text the ids are exactly those of Encode(concatenation).
    std::vector<int32_t> EncodePieces(const std::vector<TextPiece>& pieces,
                                      const EncodeOptions& options) const;
    // Decodes a whole sequence. SentencePiece: a leading space right after BOS is dropped.
    std::string Decode(const std::vector<int32_t>& ids) const;

    const TokenizerData& data() const { return data_; }
    int64_t vocab_size() const { return static_cast<int64_t>(data_.tokens.size()); }
    int32_t bos_id() const { return data_.bos_id; }
    int32_t eos_id() const { return data_.eos_id; }
    bool IsControl(int32_t id) const;
    // Looks up a token by its exact piece text (e.g. "<|im_end|>"); -1 if none.
    virtual int32_t PieceToId(std::string_view piece) const = 0;

  protected:
    explicit Tokenizer(std::shared_ptr<const TokenizerData> data);
    std::shared_ptr<const TokenizerData> shared_data_;  // never null
    const TokenizerData& data_;                         // *shared_data_

  private:
    std::shared_ptr<const SpecialTokenSplitter> piece_splitter_;  // for EncodePieces
};

// Incremental, UTF-8-safe detokenization with stop strings. Feed generated ids one at a time;
// each call returns the text that is now final: complete UTF-8 characters only, and never text
// that might still turn out to be the start of a stop string.
struct TextStreamOptions {
    // A matched stop string ends the text after it rather than before (vLLM's
    // include_stop_str_in_output).
    bool include_stop = false;
    // Control tokens (<|im_end|>, ...) add no text; false: their piece text, as vLLM's
    // skip_special_tokens=false.
    bool skip_special_tokens = true;
};

class TextStream {
  public:
    // `prev_token` is the last prompt token (so a SentencePiece leading space after BOS is
    // dropped as llama.cpp and llama2.c do); -1 if none.
    TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
               int32_t prev_token = -1, TextStreamOptions options = {});

    // Returns the newly final text. After a stop string matched, stopped() is true and the
    // returned text ends right before the stop string (after it with options.include_stop).
    std::string Push(int32_t id);
    // Flushes what is held back at the end of generation (an incomplete UTF-8 tail becomes
    // U+FFFD). Not used after a stop.
    std::string Finish();
    bool stopped() const { return stopped_; }
    const std::string& matched_stop() const { return matched_stop_; }

  private:
    const Tokenizer& tokenizer_;
    std::vector<std::string> stop_strings_;
    int32_t prev_token_;
    TextStreamOptions options_;
    std::string pending_bytes_;  // bytes not yet forming complete characters
    std::string held_text_;      // complete text held back as a possible stop-string prefix
    bool stopped_ = false;
    std::string matched_stop_;
};

}  // namespace kvshard
