// TokenizerData readers for GGUF metadata and llama2.c's tokenizer.bin. The Hugging Face
// tokenizer.json reader and writer are in tokenizer_json.cc.
#include "model/tokenizer_data.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <limits>
#include <utility>

#include "common/mapped_file.h"
#include "model/gguf.h"

namespace kvshard {

namespace {

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // "▁"

// An optional token id key. Absent keeps `*id`. llama.cpp writes "none" as UINT32_MAX; that and
// any other id outside the vocabulary is ignored with a warning, as llama.cpp does.
Status ReadOptionalId(const GgufFile& gguf, const char* key, size_t num_tokens, int32_t* id) {
    if (!gguf.Has(key)) return Status::Ok();
    KV_ASSIGN_OR_RETURN(const int64_t value, gguf.GetInt(key));
    if (value == std::numeric_limits<uint32_t>::max() || value == -1) {
        *id = -1;
    } else if (value < 0 || value >= static_cast<int64_t>(num_tokens)) {
        spdlog::warn("{}: {} = {} is outside the vocabulary of {} tokens; ignored", gguf.path(),
                     key, value, num_tokens);
        *id = -1;
    } else {
        *id = static_cast<int32_t>(value);
    }
    return Status::Ok();
}

Status ReadOptionalBool(const GgufFile& gguf, const char* key, bool* out) {
    if (!gguf.Has(key)) return Status::Ok();
    KV_ASSIGN_OR_RETURN(*out, gguf.GetBool(key));
    return Status::Ok();
}

}  // namespace

Result<TokenizerData> TokenizerDataFromGguf(const GgufFile& gguf) {
    const std::string& path = gguf.path();
    TokenizerData data;
    data.source = path;

    KV_ASSIGN_OR_RETURN(const std::string model, gguf.GetString("tokenizer.ggml.model"));
    if (model == "llama") {
        data.kind = TokenizerKind::kSentencePiece;
        data.add_bos = true;
        data.add_space_prefix = true;
        data.unk_id = 0;  // llama.cpp's defaults for SentencePiece vocabularies
        data.bos_id = 1;
        data.eos_id = 2;
    } else if (model == "gpt2") {
        data.kind = TokenizerKind::kByteLevelBpe;
    } else {
        return Unimplemented(path + ": tokenizer model \"" + model +
                             "\" (tokenizer.ggml.model) is not supported; kvshard reads "
                             "\"llama\" (SentencePiece) and \"gpt2\" (byte-level BPE)");
    }

    KV_ASSIGN_OR_RETURN(data.tokens, gguf.GetStringArray("tokenizer.ggml.tokens"));
    const size_t n = data.tokens.size();
    if (n == 0) return InvalidArgument(path + ": tokenizer.ggml.tokens is empty");

    if (gguf.Has("tokenizer.ggml.scores")) {
        KV_ASSIGN_OR_RETURN(const std::vector<double> scores,
                            gguf.GetFloatArray("tokenizer.ggml.scores"));
        if (scores.size() != n) {
            return InvalidArgument(path + ": tokenizer.ggml.scores has " +
                                   std::to_string(scores.size()) + " entries for " +
                                   std::to_string(n) + " tokens");
        }
        data.scores.assign(scores.begin(), scores.end());
    }
    if (gguf.Has("tokenizer.ggml.token_type")) {
        KV_ASSIGN_OR_RETURN(const std::vector<int64_t> types,
                            gguf.GetIntArray("tokenizer.ggml.token_type"));
        if (types.size() != n) {
            return InvalidArgument(path + ": tokenizer.ggml.token_type has " +
                                   std::to_string(types.size()) + " entries for " +
                                   std::to_string(n) + " tokens");
        }
        data.types.reserve(n);
        for (size_t i = 0; i < n; ++i) {
            if (types[i] < 0 || types[i] > static_cast<int64_t>(TokenType::kByte)) {
                return InvalidArgument(path + ": tokenizer.ggml.token_type[" + std::to_string(i) +
                                       "] is " + std::to_string(types[i]) +
                                       ", not a token type (0..6)");
            }
            data.types.push_back(static_cast<TokenType>(types[i]));
        }
    }
    if (gguf.Has("tokenizer.ggml.merges")) {
        KV_ASSIGN_OR_RETURN(data.merges, gguf.GetStringArray("tokenizer.ggml.merges"));
    } else if (data.kind == TokenizerKind::kByteLevelBpe) {
        return NotFound(path + ": tokenizer.ggml.merges is missing (required for gpt2)");
    }
    if (gguf.Has("tokenizer.ggml.pre")) {
        KV_ASSIGN_OR_RETURN(data.pre, gguf.GetString("tokenizer.ggml.pre"));
    }

    KV_RETURN_IF_ERROR(ReadOptionalId(gguf, "tokenizer.ggml.bos_token_id", n, &data.bos_id));
    KV_RETURN_IF_ERROR(ReadOptionalId(gguf, "tokenizer.ggml.eos_token_id", n, &data.eos_id));
    KV_RETURN_IF_ERROR(ReadOptionalId(gguf, "tokenizer.ggml.unknown_token_id", n, &data.unk_id));
    KV_RETURN_IF_ERROR(ReadOptionalId(gguf, "tokenizer.ggml.padding_token_id", n, &data.pad_id));
    KV_RETURN_IF_ERROR(ReadOptionalBool(gguf, "tokenizer.ggml.add_bos_token", &data.add_bos));
    KV_RETURN_IF_ERROR(
        ReadOptionalBool(gguf, "tokenizer.ggml.add_space_prefix", &data.add_space_prefix));
    if (gguf.Has("tokenizer.chat_template")) {
        KV_ASSIGN_OR_RETURN(data.chat_template, gguf.GetString("tokenizer.chat_template"));
    }
    return data;
}

Result<TokenizerData> ReadLlama2cTokenizer(const std::string& path, int64_t vocab_size) {
    KV_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
    if (vocab_size <= 0 || vocab_size > std::numeric_limits<int32_t>::max()) {
        return InvalidArgument(path + ": vocabulary size " + std::to_string(vocab_size) +
                               " is not valid");
    }
    const uint8_t* bytes = file.data();
    const size_t size = file.size();
    size_t pos = 0;
    auto read = [&](void* out, size_t n, const std::string& what) -> Status {
        if (size - pos < n) {
            return DataLoss(path + ": file truncated while reading " + what + " (at byte " +
                            std::to_string(pos) + " of " + std::to_string(size) + ")");
        }
        std::memcpy(out, bytes + pos, n);
        pos += n;
        return Status::Ok();
    };

    int32_t max_token_length = 0;
    KV_RETURN_IF_ERROR(read(&max_token_length, 4, "max_token_length"));
    if (max_token_length <= 0) {
        return DataLoss(path + ": max_token_length is " + std::to_string(max_token_length));
    }

    TokenizerData data;
    data.kind = TokenizerKind::kSentencePiece;
    data.source = path;
    data.add_bos = true;
    data.add_space_prefix = true;
    data.unk_id = 0;
    data.bos_id = 1;
    data.eos_id = 2;
    data.tokens.reserve(static_cast<size_t>(vocab_size));
    data.scores.reserve(static_cast<size_t>(vocab_size));
    data.types.reserve(static_cast<size_t>(vocab_size));
    for (int64_t i = 0; i < vocab_size; ++i) {
        const std::string which = "token " + std::to_string(i);
        float score = 0;
        int32_t len = 0;
        KV_RETURN_IF_ERROR(read(&score, 4, which + " score"));
        KV_RETURN_IF_ERROR(read(&len, 4, which + " length"));
        if (len < 0 || len > max_token_length) {
            return DataLoss(path + ": " + which + " has length " + std::to_string(len) +
                            " (max_token_length " + std::to_string(max_token_length) + ")");
        }
        std::string piece(static_cast<size_t>(len), '\0');
        KV_RETURN_IF_ERROR(read(piece.data(), piece.size(), which + " text"));

        TokenType type = TokenType::kNormal;
        if (i == 0) {
            type = TokenType::kUnknown;
        } else if (i <= 2) {
            type = TokenType::kControl;
            // llama2.c stores BOS/EOS as "\n<s>\n" and "\n</s>\n"; keep the bare piece, as
            // llama.cpp's GGUF of the same tokenizer has it.
            const size_t b = piece.find_first_not_of(" \n");
            const size_t e = piece.find_last_not_of(" \n");
            piece = b == std::string::npos ? "" : piece.substr(b, e - b + 1);
        } else if (piece.size() == 6 && piece.starts_with("<0x") && piece.ends_with(">")) {
            type = TokenType::kByte;
        } else {
            // llama2.c's export turned "▁" into spaces; the tokenizer works on "▁".
            std::string escaped;
            for (char c : piece) {
                if (c == ' ') {
                    escaped += kSpmSpace;
                } else {
                    escaped += c;
                }
            }
            piece = std::move(escaped);
        }
        data.tokens.push_back(std::move(piece));
        data.scores.push_back(score);
        data.types.push_back(type);
    }
    if (pos != size) {
        // llama2.c tokenizer files hold exactly the model's vocabulary: more bytes mean a
        // tokenizer made for a larger vocabulary, i.e. for another model.
        return InvalidArgument(path + ": " + std::to_string(size - pos) + " bytes follow the " +
                               std::to_string(vocab_size) +
                               " tokens the model needs: the tokenizer does not match the model's vocabulary");
    }
    return data;
}

}  // namespace kvshard
