// Hugging Face tokenizer.json (+ tokenizer_config.json) reading and writing for TokenizerData.
//
// What is understood: model.type "BPE" with a vocab map and merges (as "a b" strings or [a, b]
// arrays), added_tokens (special -> kControl, otherwise kUserDefined), and two families:
//  - byte-level BPE: ByteLevel in the pre-tokenizer or decoder. The pre-tokenizer must be one of
//    ByteLevel alone ("gpt-2"), Sequence[Digits(individual_digits), ByteLevel] ("smollm") or
//    Sequence[Split(Llama 3 regex), ByteLevel] ("llama-bpe"); anything else is Unimplemented
//    rather than silently tokenized the GPT-2 way.
//  - SentencePiece-style BPE: byte_fallback and a "▁" normalizer (Replace/Prepend) or Metaspace
//    pre-tokenizer. tokenizer.json has no scores, so scores are derived from the merges: a piece
//    scores -(rank of the first merge that produces it), pieces no merge produces score
//    -(number of merges + id), and non-normal tokens 0. Merging by highest score then picks the
//    pairs in merge-rank order, which is what the file's BPE means.
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/mapped_file.h"
#include "model/tokenizer_data.h"
#include "model/tokenizer_util.h"

namespace kvshard {

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // "▁"
const char* const kLlama3HfRegex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kLlama3CppRegex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

std::string TypeName(const Json& node) {
    return node.is_object() && node.contains("type") && node["type"].is_string()
               ? node["type"].get<std::string>()
               : "";
}

// The components of a normalizer/pre-tokenizer/decoder: a Sequence's members, else the node.
std::vector<Json> Components(const Json& node) {
    if (!node.is_object()) return {};
    for (const char* key : {"pretokenizers", "normalizers", "decoders"}) {
        if (TypeName(node) == "Sequence" && node.contains(key) && node[key].is_array()) {
            return node[key].get<std::vector<Json>>();
        }
    }
    return {node};
}

bool HasComponent(const Json& node, std::string_view type) {
    for (const Json& c : Components(node)) {
        if (TypeName(c) == type) return true;
    }
    return false;
}

bool BoolField(const Json& node, const char* key, bool fallback) {
    return node.is_object() && node.contains(key) && node[key].is_boolean() ? node[key].get<bool>()
                                                                            : fallback;
}

// Names the pre-tokenizer of a byte-level tokenizer.json in llama.cpp's terms.
Result<std::string> DetectBytePre(const Json& pre, const std::string& path) {
    const std::vector<Json> parts = Components(pre);
    auto unsupported = [&]() {
        std::string text = pre.dump();
        if (text.size() > 300) text = text.substr(0, 300) + "...";
        return Unimplemented(path + ": byte-level pre_tokenizer " + text + " is not supported");
    };
    if (parts.size() == 1 && TypeName(parts[0]) == "ByteLevel" &&
        BoolField(parts[0], "use_regex", true) && !BoolField(parts[0], "add_prefix_space", false)) {
        return std::string("gpt-2");
    }
    if (parts.size() == 2 && TypeName(parts[0]) == "Digits" &&
        BoolField(parts[0], "individual_digits", false) && TypeName(parts[1]) == "ByteLevel" &&
        BoolField(parts[1], "use_regex", true) && !BoolField(parts[1], "add_prefix_space", false)) {
        return std::string("smollm");
    }
    if (parts.size() == 2 && TypeName(parts[0]) == "Split" && TypeName(parts[1]) == "ByteLevel" &&
        !BoolField(parts[1], "use_regex", true)) {
        const Json& pattern = parts[0].value("pattern", Json::object());
        const std::string regex = pattern.value("Regex", "");
        if (regex == kLlama3HfRegex || regex == kLlama3CppRegex) return std::string("llama-bpe");
    }
    return unsupported();
}

bool HasSpmSpaceRule(const Json& normalizer, const Json& pre) {
    for (const Json& c : Components(normalizer)) {
        if (TypeName(c) == "Replace" && c.value("content", "") == kSpmSpace) return true;
        if (TypeName(c) == "Prepend" && c.value("prepend", "") == kSpmSpace) return true;
    }
    return HasComponent(pre, "Metaspace");
}

bool SpmAddsSpacePrefix(const Json& normalizer, const Json& pre) {
    for (const Json& c : Components(normalizer)) {
        if (TypeName(c) == "Prepend" && c.value("prepend", "") == kSpmSpace) return true;
    }
    for (const Json& c : Components(pre)) {
        if (TypeName(c) != "Metaspace") continue;
        if (c.contains("prepend_scheme") && c["prepend_scheme"].is_string()) {
            return c["prepend_scheme"].get<std::string>() != "never";
        }
        return BoolField(c, "add_prefix_space", true);
    }
    return false;
}

// A special token in tokenizer_config.json: "text" or {"content": "text", ...}.
std::string TokenText(const Json& node) {
    if (node.is_string()) return node.get<std::string>();
    if (node.is_object() && node.contains("content") && node["content"].is_string()) {
        return node["content"].get<std::string>();
    }
    return "";
}

// Sets `*id` from config key `key` when it names a known token.
void SetIdFromConfig(const Json& config, const char* key, const PieceMap& ids, int32_t* id) {
    if (!config.contains(key)) return;
    if (config[key].is_null()) {
        *id = -1;
        return;
    }
    auto it = ids.find(TokenText(config[key]));
    if (it != ids.end()) *id = it->second;
}

// Scores for a SentencePiece-style vocabulary from its merges (see the file comment).
std::vector<float> ScoresFromMerges(const TokenizerData& data,
                                    const std::vector<std::string>& merges, const PieceMap& ids) {
    const size_t n = data.tokens.size();
    std::vector<float> scores(n, 0.0f);
    std::vector<bool> scored(n, false);
    for (size_t rank = 0; rank < merges.size(); ++rank) {
        const std::string& m = merges[rank];
        const size_t space = m.size() > 1 ? m.find(' ', 1) : std::string::npos;
        if (space == std::string::npos) continue;
        auto it = ids.find(m.substr(0, space) + m.substr(space + 1));
        if (it == ids.end() || scored[static_cast<size_t>(it->second)]) continue;
        scored[static_cast<size_t>(it->second)] = true;
        scores[static_cast<size_t>(it->second)] = -static_cast<float>(rank);
    }
    for (size_t i = 0; i < n; ++i) {
        if (!scored[i] && TypeOf(data, static_cast<int32_t>(i)) == TokenType::kNormal) {
            scores[i] = -static_cast<float>(merges.size() + i);
        }
    }
    return scores;
}

// Merges for a SentencePiece-style vocabulary, as Hugging Face's SentencePiece converter makes
// them: every split of a normal piece into two vocabulary pieces, ordered by the piece's score
// (highest first), then by the ids of the two halves.
std::vector<std::string> MergesFromScores(const TokenizerData& data) {
    const PieceMap ids = BuildPieceMap(data.tokens);
    std::vector<int32_t> order;
    for (size_t i = 0; i < data.tokens.size(); ++i) {
        if (TypeOf(data, static_cast<int32_t>(i)) == TokenType::kNormal) {
            order.push_back(static_cast<int32_t>(i));
        }
    }
    auto score = [&](int32_t id) {
        return data.scores.empty() ? 0.0f : data.scores[static_cast<size_t>(id)];
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return score(a) > score(b); });
    std::vector<std::string> merges;
    for (int32_t id : order) {
        const std::string& piece = data.tokens[static_cast<size_t>(id)];
        std::vector<std::pair<std::pair<int32_t, int32_t>, size_t>> splits;
        for (size_t k = 1; k < piece.size(); ++k) {
            if ((static_cast<uint8_t>(piece[k]) & 0xC0) == 0x80) continue;  // inside a character
            auto l = ids.find(std::string_view(piece).substr(0, k));
            auto r = ids.find(std::string_view(piece).substr(k));
            if (l != ids.end() && r != ids.end()) splits.push_back({{l->second, r->second}, k});
        }
        std::sort(splits.begin(), splits.end());
        for (const auto& [pair, k] : splits) {
            merges.push_back(piece.substr(0, k) + " " + piece.substr(k));
        }
    }
    return merges;
}

