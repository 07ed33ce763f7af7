// The load generator: datasets, SSE parsing, URL and SLO parsing, statistics, and a whole run
// against the FakeEngine-backed HTTP server.
#include <gtest/gtest.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <atomic>
#include <cmath>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "loadgen/bench_report.h"
#include "loadgen/bench_runner.h"
#include "loadgen/dataset.h"
#include "loadgen/sse_parser.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard::loadgen {
namespace {

using nlohmann::json;

int64_t CountWords(const std::string& s) {
    if (s.empty()) return 0;
    return 1 + static_cast<int64_t>(std::count(s.begin(), s.end(), ' '));
}

TEST(Dataset, RandomLengthsAndDeterminism) {
    DatasetOptions o;
    o.num_requests = 50;
    o.input_len = 20;
    o.output_len = 10;
    o.range_ratio = 0.5;
    o.seed = 3;
    auto a = MakeDataset(o);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_EQ(a->size(), 50u);
    std::set<int64_t> input_lens;
    for (const BenchPrompt& p : *a) {
        EXPECT_EQ(CountWords(p.text), p.num_words);
        EXPECT_GE(p.num_words, 10);
        EXPECT_LE(p.num_words, 30);
        EXPECT_GE(p.output_len, 5);
        EXPECT_LE(p.output_len, 15);
        EXPECT_TRUE(p.prefix.empty());
        input_lens.insert(p.num_words);
    }
    EXPECT_GT(input_lens.size(), 3u);  // lengths vary
    auto b = MakeDataset(o);
    for (size_t i = 0; i < a->size(); ++i) EXPECT_EQ((*a)[i].text, (*b)[i].text);
    o.seed = 4;
    EXPECT_NE(MakeDataset(o)->front().text, a->front().text);
    o.range_ratio = 0;
    auto fixed = MakeDataset(o);
    ASSERT_TRUE(fixed.ok());
    for (const BenchPrompt& p : *fixed) {
        EXPECT_EQ(p.num_words, 20);
        EXPECT_EQ(p.output_len, 10);
    }
}

TEST(Dataset, SharedPrefixGroups) {
    DatasetOptions o;
    o.kind = DatasetKind::kSharedPrefix;
    o.num_requests = 12;
    o.num_groups = 3;
    o.prefix_len = 40;
    o.suffix_len = 5;
    auto d = MakeDataset(o);
    ASSERT_TRUE(d.ok());
    std::set<std::string> prefixes;
    for (size_t i = 0; i < d->size(); ++i) {
        const BenchPrompt& p = (*d)[i];
        EXPECT_EQ(CountWords(p.prefix), 40);
        EXPECT_EQ(CountWords(p.text), 5);
        EXPECT_EQ(p.prefix, (*d)[i % 3].prefix);  // round-robin over the groups
        prefixes.insert(p.prefix);
    }
    EXPECT_EQ(prefixes.size(), 3u);
}

TEST(Dataset, ChatLengthsAreSkewed) {
    DatasetOptions o;
    o.kind = DatasetKind::kChat;
    o.num_requests = 400;
    o.input_len = 100;
    o.output_len = 50;
    auto d = MakeDataset(o);
    ASSERT_TRUE(d.ok());
    std::vector<double> inputs;
    for (const BenchPrompt& p : *d) {
        EXPECT_GE(p.num_words, 4);
        EXPECT_LE(p.num_words, 800);
        EXPECT_GE(p.output_len, 1);
        EXPECT_LE(p.output_len, 400);
        inputs.push_back(static_cast<double>(p.num_words));
    }
    const Distribution s = Summarize(inputs);
    EXPECT_NEAR(s.median, 100, 25);  // the median is the option
    EXPECT_GT(s.mean, s.median);     // a long tail of long prompts
}

TEST(Dataset, BadOptions) {
    DatasetOptions o;
    o.num_requests = 0;
    EXPECT_FALSE(MakeDataset(o).ok());
    o = {};
    o.range_ratio = 1.0;
    EXPECT_NE(MakeDataset(o).status().message().find("--range-ratio"), std::string::npos);
    EXPECT_FALSE(ParseDatasetKind("burstgpt").ok());
    EXPECT_EQ(*ParseDatasetKind("sharegpt"), DatasetKind::kShareGpt);
    o = {};
    o.kind = DatasetKind::kShareGpt;  // read from a file, not generated
    EXPECT_NE(MakeDataset(o).status().message().find("--dataset-path"), std::string::npos);
    EXPECT_EQ(*ParseDatasetKind("shared-prefix"), DatasetKind::kSharedPrefix);
}

TEST(SseParser, SplitsEventsAcrossReads) {
    SseParser p;
    EXPECT_TRUE(p.Feed("data: {\"a\"").empty());
    auto e = p.Feed(":1}\n\ndata: [DO");
    ASSERT_EQ(e.size(), 1u);
    EXPECT_EQ(e[0], "{\"a\":1}");
    e = p.Feed("NE]\r\n\r\n: comment\n\nevent: x\ndata: a\ndata: b\n\n");
    ASSERT_EQ(e.size(), 2u);
    EXPECT_EQ(e[0], "[DONE]");
    EXPECT_EQ(e[1], "a\nb");
}

TEST(BaseUrl, Parse) {
    auto u = ParseBaseUrl("http://127.0.0.1:8080/v1/");
    ASSERT_TRUE(u.ok());
    EXPECT_EQ(u->host, "127.0.0.1");
    EXPECT_EQ(u->port, "8080");
    EXPECT_EQ(u->prefix, "");
    auto p = ParseBaseUrl("http://localhost/proxy/v1");
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->port, "80");
    EXPECT_EQ(p->prefix, "/proxy");
    auto s = ParseBaseUrl("https://example.com/v1");
    ASSERT_TRUE(s.ok());
    EXPECT_TRUE(s->https);
    EXPECT_EQ(s->port, "443");
    EXPECT_EQ(UrlText(*s), "https://example.com:443");
    EXPECT_FALSE(ParseBaseUrl("ftp://x:1").ok());
    EXPECT_FALSE(ParseBaseUrl("http://:80").ok());
    EXPECT_FALSE(ParseBaseUrl("http://h:port").ok());
}

