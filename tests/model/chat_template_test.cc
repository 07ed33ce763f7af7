// Chat templates: recognition of the model's Jinja template and rendering checked against Jinja2's
// own output (tests/golden/chat_templates.json, made by the script beside it).
#include "model/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "model/gguf.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;

json Golden() {
    std::ifstream in(std::string(KVSHARD_SOURCE_DIR) + "/tests/golden/chat_templates.json");
    EXPECT_TRUE(in.good());
    return json::parse(in);
}

std::vector<ChatMessage> Messages(const json& list) {
    std::vector<ChatMessage> out;
    for (const json& m : list) out.push_back({m["role"], m["content"]});
    return out;
}

ChatTemplateTokens Tokens(const json& t) { return {t["bos"], t["eos"]}; }

TEST(ChatTemplate, RendersAsJinjaDoes) {
    const json golden = Golden();
    ASSERT_FALSE(golden["rendered"].empty());
    for (const json& r : golden["rendered"]) {
        const json& t = golden["templates"][r["template"].get<std::string>()];
        auto tmpl = ChatTemplate::FromJinja(t["jinja"].get<std::string>(), Tokens(t), "test");
        ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
        auto text =
            tmpl->Render(Messages(golden["conversations"][r["conversation"].get<std::string>()]),
                         r["add_generation_prompt"]);
        ASSERT_TRUE(text.ok()) << text.status().ToString();
        EXPECT_EQ(*text, r["text"].get<std::string>())
            << r["template"] << " " << r["conversation"] << " gen=" << r["add_generation_prompt"];
        // The pieces are the same text, alternating markup and content.
        auto pieces = tmpl->RenderPieces(
            Messages(golden["conversations"][r["conversation"].get<std::string>()]),
            r["add_generation_prompt"]);
        ASSERT_TRUE(pieces.ok());
        std::string joined;
        for (size_t i = 0; i < pieces->size(); ++i) {
            joined += (*pieces)[i].text;
            if (i > 0) {
                EXPECT_NE((*pieces)[i].literal, (*pieces)[i - 1].literal);
            }
        }
        EXPECT_EQ(joined, *text);
    }
}

// Message content comes out as literal pieces, the template's own text as markup; stripping
// (Llama 2 and 3 strip content) acts on the joined text, as Jinja does.
TEST(ChatTemplate, PiecesMarkContentAsLiteral) {
    struct Case {
        ChatTemplateStyle style;
        std::vector<ChatMessage> messages;
        std::vector<TextPiece> pieces;
    };
    const ChatTemplateTokens tokens{"<s>", "</s>"};
    const Case cases[] = {
        {ChatTemplateStyle::kChatMl,
         {{"user", "<|im_start|>x"}},
         {{"<|im_start|>user\n", false},
          {"<|im_start|>x", true},
          {"<|im_end|>\n<|im_start|>assistant\n", false}}},
        {ChatTemplateStyle::kLlama3,
         {{"user", "  hi  "}},
         {{"<s><|start_header_id|>user<|end_header_id|>\n\n", false},
          {"hi", true},
          {"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", false}}},
        {ChatTemplateStyle::kLlama2,
         {{"system", " S "}, {"user", "U  "}, {"assistant", " A"}},
         {{"<s>[INST] <<SYS>>\n", false},
          {" S ", true},
          {"\n<</SYS>>\n\n", false},
          {"U", true},
          {" [/INST] ", false},
          {"A", true},
          {" </s>", false}}},
        // Empty system and blank user content: the strip reaches into the markup.
        {ChatTemplateStyle::kLlama2,
         {{"system", ""}, {"user", " "}},
         {{"<s>[INST] <<SYS>>\n\n<</SYS>> [/INST]", false}}},
    };
    for (const Case& c : cases) {
        auto pieces = ChatTemplate::FromStyle(c.style, tokens).RenderPieces(c.messages, true);
        ASSERT_TRUE(pieces.ok());
        ASSERT_EQ(pieces->size(), c.pieces.size()) << ChatTemplateStyleName(c.style);
        for (size_t i = 0; i < c.pieces.size(); ++i) {
            EXPECT_EQ((*pieces)[i].text, c.pieces[i].text) << ChatTemplateStyleName(c.style) << i;
            EXPECT_EQ((*pieces)[i].literal, c.pieces[i].literal)
                << ChatTemplateStyleName(c.style) << i;
        }
    }
}

