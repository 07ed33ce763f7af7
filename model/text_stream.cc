// TextStream (declared in model/tokenizer.h): incremental detokenization for streaming responses.
#include <algorithm>
#include <utility>

#include "common/utf8.h"
#include "model/tokenizer.h"

namespace kvshard {

namespace {

// Complete UTF-8 text with every invalid byte replaced by U+FFFD, so that what a stream emits is
// always valid UTF-8 (JSON encoders reject anything else).
std::string Sanitize(std::string_view bytes) {
    if (IsValidUtf8(bytes)) return std::string(bytes);
    std::string out;
    for (size_t pos = 0; pos < bytes.size();) {
        const size_t start = pos;
        const uint32_t cp = DecodeUtf8(bytes, &pos);
        if (cp == 0xFFFD && pos == start + 1) {
            AppendUtf8(0xFFFD, &out);
        } else {
            out.append(bytes.substr(start, pos - start));
        }
    }
    return out;
}

// Length of the longest suffix of `text` that is a proper prefix of `stop`.
size_t PartialStopLength(std::string_view text, std::string_view stop) {
    for (size_t len = std::min(text.size(), stop.size() - 1); len > 0; --len) {
        if (text.substr(text.size() - len) == stop.substr(0, len)) return len;
    }
    return 0;
}

}  // namespace

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                       int32_t prev_token, TextStreamOptions options)
    : tokenizer_(tokenizer),
      stop_strings_(std::move(stop_strings)),
      prev_token_(prev_token),
      options_(options) {
    std::erase_if(stop_strings_, [](const std::string& s) { return s.empty(); });
}

std::string TextStream::Push(int32_t id) {
    if (stopped_) return "";
    std::string bytes = tokenizer_.TokenBytes(id);
    const TokenizerData& data = tokenizer_.data();
    if (!options_.skip_special_tokens && tokenizer_.IsControl(id)) {
        bytes = data.tokens[static_cast<size_t>(id)];
    }
    if (data.kind == TokenizerKind::kSentencePiece && data.add_space_prefix && prev_token_ >= 0 &&
        prev_token_ == data.bos_id && !bytes.empty() && bytes[0] == ' ') {
        bytes.erase(0, 1);
    }
    prev_token_ = id;

    pending_bytes_ += bytes;
    const size_t complete = Utf8CompletePrefix(pending_bytes_);
    held_text_ += Sanitize(std::string_view(pending_bytes_).substr(0, complete));
    pending_bytes_.erase(0, complete);

    // The earliest stop string wins; among those starting at the same place, the longest.
    size_t stop_at = std::string::npos;
    for (const std::string& stop : stop_strings_) {
        const size_t pos = held_text_.find(stop);
        if (pos == std::string::npos) continue;
        if (pos < stop_at || (pos == stop_at && stop.size() > matched_stop_.size())) {
            stop_at = pos;
            matched_stop_ = stop;
        }
    }
    if (stop_at != std::string::npos) {
        stopped_ = true;
        std::string out =
            held_text_.substr(0, options_.include_stop ? stop_at + matched_stop_.size() : stop_at);
        held_text_.clear();
        pending_bytes_.clear();
        return out;
    }

    size_t hold = 0;
    for (const std::string& stop : stop_strings_) {
        hold = std::max(hold, PartialStopLength(held_text_, stop));
    }
    std::string out = held_text_.substr(0, held_text_.size() - hold);
    held_text_.erase(0, held_text_.size() - hold);
    return out;
}

std::string TextStream::Finish() {
    if (stopped_) return "";
    std::string out = std::move(held_text_);
    held_text_.clear();
    if (!pending_bytes_.empty()) {
        // Only an incomplete sequence can be left here: one replacement character for it.
        AppendUtf8(0xFFFD, &out);
        pending_bytes_.clear();
    }
    return out;
}

}  // namespace kvshard