TEST(Slo, Parse) {
    auto s = ParseSlo("ttft_ms=200,tpot_ms=12.5");
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*s->ttft_ms, 200);
    EXPECT_EQ(*s->tpot_ms, 12.5);
    EXPECT_FALSE(s->e2el_ms);
    EXPECT_TRUE(ParseSlo("")->empty());
    EXPECT_FALSE(ParseSlo("ttft=1").ok());
    EXPECT_FALSE(ParseSlo("ttft_ms=-1").ok());
    EXPECT_FALSE(ParseSlo("ttft_ms").ok());
}

TEST(Stats, PercentilesInterpolate) {
    const Distribution d = Summarize({4, 1, 3, 2, 5, 6, 7, 8, 9, 10});
    EXPECT_DOUBLE_EQ(d.mean, 5.5);
    EXPECT_DOUBLE_EQ(d.median, 5.5);
    EXPECT_DOUBLE_EQ(d.p90, 9.1);
    EXPECT_DOUBLE_EQ(d.p99, 9.91);
    EXPECT_EQ(Summarize({}).count, 0);
}

TEST(Report, TpotGoodputAndThroughput) {
    BenchRun run;
    run.model = "m";
    run.duration_s = 2.0;
    RequestOutcome fast;
    fast.ok = true;
    fast.ttft_s = 0.1;
    fast.e2e_s = 1.0;  // 9 tokens after the first in 0.9 s: TPOT 100 ms
    fast.itl_s = std::vector<double>(9, 0.1);
    fast.output_tokens = 10;
    fast.prompt_tokens = 20;
    RequestOutcome slow = fast;
    slow.ttft_s = 0.5;
    RequestOutcome failed;
    failed.error = "HTTP 500";
    run.outcomes = {fast, slow, failed};
    Slo slo;
    slo.ttft_ms = 200;
    const BenchReport r = MakeReport(run, slo);
    EXPECT_EQ(r.completed, 2);
    EXPECT_EQ(r.failed, 1);
    EXPECT_EQ(r.first_errors, std::vector<std::string>{"HTTP 500"});
    EXPECT_EQ(r.total_output_tokens, 20);
    EXPECT_EQ(r.total_input_tokens, 40);
    EXPECT_DOUBLE_EQ(r.request_throughput, 1.0);
    EXPECT_DOUBLE_EQ(r.output_throughput, 10.0);
    ASSERT_TRUE(r.goodput.has_value());
    EXPECT_DOUBLE_EQ(*r.goodput, 0.5);  // only the fast one meets TTFT <= 200 ms
    EXPECT_NEAR(r.tpot_ms.mean, (0.9 / 9 * 1e3 + 0.5 / 9 * 1e3) / 2, 1e-9);
    EXPECT_EQ(r.itl_ms.count, 18);
    EXPECT_DOUBLE_EQ(r.ttft_ms.median, 300);
    const json j = json::parse(ReportJson(r));
    EXPECT_EQ(j["completed"], 2);
    EXPECT_DOUBLE_EQ(j["goodput"].get<double>(), 0.5);
    EXPECT_DOUBLE_EQ(j["ttft_ms"]["median"].get<double>(), 300);
    EXPECT_NE(ReportText(r).find("Goodput (req/s):"), std::string::npos);
}

