// libFuzzer target for the chat-template renderer (model/chat_template.h). The first byte picks
// the style and add_generation_prompt; then each message is a role byte, a length byte and that
// many content bytes. Rendering must not crash; the pieces must join to Render()'s text and
// alternate markup and content; and encoding the pieces as all markup must give the ids of
// Encode(text), while encoding them as rendered never turns content into a control token.
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/fuzz/fuzz_util.h"
#include "model/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    if (size == 0) return 0;
    static const std::unique_ptr<Tokenizer> tokenizer = fuzz::ByteTokenizer();
    static const ChatTemplateStyle kStyles[] = {
        ChatTemplateStyle::kChatMl, ChatTemplateStyle::kLlama2, ChatTemplateStyle::kLlama3};
    static const char* kRoles[] = {"system", "user", "assistant"};
    const ChatTemplateStyle style = kStyles[(data[0] & 3) % 3];
    const bool add_generation_prompt = (data[0] & 4) != 0;
    const ChatTemplateTokens tokens = (data[0] & 8) != 0
                                          ? ChatTemplateTokens{"<|im_start|>", "<|im_end|>"}
                                          : ChatTemplateTokens{"<s>", "</s>"};
    std::vector<ChatMessage> messages;
    size_t pos = 1;
    while (pos + 2 <= size && messages.size() < 16) {
        const char* role = kRoles[data[pos] % 3];
        const size_t len = std::min<size_t>(data[pos + 1], size - pos - 2);
        messages.push_back({role, std::string(reinterpret_cast<const char*>(data) + pos + 2, len)});
        pos += 2 + len;
    }
    const ChatTemplate tmpl = ChatTemplate::FromStyle(style, tokens);
    Result<std::string> text = tmpl.Render(messages, add_generation_prompt);
    Result<std::vector<TextPiece>> pieces = tmpl.RenderPieces(messages, add_generation_prompt);
    KVSHARD_FUZZ_CHECK(text.ok() == pieces.ok());
    if (!text.ok()) return 0;
    std::string joined;
    for (size_t i = 0; i < pieces->size(); ++i) {
        KVSHARD_FUZZ_CHECK(!(*pieces)[i].text.empty());
        if (i > 0) KVSHARD_FUZZ_CHECK((*pieces)[i].literal != (*pieces)[i - 1].literal);
        joined += (*pieces)[i].text;
    }
    KVSHARD_FUZZ_CHECK(joined == *text);

    EncodeOptions special;
    special.parse_special = true;
    std::vector<TextPiece> markup = *pieces;
    for (TextPiece& p : markup) p.literal = false;
    KVSHARD_FUZZ_CHECK(tokenizer->EncodePieces(markup, special) ==
                       tokenizer->Encode(*text, special));
    // As rendered: every control token comes from the markup, so there are exactly as many as
    // the markup alone holds (each markup piece is a run of its own).
    const std::vector<int32_t> ids = tokenizer->EncodePieces(*pieces, special);
    size_t controls = 0, markup_controls = 0;
    for (int32_t id : ids) controls += id >= 256;
    for (const TextPiece& p : *pieces) {
        if (p.literal) continue;
        for (int32_t id : tokenizer->Encode(p.text, special)) markup_controls += id >= 256;
    }
    KVSHARD_FUZZ_CHECK(controls == markup_controls);
    return 0;
}
