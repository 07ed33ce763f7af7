// ShareGPT files (the reader, its errors, vLLM's length filter, seeded sampling, /tokenize as the
// counter), the per-request result file, and the TLS context's refusals.
#include "loadgen/sharegpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "loadgen/bench_report.h"
#include "loadgen/result_file.h"
#include "loadgen/tls.h"
#include "tests/coordinator/http_test_util.h"
#include "tests/test_util.h"

namespace kvshard::loadgen {
namespace {

using nlohmann::json;

json Turn(const std::string& from, const std::string& value) {
    return {{"from", from}, {"value", value}};
}

json Conversation(const std::string& id, std::vector<json> turns) {
    json list = json::array();
    for (json& t : turns) list.push_back(std::move(t));
    return {{"id", id}, {"conversations", std::move(list)}};
}

// Words as tokens: the fake counter's unit, so lengths are easy to write.
std::string Words(int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += i ? " w" : "w";
    return s;
}

int64_t CountWords(const std::string& s) {
    if (s.empty()) return 0;
    return 1 + static_cast<int64_t>(std::count(s.begin(), s.end(), ' '));
}

TokenCounter WordCounter(int* calls = nullptr) {
    return [calls](const std::string& text, bool) -> Result<int64_t> {
        if (calls) ++*calls;
        return CountWords(text);
    };
}

TEST(ShareGpt, ReadsTheFirstHumanTurnAndTheGptAnswerAfterIt) {
    const json file = json::array({
        Conversation("a", {Turn("human", "first question"), Turn("gpt", "first answer"),
                           Turn("human", "second question"), Turn("gpt", "second answer")}),
        Conversation("b", {Turn("system", "be brief"), Turn("human", "q"), Turn("gpt", "a")}),
        Conversation("c", {Turn("human", "alone")}),                   // no answer
        Conversation("d", {Turn("gpt", "hi"), Turn("human", "q")}),    // nothing after
        Conversation("e", {Turn("human", "q"), Turn("human", "q2")}),  // not a gpt turn
        Conversation("f", {}),                                         // empty
        json{{"conversations", json::array({Turn("human", "no id"), Turn("gpt", "fine")})}},
        // Fields the reader does not use, nested, with names it does use: skipped whole.
        json{{"meta", {{"conversations", 5}, {"from", 1}, {"list", {1, {{"value", 2}}}}}},
             {"conversations",
              json::array({json{{"from", "human"}, {"extra", {{"value", 3}}}, {"value", "nested"}},
                           json{{"tags", {"a", "b"}}, {"from", "gpt"}, {"value", "ok"}}})},
             {"after", {{"conversations", nullptr}}}},
    });
    auto parsed = ParseShareGpt(file.dump(), "f.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(parsed->num_entries, 8);
    ASSERT_EQ(parsed->pairs.size(), 4u);
    EXPECT_EQ(parsed->pairs[3].prompt, "nested");
    EXPECT_EQ(parsed->pairs[3].completion, "ok");
    EXPECT_EQ(parsed->pairs[3].entry, 7);
    EXPECT_EQ(parsed->pairs[0].prompt, "first question");
    EXPECT_EQ(parsed->pairs[0].completion, "first answer");
    EXPECT_EQ(parsed->pairs[0].entry, 0);
    EXPECT_EQ(parsed->pairs[1].prompt, "q");
    EXPECT_EQ(parsed->pairs[1].entry, 1);
    EXPECT_EQ(parsed->pairs[2].completion, "fine");
    EXPECT_EQ(parsed->pairs[2].entry, 6);
}

TEST(ShareGpt, MalformedFilesAreOneLineNamingTheFileEntryAndField) {
    const json good = Conversation("x", {Turn("human", "q"), Turn("gpt", "a")});
    struct Case {
        std::string text;
        std::string expected;  // a part of the message
    };
    const std::vector<Case> cases = {
        {"[{\"conversations\": [", "data.json: not JSON (byte "},
        {"", "data.json: not JSON"},
        {R"({"conversations": []})",
         "data.json: expected a JSON list of conversations, got object"},
        {json::array({good, 5}).dump(), "data.json: entry 1 is number, not an object"},
        {json::array({good, json{{"id", "x"}}}).dump(),
         "data.json: entry 1: 'conversations' is missing"},
        {json::array({json{{"conversations", "text"}}}).dump(),
         "data.json: entry 0: 'conversations' is string, not a list"},
        {json::array({json{{"conversations", json::array({Turn("human", "q"), "a"})}}}).dump(),
         "data.json: entry 0: conversations[1] is string, not an object"},
        {json::array({good, json{{"conversations", json::array({json{{"value", "q"}}})}}}).dump(),
         "data.json: entry 1: conversations[0].from is missing"},
        {json::array({json{{"conversations", json::array({json{{"from", 1}, {"value", "q"}}})}}})
             .dump(),
         "data.json: entry 0: conversations[0].from is number, not a string"},
        {json::array({json{{"conversations", json::array({json{{"from", "human"}}})}}}).dump(),
         "data.json: entry 0: conversations[0].value is missing"},
        {json::array(
             {json{{"conversations", json::array({json{{"from", "gpt"}, {"value", nullptr}}})}}})
             .dump(),
         "data.json: entry 0: conversations[0].value is null, not a string"},
        {"[]", "data.json: none of its 0 conversations has a \"human\" turn followed by a \"gpt\""},
        {json::array({Conversation("x", {Turn("gpt", "a")})}).dump(),
         "none of its 1 conversations"},
    };
    for (const Case& c : cases) {
        auto parsed = ParseShareGpt(c.text, "data.json");
        ASSERT_FALSE(parsed.ok()) << c.text;
        EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
        const std::string message = parsed.status().message();
        EXPECT_NE(message.find(c.expected), std::string::npos) << message;
        EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
}

TEST(ShareGpt, ReadsAFileAndNamesOneThatCannotBeOpened) {
    testing::TempDir dir;
    const json file =
        json::array({Conversation("x", {Turn("human", "hello there"), Turn("gpt", "hi")})});
    testing::WriteFile(dir.File("sharegpt.json"), file.dump());
    auto read = ReadShareGpt(dir.File("sharegpt.json"));
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(read->pairs[0].prompt, "hello there");
    testing::WriteFile(dir.File("cut.json"), file.dump().substr(0, 30));
    auto cut = ReadShareGpt(dir.File("cut.json"));
    ASSERT_FALSE(cut.ok());
    EXPECT_NE(cut.status().message().find(dir.File("cut.json") + ": not JSON (byte "),
              std::string::npos)
        << cut.status().message();
    auto missing = ReadShareGpt(dir.File("absent.json"));
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.status().message().find(dir.File("absent.json") + ": cannot open"),
              std::string::npos)
        << missing.status().message();
}

// vLLM's is_valid_sequence with its defaults: min 4, prompt <= 1024, total <= 2048.
TEST(ShareGpt, LengthFilterIsVllms) {
    struct Case {
        int64_t prompt, output;
        bool fixed, keep;
    };
    const std::vector<Case> cases = {
        {4, 4, false, true},        {3, 100, false, false},     {100, 3, false, false},
        {100, 3, true, true},       {3, 100, true, false},      {1024, 1024, false, true},
        {1025, 4, false, false},    {1024, 1025, false, false}, {1000, 1048, false, true},
        {1000, 1049, false, false}, {4, 2044, false, true},     {4, 2045, true, false},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(KeepShareGptPair(c.prompt, c.output, c.fixed), c.keep)
            << c.prompt << " + " << c.output << (c.fixed ? " fixed" : "");
    }
}

ShareGptFile MixedFile() {
    ShareGptFile f;
    for (int i = 0; i < 40; ++i) {
        // Every fourth pair has a 2-word prompt, every fifth a 1-word answer: filtered out.
        const int prompt_words = i % 4 == 0 ? 2 : 5 + i;
        const int answer_words = i % 5 == 0 ? 1 : 10 + i;
        f.pairs.push_back({Words(prompt_words), Words(answer_words), i});
    }
    f.num_entries = 40;
    return f;
}

TEST(ShareGpt, SamplesSeededKeepsOnlyValidPairsAndStopsAtNumPrompts) {
    const ShareGptFile file = MixedFile();
    ShareGptOptions o;
    o.num_prompts = 10;
    o.seed = 7;
    int calls = 0;
    auto a = SampleShareGpt(file, o, WordCounter(&calls));
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_EQ(a->prompts.size(), 10u);
    EXPECT_EQ(calls, 2 * a->measured);  // prompt and answer of each pair measured, no more
    EXPECT_LT(a->measured, 40);         // stopped once 10 were kept
    for (const BenchPrompt& p : a->prompts) {
        EXPECT_GE(p.prompt_tokens, 4);
        EXPECT_EQ(p.prompt_tokens, CountWords(p.text));
        EXPECT_GE(p.output_len, 4);
        EXPECT_TRUE(p.prefix.empty());
    }
    auto again = SampleShareGpt(file, o, WordCounter());
    for (size_t i = 0; i < a->prompts.size(); ++i)
        EXPECT_EQ(again->prompts[i].text, a->prompts[i].text);
    o.seed = 8;
    auto other = SampleShareGpt(file, o, WordCounter());
    std::vector<std::string> first, second;
    for (const auto& p : a->prompts) first.push_back(p.text);
    for (const auto& p : other->prompts) second.push_back(p.text);
    EXPECT_NE(first, second);

    // All 40: the valid ones only (30 with prompts of 5+ words, less those with 1-word answers).
    o.num_prompts = 1000;
    auto all = SampleShareGpt(file, o, WordCounter());
    ASSERT_TRUE(all.ok());
    EXPECT_EQ(all->measured, 40);
    EXPECT_EQ(all->prompts.size(), 24u);  // i % 4 != 0 and i % 5 != 0: 40 - 10 - 8 + 2
    std::set<int64_t> outputs;
    for (const auto& p : all->prompts) outputs.insert(p.output_len);
    EXPECT_EQ(outputs.size(), 24u);  // each answer's own length

    // A fixed output length: answers are not measured and their minimum is not applied.
    o.output_len = 2;
    calls = 0;
    auto fixed = SampleShareGpt(file, o, WordCounter(&calls));
    ASSERT_TRUE(fixed.ok());
    EXPECT_EQ(fixed->prompts.size(), 30u);
    EXPECT_EQ(calls, 40);
    for (const auto& p : fixed->prompts) EXPECT_EQ(p.output_len, 2);
}

TEST(ShareGpt, SamplingErrors) {
    const ShareGptFile file = MixedFile();
    ShareGptOptions o;
    o.num_prompts = 0;
    EXPECT_FALSE(SampleShareGpt(file, o, WordCounter()).ok());
    o.num_prompts = 5;
    auto failing = [](const std::string&, bool) -> Result<int64_t> {
        return Status(StatusCode::kUnavailable, "POST /tokenize: HTTP 404");
    };
    auto down = SampleShareGpt(file, o, failing);
    ASSERT_FALSE(down.ok());
    EXPECT_NE(down.status().message().find("/tokenize"), std::string::npos);
    ShareGptFile tiny;
    tiny.pairs.push_back({"a b", "c d e f", 0});
    auto none = SampleShareGpt(tiny, o, WordCounter());
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.status().message().find("length filter"), std::string::npos);
}

// The counter used for real runs: the server's own /tokenize (the test server's tokenizer is
// one token per byte).
TEST(ShareGpt, CountsWithTheServersTokenize) {
    testing::TestServer server;
    auto url = ParseBaseUrl("http://127.0.0.1:" + std::to_string(server.port()));
    ASSERT_TRUE(url.ok());
    TokenCounter count = ServerTokenCounter(*url, "test-model", "", 30);
    auto n = count("hello world", false);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(*n, 11);
    auto wrong = ServerTokenCounter(*url, "no-such-model", "", 30)("hello", true);
    ASSERT_FALSE(wrong.ok());
    EXPECT_NE(wrong.status().message().find("HTTP 404"), std::string::npos)
        << wrong.status().message();
}

RequestOutcome Outcome(bool ok, double start, double ttft, std::vector<double> itl,
                       int64_t tokens) {
    RequestOutcome o;
    o.ok = ok;
    o.start_s = start;
    o.ttft_s = ttft;
    o.itl_s = std::move(itl);
    double e2e = ttft;
    for (double gap : o.itl_s) e2e += gap;
    o.e2e_s = e2e + 0.001;
    o.output_tokens = tokens;
    o.prompt_tokens = 9;
    if (!ok) o.error = "HTTP 429: busy";
    return o;
}

// The result file holds what the report is computed from: its percentiles come back from it.
TEST(ResultFile, OneLinePerRequestFromWhichTheReportIsRecomputed) {
    BenchRun run;
    run.model = "m";
    run.duration_s = 2;
    run.outcomes = {Outcome(true, 0.0, 0.020, {0.003, 0.004, 0.010}, 4),
                    Outcome(true, 0.1, 0.050, {0.002}, 2), Outcome(true, 0.2, 0.030, {}, 1),
                    Outcome(false, 0.3, 0, {}, 0), Outcome(true, 0.4, 0.090, {0.020, 0.001}, 3)};
    std::vector<BenchPrompt> prompts(run.outcomes.size());
    for (size_t i = 0; i < prompts.size(); ++i) prompts[i].output_len = 4;
    prompts[1].prompt_tokens = 12;
    testing::TempDir dir;
    const std::string path = dir.File("results.jsonl");
    ASSERT_TRUE(WriteResultFile(path, prompts, run).ok());

    std::istringstream lines(testing::ReadFile(path));
    std::string line;
    std::vector<json> rows;
    while (std::getline(lines, line)) rows.push_back(json::parse(line));
    ASSERT_EQ(rows.size(), 5u);
    std::vector<double> ttft, tpot, itl, e2el;
    for (size_t i = 0; i < rows.size(); ++i) {
        const json& r = rows[i];
        EXPECT_EQ(r["index"], i);
        EXPECT_EQ(r["max_tokens"], 4);
        EXPECT_EQ(r["prompt_tokens"], 9);
        if (!r["ok"].get<bool>()) continue;
        ttft.push_back(r["ttft_ms"]);
        e2el.push_back(r["e2el_ms"]);
        if (!r["tpot_ms"].is_null()) tpot.push_back(r["tpot_ms"]);
        for (double gap : r["itl_ms"]) itl.push_back(gap);
    }
    EXPECT_EQ(rows[1]["dataset_prompt_tokens"], 12);
    EXPECT_TRUE(rows[0]["dataset_prompt_tokens"].is_null());
    EXPECT_DOUBLE_EQ(rows[1]["start_ms"].get<double>(), 100.0);
    EXPECT_TRUE(rows[2]["tpot_ms"].is_null());  // one token: no TPOT
    EXPECT_FALSE(rows[3]["ok"].get<bool>());
    EXPECT_EQ(rows[3]["error"], "HTTP 429: busy");
    EXPECT_TRUE(rows[3]["ttft_ms"].is_null());
    EXPECT_TRUE(rows[0]["error"].is_null());

    const BenchReport report = MakeReport(run, {});
    auto same = [](const Distribution& a, const Distribution& b) {
        EXPECT_EQ(a.count, b.count);
        EXPECT_NEAR(a.mean, b.mean, 1e-9);
        EXPECT_NEAR(a.median, b.median, 1e-9);
        EXPECT_NEAR(a.p90, b.p90, 1e-9);
        EXPECT_NEAR(a.p99, b.p99, 1e-9);
    };
    same(Summarize(ttft), report.ttft_ms);
    same(Summarize(tpot), report.tpot_ms);
    same(Summarize(itl), report.itl_ms);
    same(Summarize(e2el), report.e2el_ms);

    auto unwritable = WriteResultFile(dir.File("no/such/dir/r.jsonl"), prompts, run);
    ASSERT_FALSE(unwritable.ok());
    EXPECT_NE(unwritable.message().find("--result-file"), std::string::npos);
}

TEST(Tls, ContextRefusesAFileThatIsNotACertificate) {
    testing::TempDir dir;
    testing::WriteFile(dir.File("ca.pem"), "not a certificate\n");
    auto bad = MakeTlsContext({false, dir.File("ca.pem")});
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("--ca-cert " + dir.File("ca.pem")), std::string::npos)
        << bad.status().message();
    EXPECT_TRUE(MakeTlsContext({}).ok());
    EXPECT_TRUE(MakeTlsContext({true, ""}).ok());
}

// https against a plain-HTTP port: the handshake fails, in one line, before any request is sent.
TEST(Tls, HandshakeFailureIsOneLineBeforeTheRun) {
    testing::TestServer server;
    auto url = ParseBaseUrl("https://127.0.0.1:" + std::to_string(server.port()));
    ASSERT_TRUE(url.ok());
    url->tls = *MakeTlsContext({});
    BenchOptions o;
    o.url = *url;
    o.model = "test-model";
    auto run = RunBench(o, {BenchPrompt{"", "x", 1, 1}});
    ASSERT_FALSE(run.ok());
    const std::string message = run.status().message();
    EXPECT_NE(message.find("https://127.0.0.1:"), std::string::npos) << message;
    EXPECT_NE(message.find("TLS handshake failed"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_TRUE(server.engine().submitted().empty());
}

}  // namespace
}  // namespace kvshard::loadgen
