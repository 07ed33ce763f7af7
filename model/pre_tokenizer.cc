#include "model/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/utf8.h"

namespace kvshard {

namespace {

pcre2_code* Code(void* p) { return static_cast<pcre2_code*>(p); }

struct Piece {
    std::string_view text;
    bool valid_utf8;
};

// Cuts `text` into maximal valid UTF-8 runs and single invalid bytes.
std::vector<Piece> SplitValidUtf8(std::string_view text) {
    std::vector<Piece> pieces;
    size_t run_start = 0;
    for (size_t pos = 0; pos < text.size();) {
        size_t next = pos;
        const uint32_t cp = DecodeUtf8(text, &next);
        if (cp == 0xFFFD && next == pos + 1) {
            if (pos > run_start) pieces.push_back({text.substr(run_start, pos - run_start), true});
            pieces.push_back({text.substr(pos, 1), false});
            run_start = next;
        }
        pos = next;
    }
    if (run_start < text.size()) pieces.push_back({text.substr(run_start), true});
    return pieces;
}

// Appends the matches of `code` in `subject`, and the text between them, to `out`.
void SplitWith(pcre2_code* code, pcre2_match_data* match, std::string_view subject,
               std::vector<Piece>* out) {
    const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
    size_t last = 0;  // end of what is already in `out`
    size_t offset = 0;
    while (offset < subject.size()) {
        int rc =
            pcre2_match(code, data, subject.size(), offset, PCRE2_NO_UTF_CHECK, match, nullptr);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
            rc = pcre2_match(code, data, subject.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                             match, nullptr);
        }
        if (rc < 0) break;  // no further match (or a matcher limit): the rest is one piece
        const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
        const size_t begin = ovector[0];
        const size_t end = ovector[1];
        if (end <= begin) {  // empty match: step over one character
            const size_t len = Utf8SequenceLength(static_cast<uint8_t>(subject[begin]));
            offset = begin + (len == 0 ? 1 : len);
            continue;
        }
        if (begin > last) out->push_back({subject.substr(last, begin - last), true});
        out->push_back({subject.substr(begin, end - begin), true});
        last = offset = end;
    }
    if (last < subject.size()) out->push_back({subject.substr(last), true});
}

}  // namespace

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::Create(
    const std::vector<std::string>& regexes) {
    std::unique_ptr<PreTokenizer> pre(new PreTokenizer());
    for (const std::string& regex : regexes) {
        int error = 0;
        PCRE2_SIZE error_offset = 0;
        pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(regex.data()), regex.size(),
                                         PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
        if (code == nullptr) {
            PCRE2_UCHAR message[256];
            pcre2_get_error_message(error, message, sizeof(message));
            return InvalidArgument("pre-tokenizer regex " + regex + " does not compile at offset " +
                                   std::to_string(error_offset) + ": " +
                                   reinterpret_cast<const char*>(message));
        }
        pcre2_jit_compile(code,
                          PCRE2_JIT_COMPLETE);  // optional: without JIT pcre2_match interprets
        pre->codes_.push_back(code);
    }
    return pre;
}

PreTokenizer::~PreTokenizer() {
    for (void* code : codes_) pcre2_code_free(Code(code));
}

std::vector<std::string_view> PreTokenizer::Split(std::string_view text) const {
    std::vector<Piece> pieces = SplitValidUtf8(text);
    std::vector<Piece> next;
    for (void* code : codes_) {
        pcre2_match_data* match = pcre2_match_data_create_from_pattern(Code(code), nullptr);
        KV_CHECK(match != nullptr) << "out of memory";
        next.clear();
        for (const Piece& piece : pieces) {
            if (piece.valid_utf8) {
                SplitWith(Code(code), match, piece.text, &next);
            } else {
                next.push_back(piece);
            }
        }
        pcre2_match_data_free(match);
        pieces.swap(next);
    }
    std::vector<std::string_view> out;
    out.reserve(pieces.size());
    for (const Piece& piece : pieces) out.push_back(piece.text);
    return out;
}

}  // namespace kvshard