TEST(RequestBody, CompletionsAndChat) {
    BenchPrompt p{"shared words", "own words", 4, 7};
    const json c = json::parse(RequestBody(ApiKind::kCompletions, "m", p, 0));
    EXPECT_EQ(c["prompt"], "shared words own words");
    EXPECT_EQ(c["max_tokens"], 7);
    EXPECT_EQ(c["ignore_eos"], true);
    EXPECT_EQ(c["stream"], true);
    EXPECT_EQ(c["stream_options"]["include_usage"], true);
    const json chat = json::parse(RequestBody(ApiKind::kChat, "m", p, 0));
    EXPECT_EQ(chat["messages"][0]["role"], "system");
    EXPECT_EQ(chat["messages"][0]["content"], "shared words");
    EXPECT_EQ(chat["messages"][1]["content"], "own words");
}

// A whole run against the HTTP server in front of the FakeEngine.
TEST(Bench, RunsAgainstTheFakeServer) {
    testing::TestServer server;
    BenchOptions o;
    o.url = *ParseBaseUrl("http://127.0.0.1:" + std::to_string(server.port()) + "/v1");
    o.max_concurrency = 4;
    for (ApiKind api : {ApiKind::kCompletions, ApiKind::kChat}) {
        o.api = api;
        DatasetOptions d;
        d.num_requests = 12;
        d.input_len = 6;
        d.output_len = 5;
        auto prompts = MakeDataset(d);
        ASSERT_TRUE(prompts.ok());
        auto run = RunBench(o, *prompts);  // the model is asked of /v1/models
        ASSERT_TRUE(run.ok()) << run.status().ToString();
        EXPECT_EQ(run->model, "test-model");
        ASSERT_EQ(run->outcomes.size(), 12u);
        for (const RequestOutcome& r : run->outcomes) {
            EXPECT_TRUE(r.ok) << r.error;
            EXPECT_EQ(r.output_tokens, 5);  // from usage
            EXPECT_GT(r.prompt_tokens, 0);
            EXPECT_EQ(r.itl_s.size(), 4u);  // five text chunks
            EXPECT_GT(r.ttft_s, 0);
            EXPECT_GE(r.e2e_s, r.ttft_s);
        }
        Slo generous;
        generous.ttft_ms = 1e6;
        const BenchReport report = MakeReport(*run, generous);
        EXPECT_EQ(report.completed, 12);
        EXPECT_EQ(report.total_output_tokens, 60);
        EXPECT_GT(report.output_throughput, 0);
        EXPECT_DOUBLE_EQ(*report.goodput, report.request_throughput);
    }
    // Every request asked for ignore_eos and its output length.
    for (const GenerationRequest& g : server.engine().submitted()) {
        EXPECT_TRUE(g.ignore_eos);
        EXPECT_EQ(g.max_tokens, 5);
        EXPECT_EQ(g.sampling.temperature, 0.0f);
    }
}

