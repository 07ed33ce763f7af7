#include "model/tokenizer.h"

#include <algorithm>
#include <utility>

#include "common/check.h"
#include "model/bpe_tokenizer.h"
#include "model/spm_tokenizer.h"
#include "model/tokenizer_util.h"

namespace kvshard {

namespace {

Status CheckId(const TokenizerData& data, int32_t id, const char* what) {
    if (id < -1 || id >= static_cast<int64_t>(data.tokens.size())) {
        return InvalidArgument(data.source + ": " + what + " id " + std::to_string(id) +
                               " is outside the vocabulary of " +
                               std::to_string(data.tokens.size()) + " tokens");
    }
    return Status::Ok();
}

Status Validate(const TokenizerData& data) {
    const size_t n = data.tokens.size();
    if (n == 0) return InvalidArgument(data.source + ": the tokenizer has no tokens");
    if (n > static_cast<size_t>(INT32_MAX)) {
        return InvalidArgument(data.source + ": too many tokens: " + std::to_string(n));
    }
    if (!data.scores.empty() && data.scores.size() != n) {
        return InvalidArgument(data.source + ": " + std::to_string(data.scores.size()) +
                               " scores for " + std::to_string(n) + " tokens");
    }
    if (!data.types.empty() && data.types.size() != n) {
        return InvalidArgument(data.source + ": " + std::to_string(data.types.size()) +
                               " token types for " + std::to_string(n) + " tokens");
    }
    for (size_t i = 0; i < data.types.size(); ++i) {
        const auto t = static_cast<int32_t>(data.types[i]);
        if (t < 0 || t > static_cast<int32_t>(TokenType::kByte)) {
            return InvalidArgument(data.source + ": token " + std::to_string(i) +
                                   " has unknown type " + std::to_string(t));
        }
    }
    KV_RETURN_IF_ERROR(CheckId(data, data.bos_id, "BOS"));
    KV_RETURN_IF_ERROR(CheckId(data, data.eos_id, "EOS"));
    KV_RETURN_IF_ERROR(CheckId(data, data.unk_id, "unknown-token"));
    KV_RETURN_IF_ERROR(CheckId(data, data.pad_id, "padding"));
    return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::Create(TokenizerData data) {
    return Create(std::make_shared<const TokenizerData>(std::move(data)));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::Create(std::shared_ptr<const TokenizerData> data) {
    KV_CHECK(data != nullptr);
    KV_RETURN_IF_ERROR(Validate(*data));
    switch (data->kind) {
        case TokenizerKind::kSentencePiece:
            return SpmTokenizer::Create(std::move(data));
        case TokenizerKind::kByteLevelBpe:
            return BpeTokenizer::Create(std::move(data));
    }
    return Internal("unknown tokenizer kind");
}

Tokenizer::Tokenizer(std::shared_ptr<const TokenizerData> data)
    : shared_data_(std::move(data)),
      data_(*shared_data_),
      piece_splitter_(std::make_shared<SpecialTokenSplitter>(data_)) {}

std::vector<int32_t> Tokenizer::EncodePieces(const std::vector<TextPiece>& pieces,
                                             const EncodeOptions& options) const {
    std::vector<int32_t> out;
    if (options.add_bos && data_.bos_id >= 0) out.push_back(data_.bos_id);
    // Raw text gathered since the last special token. Encoded without special-token parsing,
    // which still splits out user-defined tokens as Encode does.
    std::string raw;
    EncodeOptions plain;
    auto flush = [&] {
        if (raw.empty()) return;
        const std::vector<int32_t> ids = Encode(raw, plain);
        out.insert(out.end(), ids.begin(), ids.end());
        raw.clear();
    };
    std::string markup;  // consecutive non-literal pieces, split on special tokens together
    auto split_markup = [&] {
        for (const TextFragment& f : piece_splitter_->Split(markup, options.parse_special)) {
            if (f.token < 0) {
                raw.append(f.text);
                continue;
            }
            flush();
            out.push_back(f.token);
        }
        markup.clear();
    };
    for (const TextPiece& piece : pieces) {
        if (!piece.literal) {
            markup += piece.text;
            continue;
        }
        split_markup();
        raw += piece.text;
    }
    split_markup();
    flush();
    return out;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
    std::string text;
    const bool strip_after_bos =
        data_.kind == TokenizerKind::kSentencePiece && data_.add_space_prefix;
    int32_t prev = -1;
    for (int32_t id : ids) {
        std::string bytes = TokenBytes(id);
        size_t skip = 0;
        if (strip_after_bos && prev >= 0 && prev == data_.bos_id && !bytes.empty() &&
            bytes[0] == ' ') {
            skip = 1;
        }
        text.append(bytes, skip, std::string::npos);
        prev = id;
    }
    return text;
}

bool Tokenizer::IsControl(int32_t id) const {
    if (id < 0 || id >= vocab_size()) return false;
    return TypeOf(data_, id) == TokenType::kControl;
}

TableTokenizer::TableTokenizer(std::shared_ptr<const TokenizerData> data)
    : Tokenizer(std::move(data)), piece_to_id_(BuildPieceMap(data_.tokens)) {}

std::string TableTokenizer::TokenBytes(int32_t id) const {
    if (id < 0 || id >= vocab_size()) return "";
    return token_bytes_[static_cast<size_t>(id)];
}

int32_t TableTokenizer::PieceToId(std::string_view piece) const {
    auto it = piece_to_id_.find(piece);
    return it == piece_to_id_.end() ? -1 : it->second;
}

PieceMap BuildPieceMap(const std::vector<std::string>& tokens) {
    PieceMap map;
    map.reserve(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) map[tokens[i]] = static_cast<int32_t>(i);
    return map;
}

SpecialTokenSplitter::SpecialTokenSplitter(const TokenizerData& data) {
    for (size_t i = 0; i < data.tokens.size(); ++i) {
        const auto id = static_cast<int32_t>(i);
        const TokenType type = TypeOf(data, id);
        if (data.tokens[i].empty()) continue;
        if (type == TokenType::kControl || type == TokenType::kUnknown ||
            type == TokenType::kUserDefined) {
            specials_.push_back({data.tokens[i], id, type == TokenType::kUserDefined});
        }
    }
    std::stable_sort(specials_.begin(), specials_.end(), [](const Special& a, const Special& b) {
        return a.piece.size() > b.piece.size();
    });
}

std::vector<TextFragment> SpecialTokenSplitter::Split(std::string_view text,
                                                      bool parse_special) const {
    std::vector<TextFragment> fragments;
    if (text.empty()) return fragments;
    fragments.push_back({text, -1});
    std::vector<TextFragment> next;
    for (const Special& special : specials_) {
        if (!special.always && !parse_special) continue;
        next.clear();
        bool found = false;
        for (const TextFragment& fragment : fragments) {
            if (fragment.token >= 0) {
                next.push_back(fragment);
                continue;
            }
            std::string_view rest = fragment.text;
            for (size_t pos; (pos = rest.find(special.piece)) != std::string_view::npos;) {
                found = true;
                if (pos > 0) next.push_back({rest.substr(0, pos), -1});
                next.push_back({rest.substr(pos, special.piece.size()), special.id});
                rest.remove_prefix(pos + special.piece.size());
            }
            if (!rest.empty()) next.push_back({rest, -1});
        }
        if (found) fragments.swap(next);
    }
    return fragments;
}

}  // namespace kvshard