Result<TokenizerData> ParseTokenizerJson(const std::string& path, const Json& root,
                                         const Json* config) {
    TokenizerData data;
    data.source = path;
    const Json& model = root.at("model");
    const std::string model_type = model.value("type", model.contains("merges") ? "BPE" : "");
    if (model_type != "BPE") {
        return Unimplemented(path + ": tokenizer model type \"" + model_type +
                             "\" is not supported (kvshard reads BPE)");
    }

    // Vocabulary and added tokens; ids not named by either become unused "[PAD<id>]" tokens.
    std::vector<std::pair<std::string, int64_t>> entries;
    for (const auto& [piece, id] : model.at("vocab").items()) {
        entries.emplace_back(piece, id.get<int64_t>());
    }
    std::vector<std::pair<int64_t, bool>> added;  // id, special
    if (root.contains("added_tokens") && root["added_tokens"].is_array()) {
        for (const Json& t : root["added_tokens"]) {
            const int64_t id = t.at("id").get<int64_t>();
            entries.emplace_back(t.at("content").get<std::string>(), id);
            added.emplace_back(id, t.value("special", false));
        }
    }
    int64_t num_tokens = 0;
    for (const auto& [piece, id] : entries) {
        if (id < 0 || id >= (int64_t{1} << 24)) {
            return InvalidArgument(path + ": token \"" + piece + "\" has id " + std::to_string(id));
        }
        num_tokens = std::max(num_tokens, id + 1);
    }
    data.tokens.assign(static_cast<size_t>(num_tokens), "");
    data.types.assign(static_cast<size_t>(num_tokens), TokenType::kUnused);
    for (const auto& [piece, id] : entries) {
        data.tokens[static_cast<size_t>(id)] = piece;
        data.types[static_cast<size_t>(id)] = TokenType::kNormal;
    }
    for (size_t i = 0; i < data.tokens.size(); ++i) {
        if (data.types[i] == TokenType::kUnused) data.tokens[i] = "[PAD" + std::to_string(i) + "]";
    }
    for (const auto& [id, special] : added) {
        data.types[static_cast<size_t>(id)] =
            special ? TokenType::kControl : TokenType::kUserDefined;
    }
    const PieceMap ids = BuildPieceMap(data.tokens);

    std::vector<std::string> merges;
    if (model.contains("merges")) {
        for (const Json& m : model["merges"]) {
            if (m.is_string()) {
                merges.push_back(m.get<std::string>());
            } else {
                merges.push_back(m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
            }
        }
    }

    const Json null_json;
    const Json& normalizer = root.contains("normalizer") ? root["normalizer"] : null_json;
    const Json& pre = root.contains("pre_tokenizer") ? root["pre_tokenizer"] : null_json;
    const Json& decoder = root.contains("decoder") ? root["decoder"] : null_json;
    if (HasComponent(pre, "ByteLevel") || HasComponent(decoder, "ByteLevel")) {
        data.kind = TokenizerKind::kByteLevelBpe;
        KV_ASSIGN_OR_RETURN(data.pre, DetectBytePre(pre, path));
        data.merges = std::move(merges);
    } else if (BoolField(model, "byte_fallback", false) && HasSpmSpaceRule(normalizer, pre)) {
        data.kind = TokenizerKind::kSentencePiece;
        data.add_space_prefix = SpmAddsSpacePrefix(normalizer, pre);
        data.add_bos = true;
        for (size_t i = 0; i < data.tokens.size(); ++i) {
            const std::string& t = data.tokens[i];
            if (data.types[i] == TokenType::kNormal && t.size() == 6 && t.starts_with("<0x") &&
                t.ends_with(">")) {
                data.types[i] = TokenType::kByte;
            }
        }
        data.scores = ScoresFromMerges(data, merges, ids);
        for (const char* piece : {"<s>", "</s>"}) {
            auto it = ids.find(std::string_view(piece));
            if (it != ids.end()) *(piece[1] == 's' ? &data.bos_id : &data.eos_id) = it->second;
        }
    } else {
        return Unimplemented(path +
                             ": neither byte-level BPE (ByteLevel pre-tokenizer/decoder) "
                             "nor SentencePiece-style BPE (byte_fallback and a \"▁\" rule)");
    }

    // The unknown token. A byte-level vocabulary's unknown token may be a control token
    // (SmolLM2's <|endoftext|>); it keeps that type.
    auto set_unk = [&](int32_t id) {
        data.unk_id = id;
        if (id < 0) return;
        const bool added_token =
            std::any_of(added.begin(), added.end(), [&](const auto& a) { return a.first == id; });
        if (data.kind == TokenizerKind::kSentencePiece || !added_token) {
            data.types[static_cast<size_t>(id)] = TokenType::kUnknown;
        }
    };
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
        auto it = ids.find(model["unk_token"].get<std::string>());
        if (it != ids.end()) set_unk(it->second);
    }

    // add_bos: tokenizer_config.json's add_bos_token, else whether the post-processor template
    // starts with a special token (Llama 3), else the family's default.
    const Json& post = root.contains("post_processor") ? root["post_processor"] : null_json;
    for (const Json& c : Components(post)) {
        if (TypeName(c) != "TemplateProcessing" || !c.contains("single")) continue;
        const Json& single = c["single"];
        data.add_bos = single.is_array() && !single.empty() && single[0].contains("SpecialToken");
        if (data.add_bos) {
            auto it = ids.find(single[0]["SpecialToken"].value("id", ""));
            if (it != ids.end()) data.bos_id = it->second;
        }
    }
    if (config != nullptr) {
        SetIdFromConfig(*config, "bos_token", ids, &data.bos_id);
        SetIdFromConfig(*config, "eos_token", ids, &data.eos_id);
        SetIdFromConfig(*config, "pad_token", ids, &data.pad_id);
        if (config->contains("unk_token")) {
            int32_t unk = data.unk_id;
            SetIdFromConfig(*config, "unk_token", ids, &unk);
            if (unk != data.unk_id) set_unk(unk);
        }
        data.add_bos = BoolField(*config, "add_bos_token", data.add_bos);
        if (config->contains("chat_template")) {
            const Json& t = (*config)["chat_template"];
            if (t.is_string()) {
                data.chat_template = t.get<std::string>();
            } else if (t.is_array()) {
                // Named templates: take "default", else the first.
                for (const Json& named : t) {
                    if (data.chat_template.empty() || named.value("name", "") == "default") {
                        data.chat_template = named.value("template", "");
                    }
                }
            }
        }
    }
    return data;
}

}  // namespace