TEST(Bench, PoissonArrivalsAndFailures) {
    testing::TestServerOptions options;
    options.engine.max_active = 2;  // the rest get 429
    testing::TestServer server(options);
    BenchOptions o;
    o.url = *ParseBaseUrl("http://127.0.0.1:" + std::to_string(server.port()));
    o.model = "test-model";
    o.request_rate = 1000;  // a Poisson schedule, quick enough for a test
    DatasetOptions d;
    d.num_requests = 20;
    d.input_len = 4;
    d.output_len = 3;
    auto run = RunBench(o, *MakeDataset(d));
    ASSERT_TRUE(run.ok());
    int ok = 0;
    for (const RequestOutcome& r : run->outcomes) {
        if (r.ok) {
            ++ok;
        } else {
            EXPECT_NE(r.error.find("HTTP 429"), std::string::npos) << "[" << r.error << "]";
        }
    }
    EXPECT_GE(ok, 2);
    // Start times follow the schedule: increasing, not all at zero.
    EXPECT_GT(run->outcomes.back().start_s, run->outcomes.front().start_s);

    o.model = "no-such-model";
    auto bad = RunBench(o, *MakeDataset(d));
    ASSERT_TRUE(bad.ok());
    EXPECT_NE(bad->outcomes[0].error.find("HTTP 404"), std::string::npos)
        << "[" << bad->outcomes[0].error << "]";
}

TEST(Bench, UnreachableServer) {
    BenchOptions o;
    o.url = *ParseBaseUrl("http://127.0.0.1:1");
    auto run = RunBench(o, {BenchPrompt{"", "x", 1, 1}});
    EXPECT_FALSE(run.ok());  // /v1/models cannot be asked
    o.model = "m";
    auto direct = RunBench(o, {BenchPrompt{"", "x", 1, 1}});
    ASSERT_TRUE(direct.ok());
    EXPECT_FALSE(direct->outcomes[0].ok);
    EXPECT_NE(direct->outcomes[0].error.find("connect"), std::string::npos);
}

TEST(RequestBody, MessagesAndCachePrefix) {
    BenchPrompt p{"shared words", "own words", 4, 7};
    const json m = json::parse(RequestBody(ApiKind::kMessages, "m", p, 0, /*cache_prefix=*/true));
    EXPECT_EQ(m["max_tokens"], 7);
    EXPECT_EQ(m["stream"], true);
    EXPECT_FALSE(m.contains("ignore_eos"));  // not Anthropic's
    EXPECT_EQ(m["system"][0]["text"], "shared words");
    EXPECT_EQ(m["system"][0]["cache_control"]["type"], "ephemeral");
    EXPECT_EQ(m["messages"][0]["role"], "user");
    EXPECT_EQ(m["messages"][0]["content"], "own words");
    EXPECT_FALSE(json::parse(RequestBody(ApiKind::kMessages, "m", p, 0))["system"][0].contains(
        "cache_control"));
    const json chat = json::parse(RequestBody(ApiKind::kChat, "m", p, 0, true));
    EXPECT_EQ(chat["messages"][0]["cache_control"]["type"], "ephemeral");
    EXPECT_FALSE(chat["messages"][1].contains("cache_control"));
    EXPECT_EQ(ApiPath(ApiKind::kMessages), "/v1/messages");
}

// A server that answers every POST with one canned response and keeps the requests it read.
class CannedServer {
  public:
    explicit CannedServer(std::string response)
        : response_(std::move(response)), acceptor_(io_, {boost::asio::ip::make_address("127.0.0.1"), 0}) {
        thread_ = std::thread([this] { Serve(); });
    }
    ~CannedServer() {
        // A blocking accept() is not woken by close() from another thread: connect once more.
        stopping_ = true;
        boost::system::error_code ignored;
        boost::asio::io_context io;
        boost::asio::ip::tcp::socket wake(io);
        wake.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port())},
                     ignored);
        thread_.join();
    }
    int port() const { return acceptor_.local_endpoint().port(); }
    std::vector<std::string> requests() {
        std::lock_guard<std::mutex> lock(mu_);
        return requests_;
    }

  private:
    void Serve() {
        for (;;) {
            boost::asio::ip::tcp::socket socket(io_);
            boost::system::error_code ec;
            acceptor_.accept(socket, ec);
            if (ec || stopping_) return;
            boost::asio::streambuf buf;
            const size_t head = boost::asio::read_until(socket, buf, "\r\n\r\n", ec);
            if (ec) continue;
            std::string text(boost::asio::buffers_begin(buf.data()),
                             boost::asio::buffers_end(buf.data()));
            const std::string headers = text.substr(0, head);
            const size_t at = headers.find("Content-Length: ");
            const size_t length = at == std::string::npos ? 0 : std::stoul(headers.substr(at + 16));
            while (text.size() < head + length) {
                char more[4096];
                const size_t n = socket.read_some(boost::asio::buffer(more), ec);
                if (ec) break;
                text.append(more, n);
            }
            {
                std::lock_guard<std::mutex> lock(mu_);
                requests_.push_back(text);
            }
            boost::asio::write(socket, boost::asio::buffer(response_), ec);
            socket.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
        }
    }

    std::string response_;
    std::atomic<bool> stopping_{false};
    boost::asio::io_context io_;
    boost::asio::ip::tcp::acceptor acceptor_;
    std::thread thread_;
    std::mutex mu_;
    std::vector<std::string> requests_;
};

