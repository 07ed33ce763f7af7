// Regex pre-tokenization for byte-level BPE (PCRE2 with Unicode properties). Internal to model/.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard {

// Cuts text into pieces with a list of regexes applied in turn, as llama.cpp's
// unicode_regex_split does: each regex splits every piece the previous one left, and both its
// matches and the text between them become pieces, so the pieces always cover the input.
// Invalid UTF-8 bytes become one-byte pieces of their own and are not seen by the regexes.
// Thread-safety: Split may be called from any thread.
class PreTokenizer {
  public:
    // InvalidArgument naming the regex when one does not compile.
    static Result<std::unique_ptr<PreTokenizer>> Create(const std::vector<std::string>& regexes);
    ~PreTokenizer();
    PreTokenizer(const PreTokenizer&) = delete;
    PreTokenizer& operator=(const PreTokenizer&) = delete;

    // Non-empty pieces in order, as views into `text`.
    std::vector<std::string_view> Split(std::string_view text) const;

  private:
    PreTokenizer() = default;
    std::vector<void*> codes_;  // pcre2_code_8*, owned
};

}  // namespace kvshard
