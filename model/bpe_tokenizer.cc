#include "model/bpe_tokenizer.h"

#include <queue>
#include <utility>

#include "common/utf8.h"
#include "model/pre_tokenizer.h"

namespace kvshard {

namespace {

// GPT-2's printable bytes map to the character of the same value; the other 68 bytes map, in
// increasing order, to U+0100, U+0101, ...
bool IsPrintableByte(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

constexpr uint32_t kShiftedBase = 256;
constexpr uint32_t kNumShifted = 68;

// Code point -> byte for the 256 characters of the table; -1 for any other code point.
const std::array<int16_t, kShiftedBase + kNumShifted>& ByteLevelDecodeTable() {
    static const auto table = [] {
        std::array<int16_t, kShiftedBase + kNumShifted> t;
        t.fill(-1);
        uint32_t n = 0;
        for (int b = 0; b < 256; ++b) {
            t[IsPrintableByte(b) ? static_cast<uint32_t>(b) : kShiftedBase + n++] =
                static_cast<int16_t>(b);
        }
        return t;
    }();
    return table;
}

const std::string kGpt2Regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
// Llama 3's regex with llama.cpp's explicit case classes instead of (?i:...), which under Unicode
// case folding would also match e.g. "'ſ".
const std::string kLlama3Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct Symbol {
    int32_t prev;
    int32_t next;
    size_t start;  // into the byte-level text
    size_t size;   // 0 once merged into its left neighbour
    int32_t id;    // -1 when the text is not a vocabulary piece
};

struct Bigram {
    int32_t rank;
    int32_t left;
    int32_t right;
    int32_t left_id;  // ids when queued; a change marks a stale entry
    int32_t right_id;
};

// Max-heap order: lowest rank first, then leftmost.
struct BigramLess {
    bool operator()(const Bigram& a, const Bigram& b) const {
        return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
};

}  // namespace

const std::array<std::string, 256>& ByteLevelEncodeTable() {
    static const auto table = [] {
        std::array<std::string, 256> t;
        uint32_t n = 0;
        for (int b = 0; b < 256; ++b) {
            AppendUtf8(IsPrintableByte(b) ? static_cast<uint32_t>(b) : kShiftedBase + n++, &t[b]);
        }
        return t;
    }();
    return table;
}

std::string ByteLevelDecode(std::string_view piece) {
    const auto& table = ByteLevelDecodeTable();
    std::string out;
    out.reserve(piece.size());
    for (size_t pos = 0; pos < piece.size();) {
        const size_t start = pos;
        const uint32_t cp = DecodeUtf8(piece, &pos);
        if (cp < table.size() && table[cp] >= 0 && !(cp == 0xFFFD && pos == start + 1)) {
            out.push_back(static_cast<char>(table[cp]));
        } else {
            out.append(piece.substr(start, pos - start));
        }
    }
    return out;
}

std::vector<std::string> PreTokenizerRegexes(std::string_view pre) {
    if (pre == "gpt-2") return {kGpt2Regex};
    if (pre == "smollm") return {"\\p{N}", kGpt2Regex};
    if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") return {kLlama3Regex};
    return {};
}

BpeTokenizer::BpeTokenizer(std::shared_ptr<const TokenizerData> data)
    : TableTokenizer(std::move(data)), specials_(data_) {
    token_bytes_.resize(data_.tokens.size());
    for (size_t i = 0; i < data_.tokens.size(); ++i) {
        switch (TypeOf(data_, static_cast<int32_t>(i))) {
            case TokenType::kNormal:
                token_bytes_[i] = ByteLevelDecode(data_.tokens[i]);
                break;
            case TokenType::kUserDefined:
                token_bytes_[i] = data_.tokens[i];
                break;
            case TokenType::kUndefined:
            case TokenType::kUnknown:
            case TokenType::kControl:
            case TokenType::kUnused:
            case TokenType::kByte:
                break;
        }
    }
}

BpeTokenizer::~BpeTokenizer() = default;

Result<std::unique_ptr<Tokenizer>> BpeTokenizer::Create(std::shared_ptr<const TokenizerData> data) {
    const std::vector<std::string> regexes = PreTokenizerRegexes(data->pre);
    if (regexes.empty()) {
        return Unimplemented(data->source + ": byte-level BPE pre-tokenizer \"" + data->pre +
                             "\" is not supported (kvshard knows gpt-2, smollm, llama-bpe)");
    }
    std::unique_ptr<BpeTokenizer> tok(new BpeTokenizer(std::move(data)));
    const TokenizerData& d = tok->data_;
    KV_ASSIGN_OR_RETURN(tok->pre_tokenizer_, PreTokenizer::Create(regexes));
    tok->ignore_merges_ = d.pre != "gpt-2" && d.pre != "smollm";

    tok->merges_.reserve(d.merges.size());
    for (size_t rank = 0; rank < d.merges.size(); ++rank) {
        const std::string& merge = d.merges[rank];
        // As llama.cpp: the separator is the first space after the first character.
        const size_t space = merge.size() > 1 ? merge.find(' ', 1) : std::string::npos;
        auto bad = [&](const std::string& why) {
            return InvalidArgument(d.source + ": merge " + std::to_string(rank) + " \"" + merge +
                                   "\" " + why);
        };
        if (space == std::string::npos) return bad("is not \"left right\"");
        const std::string_view left = std::string_view(merge).substr(0, space);
        const std::string_view right = std::string_view(merge).substr(space + 1);
        const int32_t left_id = tok->PieceToId(left);
        const int32_t right_id = tok->PieceToId(right);
        if (left_id < 0) return bad("names unknown token \"" + std::string(left) + "\"");
        if (right_id < 0) return bad("names unknown token \"" + std::string(right) + "\"");
        const int32_t result = tok->PieceToId(std::string(left) + std::string(right));
        // The first occurrence of a pair keeps its rank, as in llama.cpp.
        tok->merges_.emplace(PairKey(left_id, right_id), Merge{static_cast<int32_t>(rank), result});
    }
    return std::unique_ptr<Tokenizer>(std::move(tok));
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view text,
                                          const EncodeOptions& options) const {
    std::vector<int32_t> out;
    if (options.add_bos && data_.bos_id >= 0) out.push_back(data_.bos_id);
    for (const TextFragment& fragment : specials_.Split(text, options.parse_special)) {
        if (fragment.token >= 0) {
            out.push_back(fragment.token);
            continue;
        }
        for (std::string_view word : pre_tokenizer_->Split(fragment.text)) EncodeWord(word, &out);
    }
    return out;
}

void BpeTokenizer::EncodeWord(std::string_view word, std::vector<int32_t>* out) const {
    const auto& encode = ByteLevelEncodeTable();
    std::string text;
    text.reserve(word.size() * 2);
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    for (char c : word) {
        const std::string& ch = encode[static_cast<uint8_t>(c)];
        const auto index = static_cast<int32_t>(symbols.size());
        symbols.push_back({index - 1, index + 1, text.size(), ch.size(), PieceToId(ch)});
        text += ch;
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    if (ignore_merges_) {
        const int32_t id = PieceToId(text);
        if (id >= 0) {
            out->push_back(id);
            return;
        }
    }

    std::priority_queue<Bigram, std::vector<Bigram>, BigramLess> queue;
    auto try_add = [&](int32_t left, int32_t right) {
        if (left < 0 || right < 0 || symbols[left].id < 0 || symbols[right].id < 0) return;
        auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
        if (it == merges_.end()) return;
        queue.push({it->second.rank, left, right, symbols[left].id, symbols[right].id});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add(i - 1, i);

    while (!queue.empty()) {
        const Bigram bigram = queue.top();
        queue.pop();
        Symbol& left = symbols[bigram.left];
        Symbol& right = symbols[bigram.right];
        if (left.size == 0 || right.size == 0 || left.next != bigram.right ||
            left.id != bigram.left_id || right.id != bigram.right_id) {
            continue;  // a side changed since this pair was queued
        }
        left.id = merges_.at(PairKey(left.id, right.id)).result;
        left.size += right.size;
        right.size = 0;
        left.next = right.next;
        if (right.next >= 0) symbols[right.next].prev = bigram.left;
        try_add(left.prev, bigram.left);
        try_add(bigram.left, left.next);
    }

    for (int32_t i = 0; i >= 0; i = symbols[i].next) {
        if (symbols[i].id >= 0) {
            out->push_back(symbols[i].id);
            continue;
        }
        // Not a vocabulary piece: llama.cpp emits the single-byte pieces of its text it finds.
        for (char c : std::string_view(text).substr(symbols[i].start, symbols[i].size)) {
            const int32_t id = PieceToId(std::string_view(&c, 1));
            if (id >= 0) out->push_back(id);
        }
    }
}

}  // namespace kvshard
