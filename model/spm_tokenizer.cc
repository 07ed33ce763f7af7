#include "model/spm_tokenizer.h"

#include <cstdio>
#include <queue>
#include <utility>

namespace kvshard {

namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's "▁"

// Length of the UTF-8 character starting with `lead`, judged by the lead byte alone as llama.cpp
// does (continuation and invalid bytes count as one-byte characters).
size_t CharLength(uint8_t lead) {
    if (lead < 0xC0) return 1;
    if (lead < 0xE0) return 2;
    if (lead < 0xF0) return 3;
    return 4;
}

// 0..255 for a "<0xXX>" piece, -1 otherwise.
int ParseByteToken(std::string_view piece) {
    if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
    int value = 0;
    for (char c : piece.substr(3, 2)) {
        value <<= 4;
        if (c >= '0' && c <= '9') {
            value |= c - '0';
        } else if (c >= 'A' && c <= 'F') {
            value |= c - 'A' + 10;
        } else if (c >= 'a' && c <= 'f') {
            value |= c - 'a' + 10;
        } else {
            return -1;
        }
    }
    return value;
}

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
    std::string out;
    out.reserve(s.size());
    for (size_t pos = 0;;) {
        size_t hit = s.find(from, pos);
        if (hit == std::string_view::npos) {
            out.append(s.substr(pos));
            return out;
        }
        out.append(s.substr(pos, hit - pos));
        out.append(to);
        pos = hit + from.size();
    }
}

struct Symbol {
    int32_t prev;
    int32_t next;
    size_t start;  // into the escaped text
    size_t size;   // 0 once merged into its left neighbour
};

struct Bigram {
    float score;
    int32_t left;
    int32_t right;
    size_t size;  // bytes of the merged piece; a mismatch marks a stale entry
};

// Max-heap order: highest score first, then leftmost.
struct BigramLess {
    bool operator()(const Bigram& a, const Bigram& b) const {
        return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
};

}  // namespace

SpmTokenizer::SpmTokenizer(std::shared_ptr<const TokenizerData> data)
    : TableTokenizer(std::move(data)), specials_(data_) {
    byte_ids_.fill(-1);
    for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        auto it = piece_to_id_.find(std::string_view(name));
        if (it == piece_to_id_.end()) {
            // llama.cpp's fallback: a piece that is the byte itself.
            it = piece_to_id_.find(std::string_view(std::string(1, static_cast<char>(b))));
        }
        if (it != piece_to_id_.end()) byte_ids_[static_cast<size_t>(b)] = it->second;
    }
    token_bytes_.resize(data_.tokens.size());
    for (size_t i = 0; i < data_.tokens.size(); ++i) {
        const std::string& piece = data_.tokens[i];
        switch (TypeOf(data_, static_cast<int32_t>(i))) {
            case TokenType::kNormal:
                token_bytes_[i] = ReplaceAll(piece, kSpace, " ");
                break;
            case TokenType::kByte: {
                const int b = ParseByteToken(piece);
                token_bytes_[i] = b >= 0 ? std::string(1, static_cast<char>(b)) : piece;
                break;
            }
            case TokenType::kUserDefined:
                token_bytes_[i] = piece;
                break;
            case TokenType::kUndefined:
            case TokenType::kUnknown:
            case TokenType::kControl:
            case TokenType::kUnused:
                break;
        }
    }
}

Result<std::unique_ptr<Tokenizer>> SpmTokenizer::Create(std::shared_ptr<const TokenizerData> data) {
    return std::unique_ptr<Tokenizer>(new SpmTokenizer(std::move(data)));
}

float SpmTokenizer::Score(int32_t id) const {
    return data_.scores.empty() ? 0.0f : data_.scores[static_cast<size_t>(id)];
}

std::vector<int32_t> SpmTokenizer::Encode(std::string_view text,
                                          const EncodeOptions& options) const {
    std::vector<int32_t> out;
    if (options.add_bos && data_.bos_id >= 0) out.push_back(data_.bos_id);
    // As llama.cpp: the dummy prefix goes before the first raw fragment and before every raw
    // fragment that follows a special token.
    bool prev_special = true;
    for (const TextFragment& fragment : specials_.Split(text, options.parse_special)) {
        if (fragment.token >= 0) {
            out.push_back(fragment.token);
            prev_special = true;
            continue;
        }
        std::string escaped;
        if (data_.add_space_prefix && prev_special) escaped = kSpace;
        escaped += ReplaceAll(fragment.text, " ", kSpace);
        EncodeEscaped(escaped, &out);
        prev_special = false;
    }
    return out;
}

void SpmTokenizer::EncodeEscaped(std::string_view text, std::vector<int32_t>* out) const {
    std::vector<Symbol> symbols;
    for (size_t pos = 0; pos < text.size();) {
        const size_t len = std::min(CharLength(static_cast<uint8_t>(text[pos])), text.size() - pos);
        const auto index = static_cast<int32_t>(symbols.size());
        symbols.push_back({index - 1, pos + len == text.size() ? -1 : index + 1, pos, len});
        pos += len;
    }

    std::priority_queue<Bigram, std::vector<Bigram>, BigramLess> queue;
    auto try_add = [&](int32_t left, int32_t right) {
        if (left < 0 || right < 0) return;
        const size_t size = symbols[left].size + symbols[right].size;
        auto it = piece_to_id_.find(text.substr(symbols[left].start, size));
        if (it == piece_to_id_.end()) return;
        queue.push({Score(it->second), left, right, size});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add(i - 1, i);

    while (!queue.empty()) {
        const Bigram bigram = queue.top();
        queue.pop();
        Symbol& left = symbols[bigram.left];
        Symbol& right = symbols[bigram.right];
        if (left.size == 0 || right.size == 0 || left.size + right.size != bigram.size) {
            continue;  // one side was merged away since this pair was queued
        }
        left.size += right.size;
        right.size = 0;
        left.next = right.next;
        if (right.next >= 0) symbols[right.next].prev = bigram.left;
        try_add(left.prev, bigram.left);
        try_add(bigram.left, left.next);
    }

    for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) {
        const std::string_view piece = text.substr(symbols[i].start, symbols[i].size);
        auto it = piece_to_id_.find(piece);
        if (it != piece_to_id_.end()) {
            out->push_back(it->second);
        } else {
            AppendBytes(piece, out);
        }
    }
}

void SpmTokenizer::AppendBytes(std::string_view bytes, std::vector<int32_t>* out) const {
    bool all_bytes = true;
    for (char c : bytes) all_bytes = all_bytes && byte_ids_[static_cast<uint8_t>(c)] >= 0;
    if (!all_bytes) {
        // No byte fallback: one unknown token stands for the character, as SentencePiece emits.
        if (data_.unk_id >= 0) out->push_back(data_.unk_id);
        return;
    }
    for (char c : bytes) out->push_back(byte_ids_[static_cast<uint8_t>(c)]);
}

}  // namespace kvshard