// Anthropic's event sequence: usage (with the cache fields) in message_start, text in
// content_block_delta, output tokens in message_delta, the end in message_stop (no [DONE]).
TEST(Bench, ReadsAnthropicMessagesStreamsAndCacheUsage) {
    std::string events;
    auto event = [&](const std::string& type, const json& data) {
        events += "event: " + type + "\ndata: " + data.dump() + "\n\n";
    };
    event("message_start",
          {{"type", "message_start"},
           {"message",
            {{"id", "msg_1"},
             {"usage",
              {{"input_tokens", 10}, {"cache_read_input_tokens", 2000},
               {"cache_creation_input_tokens", 16}, {"output_tokens", 0}}}}}});
    event("content_block_start", {{"type", "content_block_start"}, {"index", 0}});
    event("ping", {{"type", "ping"}});
    for (const char* piece : {"Once", " upon", " a"}) {
        event("content_block_delta", {{"type", "content_block_delta"},
                                      {"index", 0},
                                      {"delta", {{"type", "text_delta"}, {"text", piece}}}});
    }
    event("content_block_stop", {{"type", "content_block_stop"}, {"index", 0}});
    event("message_delta", {{"type", "message_delta"},
                            {"delta", {{"stop_reason", "max_tokens"}}},
                            {"usage", {{"output_tokens", 3}}}});
    event("message_stop", {{"type", "message_stop"}});
    auto response = [](const std::string& body) {
        return "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: " +
               std::to_string(body.size()) + "\r\n\r\n" + body;
    };
    CannedServer server(response(events));

    BenchOptions o;
    o.url = *ParseBaseUrl("http://127.0.0.1:" + std::to_string(server.port()));
    o.model = "m";
    o.api = ApiKind::kMessages;
    o.cache_prefix = true;
    auto run = RunBench(o, {BenchPrompt{"system words", "x", 3, 3}, BenchPrompt{"system words", "y", 3, 3}});
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    for (const RequestOutcome& r : run->outcomes) {
        EXPECT_TRUE(r.ok) << r.error;
        EXPECT_EQ(r.output_tokens, 3);
        EXPECT_EQ(r.prompt_tokens, 2026);
        EXPECT_EQ(r.cached_tokens, 2000);
        EXPECT_EQ(r.cache_creation_tokens, 16);
        EXPECT_EQ(r.itl_s.size(), 2u);
    }
    const BenchReport report = MakeReport(*run, {});
    EXPECT_EQ(report.total_cached_tokens, 4000);
    EXPECT_EQ(report.total_cache_creation_tokens, 32);
    EXPECT_EQ(report.requests_with_cache_read, 2);
    EXPECT_NE(ReportText(report).find("Prompt tokens read from cache:"), std::string::npos);
    EXPECT_EQ(json::parse(ReportJson(report))["cached_tokens"], 4000);
    const std::vector<std::string> seen = server.requests();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_NE(seen[0].find("POST /v1/messages "), std::string::npos);
    EXPECT_NE(seen[0].find("anthropic-version: 2023-06-01"), std::string::npos);
    const json body = json::parse(seen[0].substr(seen[0].find("\r\n\r\n") + 4));
    EXPECT_EQ(body["system"][0]["cache_control"]["type"], "ephemeral");

    // Without the end event the request failed, whatever came before.
    CannedServer cut(response(events.substr(0, events.find("event: message_stop"))));
    o.url = *ParseBaseUrl("http://127.0.0.1:" + std::to_string(cut.port()));
    auto cut_run = RunBench(o, {BenchPrompt{"system words", "x", 3, 3}});
    ASSERT_TRUE(cut_run.ok());
    EXPECT_FALSE(cut_run->outcomes[0].ok);
    EXPECT_NE(cut_run->outcomes[0].error.find("message_stop"), std::string::npos);
}

}  // namespace
}  // namespace kvshard::loadgen
