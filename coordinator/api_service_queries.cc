// ApiService's answers that generate nothing (api_service.h): GET /v1/models and
// /v1/models/{id}, the tokenizer files, vLLM's POST /tokenize and POST /detokenize, GET /health
// and GET /metrics.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "coordinator/api_service.h"

namespace kvshard {

using nlohmann::json;

namespace {

// Text a client sent (a model name) or a tokenizer made may hold bytes that are not UTF-8:
// those become U+FFFD.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// One entry of GET /v1/models (`id` one of the served names), and the answer of
// GET /v1/models/{id}.
json ModelObject(const ServedModel& model, const std::string& id, int64_t created,
                 int64_t max_model_len) {
    return {{"id", id},
            {"object", "model"},
            {"created", created},
            {"owned_by", "kvshard"},
            // vLLM's model card: the model it serves (here the served name), no parent model.
            {"root", model.name},
            {"parent", nullptr},
            {"max_model_len", max_model_len}};
}

}  // namespace

std::string ApiService::ModelsBody() const {
    json data = json::array(
        {ModelObject(options_.model, options_.model.name, created_, engine_.max_context())});
    for (const std::string& alias : options_.model.aliases) {
        data.push_back(ModelObject(options_.model, alias, created_, engine_.max_context()));
    }
    return Dump(json{{"object", "list"}, {"data", std::move(data)}});
}

std::variant<std::string, ApiError> ApiService::ModelBody(std::string_view id) const {
    if (!ServesModel(options_.model, id)) return ModelNotFound(options_.model, id);
    const auto& aliases = options_.model.aliases;
    const bool alias = std::find(aliases.begin(), aliases.end(), id) != aliases.end();
    return Dump(ModelObject(options_.model, alias ? std::string(id) : options_.model.name, created_,
                            engine_.max_context()));
}

std::variant<std::string, ApiError> ApiService::TokenizerFileBody(std::string_view id,
                                                                  TokenizerFile file) const {
    if (!ServesModel(options_.model, id)) return ModelNotFound(options_.model, id);
    const std::string& text = file == TokenizerFile::kTokenizerJson
                                  ? options_.tokenizer_json
                                  : options_.tokenizer_config_json;
    if (text.empty()) {
        ApiError e;
        e.http_status = 404;
        e.message =
            "this server has no Hugging Face tokenizer files for '" + options_.model.name + "'";
        e.code = "not_found";
        return e;
    }
    return text;
}

std::variant<std::string, ApiError> ApiService::TokenizerAnswer(TokenizerEndpoint endpoint,
                                                                std::string_view body) const {
    switch (endpoint) {
        case TokenizerEndpoint::kTokenize: {
            auto parsed = ParseTokenizeRequest(body, options_.model);
            if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
            return TokenizeAnswer(std::get<TokenizeRequest>(parsed));
        }
        case TokenizerEndpoint::kDetokenize: {
            auto parsed = ParseDetokenizeRequest(body, options_.model);
            if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
            return DetokenizeAnswer(std::get<DetokenizeRequest>(parsed));
        }
    }
    return BadRequest("unknown tokenizer route");
}

std::variant<std::string, ApiError> ApiService::TokenizeAnswer(const TokenizeRequest& r) const {
    // The same cap as the generation routes: what costs a tokenization is bounded the same way.
    int64_t bytes = static_cast<int64_t>(r.prompt.size());
    for (const ChatMessage& m : r.messages) bytes += static_cast<int64_t>(m.content.size());
    if (bytes > max_prompt_bytes_) {
        return PromptTooLarge(r.chat ? "the messages' content" : "the prompt", bytes,
                              r.chat ? "messages" : "prompt");
    }
    std::vector<int32_t> ids;
    if (r.chat) {
        auto encoded = EncodeChat(r.messages, r.add_generation_prompt, r.add_special_tokens);
        if (auto* error = std::get_if<ApiError>(&encoded)) return *error;
        ids = std::move(std::get<EncodedChat>(encoded).ids);
    } else {
        ids = EncodeText(r.prompt, r.add_special_tokens);
    }
    // vLLM's shape: token_strs is null unless asked for.
    json answer = {{"count", ids.size()},
                   {"max_model_len", engine_.max_context()},
                   {"tokens", ids},
                   {"token_strs", nullptr}};
    if (r.return_token_strs) {
        // The vocabulary's pieces, as vLLM's convert_ids_to_tokens gives them ("Ġworld", "▁the").
        json strs = json::array();
        for (int32_t id : ids) strs.push_back(tokenizer_.data().tokens[static_cast<size_t>(id)]);
        answer["token_strs"] = std::move(strs);
    }
    return Dump(answer);
}

// Control tokens come back as their text ("<|im_end|>"), as vLLM's detokenize (no
// skip_special_tokens) writes them, so tokenize -> detokenize -> tokenize gives the same ids.
// Each run of other tokens is decoded with the token before it, so SentencePiece drops the
// space after BOS as Decode does.
std::string ApiService::DetokenizeText(const std::vector<int32_t>& tokens) const {
    std::string text;
    size_t i = 0;
    while (i < tokens.size()) {
        const int32_t id = tokens[i];
        if (tokenizer_.IsControl(id) && tokenizer_.TokenBytes(id).empty()) {
            text += tokenizer_.data().tokens[static_cast<size_t>(id)];
            ++i;
            continue;
        }
        // The token before the run, if any, is a control token: it adds no bytes.
        std::vector<int32_t> run;
        if (i > 0) run.push_back(tokens[i - 1]);
        while (i < tokens.size() &&
               !(tokenizer_.IsControl(tokens[i]) && tokenizer_.TokenBytes(tokens[i]).empty())) {
            run.push_back(tokens[i++]);
        }
        text += tokenizer_.Decode(run);
    }
    return text;
}

std::string ApiService::DetokenizeAnswer(const DetokenizeRequest& r) const {
    // Bytes that are not UTF-8 (a token split inside a character) become U+FFFD.
    return Dump(json{{"prompt", DetokenizeText(r.tokens)}});
}

std::pair<int, std::string> ApiService::Health() const {
    const Status st = engine_.Health();
    if (st.ok()) return {200, R"({"status":"ok"})"};
    return {503, nlohmann::json{{"status", "unavailable"}, {"error", st.message()}}.dump()};
}

std::string ApiService::MetricsBody() const { return metrics_->Render(engine_.Stats()); }

}  // namespace kvshard