TEST(ChatTemplate, RecognisesStyles) {
    const json golden = Golden();
    struct Case {
        const char* name;
        ChatTemplateStyle style;
    };
    for (const Case& c :
         {Case{"smollm2", ChatTemplateStyle::kChatMl}, Case{"llama2", ChatTemplateStyle::kLlama2},
          Case{"llama3", ChatTemplateStyle::kLlama3}}) {
        const json& t = golden["templates"][c.name];
        auto tmpl = ChatTemplate::FromJinja(t["jinja"].get<std::string>(), Tokens(t), "test");
        ASSERT_TRUE(tmpl.ok()) << c.name;
        EXPECT_EQ(tmpl->style(), c.style) << c.name;
    }
}

TEST(ChatTemplate, SmolLm2DefaultSystemPrompt) {
    const json golden = Golden();
    const json& t = golden["templates"]["smollm2"];
    auto tmpl = ChatTemplate::FromJinja(t["jinja"].get<std::string>(), Tokens(t), "test");
    ASSERT_TRUE(tmpl.ok());
    EXPECT_EQ(tmpl->default_system_prompt(),
              "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    EXPECT_EQ(tmpl->end_of_turn(), "<|im_end|>");
    // The same prompt written with Jinja "\n" escapes instead of real newlines (a whole
    // template: one the built-in style does not render alike is interpreted instead).
    auto escaped = ChatTemplate::FromJinja(
        "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nBe nice.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        {}, "test");
    ASSERT_TRUE(escaped.ok());
    EXPECT_FALSE(escaped->interpreted());
    EXPECT_EQ(escaped->default_system_prompt(), "Be nice.");
    // A plain ChatML template (no literal system turn) has none.
    auto plain = ChatTemplate::FromJinja(
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        {}, "test");
    ASSERT_TRUE(plain.ok());
    EXPECT_FALSE(plain->interpreted());
    EXPECT_EQ(plain->default_system_prompt(), "");
    EXPECT_EQ(*plain->Render({{"user", "x"}}, true),
              "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, BuiltInStylesHaveNoDefaultSystemPrompt) {
    ChatTemplate chatml = ChatTemplate::FromStyle(ChatTemplateStyle::kChatMl, {});
    EXPECT_EQ(*chatml.Render({{"user", "Hi"}}, false), "<|im_start|>user\nHi<|im_end|>\n");
    ChatTemplate llama3 = ChatTemplate::FromStyle(ChatTemplateStyle::kLlama3, {"<B>", "<E>"});
    EXPECT_EQ(*llama3.Render({{"user", "Hi"}}, false),
              "<B><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
    EXPECT_EQ(llama3.end_of_turn(), "<|eot_id|>");
    ChatTemplate llama2 = ChatTemplate::FromStyle(ChatTemplateStyle::kLlama2, {"<s>", "</s>"});
    EXPECT_EQ(llama2.end_of_turn(), "</s>");
}

TEST(ChatTemplate, Llama2RejectsRolesOutOfOrder) {
    ChatTemplate t = ChatTemplate::FromStyle(ChatTemplateStyle::kLlama2, {"<s>", "</s>"});
    const std::vector<std::vector<ChatMessage>> bad = {
        {{"assistant", "a"}},
        {{"user", "a"}, {"user", "b"}},
        {{"system", "s"}, {"assistant", "a"}},
        {{"user", "a"}, {"system", "s"}},
    };
    for (const auto& messages : bad) {
        auto r = t.Render(messages, true);
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
        EXPECT_NE(r.status().message().find("alternating"), std::string::npos);
    }
}

// Gemma 3's template (its Jinja, rendered by hand from the template's text): BOS, turns of
// "<start_of_turn>role\n...<end_of_turn>\n" with the assistant as "model", the system message
// opening the first user turn, content stripped; no tools.
TEST(ChatTemplate, GemmaStyle) {
    auto recognised = ChatTemplate::FromJinja(
        "{{ bos_token }}{%- for message in loop_messages -%}{{ '<start_of_turn>' + role + '\\n' "
        "}}{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}",
        {"<bos>", "<eos>"}, "test");
    ASSERT_TRUE(recognised.ok()) << recognised.status().ToString();
    EXPECT_EQ(recognised->style(), ChatTemplateStyle::kGemma);
    ChatTemplate t = ChatTemplate::FromStyle(ChatTemplateStyle::kGemma, {"<bos>", "<eos>"});
    EXPECT_EQ(t.end_of_turn(), "<end_of_turn>");
    EXPECT_EQ(*t.Render({{"system", "Be brief."}, {"user", " Hi \n"}, {"assistant", "Hello."},
                         {"user", "Bye"}},
                        true),
              "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
              "<start_of_turn>model\nHello.<end_of_turn>\n"
              "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
    auto out_of_order = t.Render({{"user", "a"}, {"user", "b"}}, true);
    ASSERT_FALSE(out_of_order.ok());
    EXPECT_NE(out_of_order.status().message().find("alternating"), std::string::npos);
    ChatTools tools;
    tools.prompt = "tools";
    auto with_tools = t.RenderChat({{"user", "a"}}, true, &tools);
    ASSERT_FALSE(with_tools.ok());
    EXPECT_NE(with_tools.status().message().find("Gemma"), std::string::npos);
    auto by_name = ResolveChatTemplate("", "gemma", {"<bos>", "<eos>"});
    ASSERT_TRUE(by_name.ok() && by_name->has_value());
    EXPECT_EQ((*by_name)->style(), ChatTemplateStyle::kGemma);
}

// Gemma 3's base GGUF files (models/gemma-3-270m-q4_k_m.gguf) carry no tokenizer.chat_template:
// the gemma3 architecture then chats in Gemma's turn format; other architectures get none, and
// the model's own template or an override still wins.
TEST(ResolveChatTemplate, GemmaArchitectureWithoutTemplateGetsGemmaTurns) {
    const ChatTemplateTokens tokens{"<bos>", "<eos>"};
    auto gemma = ResolveChatTemplate("", "", tokens, "gemma3");
    ASSERT_TRUE(gemma.ok()) << gemma.status().ToString();
    ASSERT_TRUE(gemma->has_value());
    EXPECT_EQ((*gemma)->style(), ChatTemplateStyle::kGemma);
    EXPECT_EQ(*(*gemma)->Render({{"user", "Hi"}}, true),
              "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
    EXPECT_EQ((*gemma)->end_of_turn(), "<end_of_turn>");
    for (const char* arch : {"llama", "mistral", "qwen2", "qwen3", ""}) {
        auto none = ResolveChatTemplate("", "", tokens, arch);
        ASSERT_TRUE(none.ok());
        EXPECT_FALSE(none->has_value()) << arch;
    }
    const std::string smol = Golden()["templates"]["smollm2"]["jinja"];
    auto own = ResolveChatTemplate(smol, "", tokens, "gemma3");
    ASSERT_TRUE(own.ok());
    EXPECT_EQ((*own)->style(), ChatTemplateStyle::kChatMl);
    auto named = ResolveChatTemplate("", "chatml", tokens, "gemma3");
    ASSERT_TRUE(named.ok());
    EXPECT_EQ((*named)->style(), ChatTemplateStyle::kChatMl);
}

// A template of no built-in style is run by the Jinja interpreter; one that does not parse is
// refused, naming where it came from and the position.
TEST(ChatTemplate, UnknownTemplateIsInterpreted) {
    auto Msg = [](std::string role, std::string content) {
        ChatMessage m;
        m.role = std::move(role);
        m.content = std::move(content);
        return m;
    };
    auto r = ChatTemplate::FromJinja("{{ bos_token }}{% for m in messages %}<|user|>{% endfor %}",
                                     {"<s>", "</s>"}, "the model's chat template");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->interpreted());
    EXPECT_EQ(*r->Render({Msg("user", "x"), Msg("assistant", "y")}, true), "<s><|user|><|user|>");
    EXPECT_FALSE(r->ToolCallStyle().ok());  // no family whose tool calls kvshard parses
    EXPECT_EQ(r->end_of_turn(), "</s>");
    // Mistral's [INST] without <<SYS>> is not Llama 2's format: interpreted, and this one fails
    // at render time as jinja2 would.
    auto mistral = ChatTemplate::FromJinja("{{ '[INST] ' + m['content'] + ' [/INST]' }}", {}, "x");
    ASSERT_TRUE(mistral.ok());
    auto failed = mistral->Render({Msg("user", "hi")}, true);
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("'m' is undefined"), std::string::npos);
    auto broken =
        ChatTemplate::FromJinja("{% for m in messages %}", {}, "the model's chat template");
    ASSERT_FALSE(broken.ok());
    EXPECT_EQ(broken.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(broken.status().message().find("the model's chat template"), std::string::npos);
    EXPECT_NE(broken.status().message().find("line 1"), std::string::npos);
}

TEST(ResolveChatTemplate, OverrideByNameOrFile) {
    const json golden = Golden();
    const std::string smol = golden["templates"]["smollm2"]["jinja"];
    // No override: the model's template; none at all: nullopt.
    auto model = ResolveChatTemplate(smol, "", {});
    ASSERT_TRUE(model.ok());
    ASSERT_TRUE(model->has_value());
    EXPECT_EQ((*model)->style(), ChatTemplateStyle::kChatMl);
    auto none = ResolveChatTemplate("", "", {});
    ASSERT_TRUE(none.ok());
    EXPECT_FALSE(none->has_value());
    // A style name wins over the model's template.
    auto named = ResolveChatTemplate(smol, "llama3", {});
    ASSERT_TRUE(named.ok());
    EXPECT_EQ((*named)->style(), ChatTemplateStyle::kLlama3);
    // A file with a Jinja template.
    testing::TempDir dir;
    testing::WriteFile(dir.File("t.jinja"),
                       golden["templates"]["llama2"]["jinja"].get<std::string>());
    auto file = ResolveChatTemplate("", dir.File("t.jinja"), {"<s>", "</s>"});
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ((*file)->style(), ChatTemplateStyle::kLlama2);
    // A file of an unknown shape and an unknown model template are interpreted; a file that
    // does not parse is refused naming it; a missing file is NotFound.
    testing::WriteFile(dir.File("odd.jinja"), "{{ messages }}");
    auto odd = ResolveChatTemplate("", dir.File("odd.jinja"), {});
    ASSERT_TRUE(odd.ok()) << odd.status().ToString();
    EXPECT_TRUE((*odd)->interpreted());
    testing::WriteFile(dir.File("bad.jinja"), "{{ messages ");
    auto bad = ResolveChatTemplate("", dir.File("bad.jinja"), {});
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("bad.jinja"), std::string::npos);
    EXPECT_EQ(ResolveChatTemplate("", dir.File("missing"), {}).status().code(),
              StatusCode::kNotFound);
    auto unknown = ResolveChatTemplate("{{ messages }}", "", {});
    ASSERT_TRUE(unknown.ok());
    EXPECT_TRUE((*unknown)->interpreted());
    // "jinja" interprets the model's own template, even one a built-in style renders alike.
    auto forced = ResolveChatTemplate(smol, "jinja", {});
    ASSERT_TRUE(forced.ok());
    EXPECT_TRUE((*forced)->interpreted());
    EXPECT_EQ((*forced)->style(), ChatTemplateStyle::kChatMl);
    EXPECT_FALSE((*model)->interpreted());
    EXPECT_EQ(ResolveChatTemplate("", "jinja", {}).status().code(), StatusCode::kNotFound);
}

std::string Joined(const RenderedChat& r) {
    std::string text;
    for (const TextPiece& p : r.pieces) text += p.text;
    return text;
}

ChatMessage Msg(std::string role, std::string content) {
    ChatMessage m;
    m.role = std::move(role);
    m.content = std::move(content);
    return m;
}

// The Hermes / Qwen 2.5 convention on ChatML: tools after the system prompt, calls after the
// assistant's content, consecutive tool results in one user turn.
TEST(ChatTemplateTools, ChatMlRendersTheHermesConvention) {
    const ChatTemplate t = ChatTemplate::FromStyle(ChatTemplateStyle::kChatMl, {"", "<|im_end|>"});
    ChatMessage call = Msg("assistant", "");
    call.tool_calls.push_back({"call_0", "get_weather", R"({"city":"Paris"})"});
    std::vector<ChatMessage> messages = {Msg("system", "S"), Msg("user", "Q"), call,
                                         Msg("tool", "18 C"), Msg("tool", "19 C")};
    messages[3].tool_call_id = "call_0";
    const ChatTools tools{"TOOLS", {}};
    auto r = t.RenderChat(messages, true, &tools);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(Joined(*r),
              "<|im_start|>system\nS\n\nTOOLS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
              "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
              "{\"city\":\"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
              "18 C\n</tool_response>\n<tool_response>\n19 C\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n");
    // The client's text (tools, call JSON, results) is literal; the markers are not.
    for (const TextPiece& p : r->pieces) {
        if (p.text.find("<|im_start|>") != std::string::npos) {
            EXPECT_FALSE(p.literal) << p.text;
        }
        if (p.text == "TOOLS") {
            EXPECT_TRUE(p.literal);
        }
    }
    // Without a system message the tools get a system turn of their own (after the template's
    // default system prompt, when it has one).
    auto bare = t.RenderChat({Msg("user", "Q")}, false, &tools);
    ASSERT_TRUE(bare.ok());
    EXPECT_EQ(Joined(*bare),
              "<|im_start|>system\nTOOLS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n");
}

TEST(ChatTemplateTools, Llama3PutsToolsInTheFirstUserMessage) {
    const ChatTemplate t =
        ChatTemplate::FromStyle(ChatTemplateStyle::kLlama3, {"<|begin_of_text|>", "<|eot_id|>"});
    ChatMessage call = Msg("assistant", "");
    call.tool_calls.push_back({"c", "add", R"({"a":1})"});
    const ChatTools tools{"TOOLS\n\n", {}};
    auto r = t.RenderChat({Msg("user", " Q "), call, Msg("tool", "2")}, false, &tools);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(Joined(*r),
              "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nTOOLS\n\nQ<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"add\", "
              "\"parameters\": {\"a\":1}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>"
              "\n\n2<|eot_id|>");
    EXPECT_FALSE(t.RenderChat({Msg("system", "S")}, true, &tools).ok());
}

TEST(ChatTemplateTools, Llama2HasNoToolConvention) {
    const ChatTemplate t = ChatTemplate::FromStyle(ChatTemplateStyle::kLlama2, {"<s>", "</s>"});
    const ChatTools tools{"TOOLS", {}};
    EXPECT_EQ(t.RenderChat({Msg("user", "Q")}, true, &tools).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_FALSE(t.RenderChat({Msg("user", "Q"), Msg("tool", "r")}, true, nullptr).ok());
    EXPECT_TRUE(t.RenderChat({Msg("user", "Q")}, true, nullptr).ok());
}

// A cache mark lands where its text ends in the rendered prompt, through the strip of Llama 2
// and 3 and the system prompt Llama 2 folds into the first user message.
TEST(ChatTemplateTools, CacheMarksFollowTheirText) {
    const ChatTemplateTokens tokens{"<s>", "</s>"};
    for (ChatTemplateStyle style :
         {ChatTemplateStyle::kChatMl, ChatTemplateStyle::kLlama2, ChatTemplateStyle::kLlama3}) {
        const ChatTemplate t = ChatTemplate::FromStyle(style, tokens);
        std::vector<ChatMessage> messages = {Msg("system", "sys prompt"),
                                             Msg("user", "  doc. question"),
                                             Msg("assistant", "answer")};
        messages[0].cache_marks = {{10, 1000}};
        messages[1].cache_marks = {{6, 2000}, {15, 3000}};  // after "  doc.", at the end
        messages[2].cache_marks = {{6, 4000}};
        auto r = t.RenderChat(messages, false, nullptr);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        const std::string text = Joined(*r);
        ASSERT_EQ(r->cache_marks.size(), 4u) << ChatTemplateStyleName(style);
        const std::vector<std::string> ends = {"sys prompt", "doc.", "question", "answer"};
        for (size_t i = 0; i < ends.size(); ++i) {
            const std::string prefix = text.substr(0, r->cache_marks[i].text_end);
            const std::string_view tail(prefix);
            EXPECT_TRUE(tail.size() >= ends[i].size() &&
                        tail.substr(tail.size() - ends[i].size()) == ends[i])
                << ChatTemplateStyleName(style) << " mark " << i << ": '" << prefix << "'";
            EXPECT_EQ(r->cache_marks[i].ttl_ms, 1000 * static_cast<int64_t>(i + 1));
        }
    }
    // Marks in the tools prompt and after a call.
    const ChatTemplate chatml = ChatTemplate::FromStyle(ChatTemplateStyle::kChatMl, {});
    ChatMessage call = Msg("assistant", "");
    call.tool_calls.push_back({"c", "add", "{}", 5000});
    const ChatTools tools{"TOOL1 TOOL2", {{5, 6000}}};
    auto r = chatml.RenderChat({Msg("user", "Q"), call, Msg("tool", "r")}, true, &tools);
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->cache_marks.size(), 2u);
    const std::string text = Joined(*r);
    EXPECT_EQ(text.substr(0, r->cache_marks[0].text_end), "<|im_start|>system\nTOOL1");
    EXPECT_EQ(text.substr(r->cache_marks[1].text_end - 12, 12), "</tool_call>");
}

TEST(ChatTemplate, DefaultModelTemplateIsChatMl) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "default model");
    // The GGUF's template is the one the golden file was rendered from.
    const json golden = Golden();
    auto gguf = GgufFile::Open(path);
    ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
    auto jinja = (*gguf)->GetString("tokenizer.chat_template");
    ASSERT_TRUE(jinja.ok()) << jinja.status().ToString();
    EXPECT_EQ(*jinja, golden["templates"]["smollm2"]["jinja"].get<std::string>());
    auto tmpl = ChatTemplate::FromJinja(*jinja, {}, "default model");
    ASSERT_TRUE(tmpl.ok());
    EXPECT_EQ(tmpl->style(), ChatTemplateStyle::kChatMl);
}

}  // namespace
}  // namespace kvshard
