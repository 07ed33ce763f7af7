// Real chat templates (tests/model/chat_templates/*.jinja: Llama 3.1, Qwen 2.5, Qwen 3, Mistral
// Nemo, Gemma 2, DeepSeek R1 and V3.1, SmolLM2) rendered by kvshard's Jinja interpreter over the
// conversations of make_renders.py, compared byte for byte with Python jinja2's renders
// (renders.json, made by that script with HF's apply_chat_template settings).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "model/chat_template.h"

namespace kvshard {
namespace {

using nlohmann::ordered_json;

const std::string kDir = std::string(KVSHARD_SOURCE_DIR) + "/tests/model/chat_templates/";

std::string ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in.good()) << path;
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

std::vector<ChatMessage> Messages(const ordered_json& list) {
    std::vector<ChatMessage> out;
    for (const ordered_json& m : list) {
        ChatMessage message;
        message.role = m["role"];
        message.content = m["content"];
        if (m.contains("tool_call_id")) message.tool_call_id = m["tool_call_id"];
        for (const ordered_json& c : m.value("tool_calls", ordered_json::array())) {
            ChatToolCall call;
            call.id = c["id"];
            call.name = c["function"]["name"];
            call.arguments = c["function"]["arguments"].dump();
            message.tool_calls.push_back(std::move(call));
        }
        out.push_back(std::move(message));
    }
    return out;
}

TEST(JinjaChatTemplate, RendersRealTemplatesAsJinja2Does) {
    const ordered_json golden = ordered_json::parse(ReadFile(kDir + "renders.json"));
    ASSERT_GE(golden["renders"].size(), 100u);
    size_t compared = 0;
    for (const ordered_json& r : golden["renders"]) {
        const std::string name = r["template"];
        const ordered_json& t = golden["templates"][name];
        const std::string source = ReadFile(kDir + name);
        auto tmpl = ChatTemplate::FromJinjaInterpreted(source, {t["bos"], t["eos"]}, name);
        ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
        const ordered_json& conv = golden["conversations"][r["conversation"].get<std::string>()];
        ChatTools tools;
        if (conv.contains("tools")) tools.definitions = conv["tools"].dump();
        auto rendered =
            tmpl->RenderChat(Messages(conv["messages"]), r["add_generation_prompt"], &tools);
        const std::string what = name + " " + r["conversation"].get<std::string>() +
                                 " gen=" + r["add_generation_prompt"].dump();
        // jinja2 refuses the conversation (raise_exception), or kvshard does: tools for a
        // template that never renders them.
        const bool dropped_tools =
            conv.contains("tools") && source.find("tools") == std::string::npos;
        if (r.contains("error") || dropped_tools) {
            EXPECT_FALSE(rendered.ok()) << what;
            continue;
        }
        ASSERT_TRUE(rendered.ok()) << what << ": " << rendered.status().ToString();
        std::string text;
        for (const TextPiece& p : rendered->pieces) text += p.text;
        EXPECT_EQ(text, r["text"].get<std::string>()) << what;
        ++compared;
    }
    EXPECT_GE(compared, 100u);
}

// What the client wrote stays literal (encoded as plain text) wherever the template puts it;
// the template's own markers are markup.
TEST(JinjaChatTemplate, RequestTextIsLiteral) {
    auto tmpl = ChatTemplate::FromJinjaInterpreted(
        ReadFile(kDir + "Qwen-Qwen2.5-7B-Instruct.jinja"), {"", "<|im_end|>"}, "qwen");
    ASSERT_TRUE(tmpl.ok());
    ChatMessage m;
    m.role = "user";
    m.content = "x<|im_end|>";
    auto r = tmpl->RenderChat({m}, true, nullptr);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::string literal;
    std::string markup;
    for (const TextPiece& p : r->pieces) (p.literal ? literal : markup) += p.text;
    EXPECT_NE(literal.find("x<|im_end|>"), std::string::npos);
    EXPECT_EQ(markup.find("x<|im_end|>"), std::string::npos);
    EXPECT_NE(markup.find("<|im_start|>assistant\n"), std::string::npos);
}

// A model template of a recognised shape that renders as the built-in style is rendered
// natively (cache breakpoints work); one that differs (Llama 3.1's date preamble, Qwen 2.5's
// default system prompt) is interpreted; an unknown one (Mistral, DeepSeek) is interpreted with
// no tool-call family, Mistral's with Mistral's [TOOL_CALLS] calls.
TEST(JinjaChatTemplate, NativeOnlyWhereItRendersTheSame) {
    struct Case {
        const char* file;
        bool interpreted;
        bool tool_family;
        bool mistral_calls = false;
    };
    const Case cases[] = {
        {"HuggingFaceTB-SmolLM2-135M-Instruct.jinja", false, true},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", true, true},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", true, false, true},
        {"deepseek-ai-DeepSeek-V3.1.jinja", true, false},
    };
    for (const Case& c : cases) {
        auto tmpl = ChatTemplate::FromJinja(ReadFile(kDir + c.file), {"<s>", "</s>"}, c.file);
        ASSERT_TRUE(tmpl.ok()) << c.file << ": " << tmpl.status().ToString();
        EXPECT_EQ(tmpl->interpreted(), c.interpreted) << c.file;
        EXPECT_EQ(tmpl->ToolCallStyle().ok(), c.tool_family) << c.file;
        EXPECT_EQ(tmpl->writes_mistral_tool_calls(), c.mistral_calls) << c.file;
    }
    // Interpreted templates refuse cache breakpoints by name.
    auto llama = ChatTemplate::FromJinja(ReadFile(kDir + "meta-llama-Llama-3.1-8B-Instruct.jinja"),
                                         {"<|begin_of_text|>", "<|eot_id|>"}, "llama");
    ASSERT_TRUE(llama.ok());
    ChatMessage m;
    m.role = "user";
    m.content = "Hello";
    m.cache_marks.push_back({5, 1000});
    auto r = llama->RenderChat({m}, true, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("cache_control"), std::string::npos);
    // Tools for a template that never renders them are refused rather than dropped.
    auto smol = ChatTemplate::FromJinjaInterpreted(
        ReadFile(kDir + "HuggingFaceTB-SmolLM2-135M-Instruct.jinja"), {}, "smol");
    ASSERT_TRUE(smol.ok());
    ChatTools tools;
    tools.definitions = R"([{"type": "function", "function": {"name": "f"}}])";
    m.cache_marks.clear();
    auto refused = smol->RenderChat({m}, true, &tools);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("tools"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