Result<TokenizerData> ReadTokenizerJson(const std::string& path) {
    KV_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path));
    const std::string config_path =
        (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
    std::string where = path;
    try {
        const Json root = Json::parse(text);
        Json config;
        const bool has_config = std::filesystem::exists(config_path);
        if (has_config) {
            where = config_path;
            KV_ASSIGN_OR_RETURN(const std::string config_text, ReadFileToString(config_path));
            config = Json::parse(config_text);
            where = path;
        }
        return ParseTokenizerJson(path, root, has_config ? &config : nullptr);
    } catch (const Json::exception& e) {
        return InvalidArgument(where + ": " + e.what());
    }
}

std::string TokenizerJsonText(const TokenizerData& data) {
    const bool spm = data.kind == TokenizerKind::kSentencePiece;
    auto piece = [&](int32_t id) -> OrderedJson {
        if (id < 0 || id >= static_cast<int32_t>(data.tokens.size())) return nullptr;
        return data.tokens[static_cast<size_t>(id)];
    };

    OrderedJson root;
    root["version"] = "1.0";
    root["truncation"] = nullptr;
    root["padding"] = nullptr;
    OrderedJson added = OrderedJson::array();
    for (size_t i = 0; i < data.tokens.size(); ++i) {
        const TokenType type = TypeOf(data, static_cast<int32_t>(i));
        if (type != TokenType::kControl && type != TokenType::kUserDefined) continue;
        added.push_back({{"id", i},
                         {"content", data.tokens[i]},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", type == TokenType::kUserDefined},
                         {"special", type == TokenType::kControl}});
    }
    root["added_tokens"] = added;

    const std::string space(kSpmSpace);
    if (spm) {
        OrderedJson normalizers = OrderedJson::array();
        if (data.add_space_prefix) normalizers.push_back({{"type", "Prepend"}, {"prepend", space}});
        normalizers.push_back(
            {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", space}});
        root["normalizer"] = {{"type", "Sequence"}, {"normalizers", normalizers}};
        root["pre_tokenizer"] = nullptr;
    } else {
        root["normalizer"] = nullptr;
        const OrderedJson byte_level = {{"type", "ByteLevel"},
                                        {"add_prefix_space", false},
                                        {"trim_offsets", true},
                                        {"use_regex", data.pre != "llama-bpe"}};
        if (data.pre == "smollm") {
            root["pre_tokenizer"] = {
                {"type", "Sequence"},
                {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level}}};
        } else if (data.pre == "llama-bpe") {
            root["pre_tokenizer"] = {{"type", "Sequence"},
                                     {"pretokenizers",
                                      {{{"type", "Split"},
                                        {"pattern", {{"Regex", kLlama3HfRegex}}},
                                        {"behavior", "Isolated"},
                                        {"invert", false}},
                                       byte_level}}};
        } else {
            root["pre_tokenizer"] = byte_level;
        }
    }

    if (data.add_bos && data.bos_id >= 0) {
        const OrderedJson bos = piece(data.bos_id);
        const OrderedJson bos_item = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
        root["post_processor"] = {
            {"type", "TemplateProcessing"},
            {"single", {bos_item, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair",
             {bos_item,
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
              {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
            {"special_tokens",
             {{bos.get<std::string>(), {{"id", bos}, {"ids", {data.bos_id}}, {"tokens", {bos}}}}}}};
    } else if (spm) {
        root["post_processor"] = nullptr;
    } else {
        root["post_processor"] = {{"type", "ByteLevel"},
                                  {"add_prefix_space", true},
                                  {"trim_offsets", false},
                                  {"use_regex", true}};
    }

    if (spm) {
        OrderedJson decoders = OrderedJson::array();
        decoders.push_back(
            {{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}});
        decoders.push_back({{"type", "ByteFallback"}});
        decoders.push_back({{"type", "Fuse"}});
        if (data.add_space_prefix) {
            decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
        }
        root["decoder"] = {{"type", "Sequence"}, {"decoders", decoders}};
    } else {
        root["decoder"] = {{"type", "ByteLevel"},
                           {"add_prefix_space", true},
                           {"trim_offsets", true},
                           {"use_regex", true}};
    }

    // In id order, as Hugging Face writes it. ordered_json's own insert searches the object
    // linearly, so append to the underlying vector; a repeated piece keeps its first id.
    OrderedJson vocab = OrderedJson::object();
    auto& entries =
        static_cast<OrderedJson::object_t::Container&>(vocab.get_ref<OrderedJson::object_t&>());
    std::unordered_set<std::string_view> seen;
    entries.reserve(data.tokens.size());
    for (size_t i = 0; i < data.tokens.size(); ++i) {
        if (seen.insert(data.tokens[i]).second) entries.emplace_back(data.tokens[i], i);
    }
    const std::vector<std::string> merges = spm ? MergesFromScores(data) : data.merges;
    OrderedJson merges_json = OrderedJson::array();
    for (const std::string& m : merges) merges_json.push_back(m);
    root["model"] = {{"type", "BPE"},
                     {"dropout", nullptr},
                     {"unk_token", piece(data.unk_id)},
                     {"continuing_subword_prefix", nullptr},
                     {"end_of_word_suffix", nullptr},
                     {"fuse_unk", spm},
                     {"byte_fallback", spm},
                     {"ignore_merges", data.pre == "llama-bpe" && !spm},
                     {"vocab", vocab},
                     {"merges", merges_json}};
    return root.dump(2);
}

std::string TokenizerConfigJsonText(const TokenizerData& data) {
    auto piece = [&](int32_t id) -> OrderedJson {
        if (id < 0 || id >= static_cast<int32_t>(data.tokens.size())) return nullptr;
        return data.tokens[static_cast<size_t>(id)];
    };
    OrderedJson config;
    config["add_bos_token"] = data.add_bos;
    config["add_eos_token"] = false;
    config["bos_token"] = piece(data.bos_id);
    config["eos_token"] = piece(data.eos_id);
    config["unk_token"] = piece(data.unk_id);
    config["pad_token"] = piece(data.pad_id);
    config["clean_up_tokenization_spaces"] = false;
    config["tokenizer_class"] = data.kind == TokenizerKind::kSentencePiece
                                    ? "LlamaTokenizerFast"
                                    : "PreTrainedTokenizerFast";
    if (!data.chat_template.empty()) config["chat_template"] = data.chat_template;
    return config.dump(2);
}

}  // namespace kvshard
