#include "loadgen/http_client.h"

#include <algorithm>
#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "loadgen/sse_parser.h"

namespace kvshard::loadgen {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

Result<BaseUrl> ParseBaseUrl(std::string_view url) {
    constexpr std::string_view kScheme = "http://";
    if (url.substr(0, kScheme.size()) != kScheme) {
        return InvalidArgument(
            "--base-url must start with http:// (https is not supported), got '" +
            std::string(url) + "'");
    }
    std::string_view rest = url.substr(kScheme.size());
    const size_t slash = rest.find('/');
    std::string_view authority = rest.substr(0, slash);
    std::string prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash));
    while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
    if (prefix.size() >= 3 && prefix.compare(prefix.size() - 3, 3, "/v1") == 0) {
        prefix.resize(prefix.size() - 3);
    }
    BaseUrl out;
    out.prefix = prefix;
    const size_t colon = authority.rfind(':');
    if (colon != std::string_view::npos && authority.find(']') == std::string_view::npos) {
        out.host = std::string(authority.substr(0, colon));
        out.port = std::string(authority.substr(colon + 1));
    } else {
        out.host = std::string(authority);
    }
    if (out.host.empty() || out.port.empty() ||
        out.port.find_first_not_of("0123456789") != std::string::npos) {
        return InvalidArgument("--base-url '" + std::string(url) + "' has no valid host:port");
    }
    return out;
}

namespace {

double Since(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
}

std::chrono::steady_clock::duration Seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

class StreamingRequest : public std::enable_shared_from_this<StreamingRequest> {
  public:
    StreamingRequest(net::io_context& io, HttpTarget target, Clock::time_point run_start,
                     std::function<void(RequestOutcome)> done)
        : resolver_(io),
          stream_(io),
          target_(std::move(target)),
          run_start_(run_start),
          done_(std::move(done)) {
        request_ = {http::verb::post, target_.url.prefix + target_.path, 11};
        request_.set(http::field::host, target_.url.host);
        request_.set(http::field::content_type, "application/json");
        request_.set(http::field::accept, "text/event-stream");
        if (!target_.api_key.empty()) {
            request_.set(http::field::authorization, "Bearer " + target_.api_key);
        }
        for (const auto& [name, value] : target_.headers) request_.set(name, value);
        request_.keep_alive(false);
        request_.body() = target_.body;
        request_.prepare_payload();
        // Not boost::none: Boost 1.74 compares a Content-Length against an empty limit as "over".
        parser_.body_limit(std::numeric_limits<std::uint64_t>::max());
    }

    void Run() {
        sent_ = Clock::now();
        outcome_.start_s = Since(run_start_, sent_);
        resolver_.async_resolve(
            target_.url.host, target_.url.port,
            [self = shared_from_this()](beast::error_code ec, tcp::resolver::results_type results) {
                if (ec) return self->Fail("resolve: " + ec.message());
                self->Connect(results);
            });
    }

  private:
    void Connect(const tcp::resolver::results_type& results) {
        stream_.expires_after(Seconds(target_.read_timeout_s));
        stream_.async_connect(results, [self = shared_from_this()](beast::error_code ec,
                                                                   const tcp::endpoint&) {
            if (ec) return self->Fail("connect: " + ec.message());
            self->stream_.expires_after(Seconds(self->target_.read_timeout_s));
            http::async_write(self->stream_, self->request_, [self](beast::error_code ec, size_t) {
                if (ec) return self->Fail("write: " + ec.message());
                self->ReadSome();
            });
        });
    }

    void ReadSome() {
        parser_.get().body().data = chunk_.data();
        parser_.get().body().size = chunk_.size();
        stream_.expires_after(Seconds(target_.read_timeout_s));
        http::async_read_some(
            stream_, buffer_, parser_,
            [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
    }

    void OnRead(beast::error_code ec) {
        const Clock::time_point now = Clock::now();
        if (ec == http::error::need_buffer) ec = {};
        if (ec) return Fail("read: " + ec.message());
        const size_t n = chunk_.size() - parser_.get().body().size;
        std::string_view bytes(chunk_.data(), n);
        if (parser_.is_header_done() && parser_.get().result() != http::status::ok) {
            error_body_.append(bytes);
        } else {
            for (const std::string& data : sse_.Feed(bytes)) OnEvent(data, now);
        }
        if (parser_.is_done() || done_seen_ || !error_.empty()) return Finish(now);
        ReadSome();
    }

    void OnEvent(const std::string& data, Clock::time_point now) {
        if (data == "[DONE]") {
            done_seen_ = true;
            return;
        }
        const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
        if (!j.is_object()) {
            error_ = "a stream event is not JSON: " + data.substr(0, 200);
            return;
        }
        if (j.contains("error")) {
            error_ = "error event: " + j["error"].dump();
            return;
        }
        std::string text;
        if (j.contains("type") && j["type"].is_string()) {
            if (!AnthropicEvent(j, &text)) return;
        } else {
            if (auto usage = j.find("usage"); usage != j.end() && usage->is_object()) {
                usage_tokens_ = usage->value("completion_tokens", int64_t{-1});
                outcome_.prompt_tokens = usage->value("prompt_tokens", int64_t{-1});
                auto details = usage->find("prompt_tokens_details");
                if (details != usage->end() && details->is_object()) {
                    outcome_.cached_tokens = details->value("cached_tokens", int64_t{-1});
                }
            }
            auto choices = j.find("choices");
            if (choices == j.end() || !choices->is_array() || choices->empty()) return;
            const nlohmann::json& c = (*choices)[0];
            if (c.contains("text") && c["text"].is_string()) text = c["text"];
            if (c.contains("delta") && c["delta"].is_object() && c["delta"].contains("content") &&
                c["delta"]["content"].is_string()) {
                text = c["delta"]["content"];
            }
        }
        if (text.empty()) return;
        if (text_chunks_ == 0) {
            outcome_.ttft_s = Since(sent_, now);
        } else {
            outcome_.itl_s.push_back(Since(last_text_, now));
        }
        last_text_ = now;
        ++text_chunks_;
    }

    // Anthropic's Messages stream: the usage in message_start (input and cache tokens) and
    // message_delta (output tokens), text in content_block_delta, the end in message_stop.
    // False when the event carries no text.
    bool AnthropicEvent(const nlohmann::json& j, std::string* text) {
        const std::string type = j["type"];
        auto read_usage = [&](const nlohmann::json& u) {
            if (!u.is_object()) return;
            auto get = [&](const char* key) { return u.value(key, int64_t{-1}); };
            if (get("output_tokens") >= 0) usage_tokens_ = get("output_tokens");
            if (get("input_tokens") < 0) return;
            const int64_t read = std::max<int64_t>(0, get("cache_read_input_tokens"));
            const int64_t created = std::max<int64_t>(0, get("cache_creation_input_tokens"));
            outcome_.prompt_tokens = get("input_tokens") + read + created;
            outcome_.cached_tokens = read;
            outcome_.cache_creation_tokens = created;
        };
        if (type == "message_start" && j.contains("message") && j["message"].is_object() &&
            j["message"].contains("usage")) {
            read_usage(j["message"]["usage"]);
        } else if (type == "message_delta" && j.contains("usage")) {
            read_usage(j["usage"]);
        } else if (type == "message_stop") {
            done_seen_ = true;
        } else if (type == "content_block_delta" && j.contains("delta") &&
                   j["delta"].is_object() && j["delta"].value("type", "") == "text_delta" &&
                   j["delta"].contains("text") && j["delta"]["text"].is_string()) {
            *text = j["delta"]["text"];
            return true;
        }
        return false;
    }

    void Finish(Clock::time_point now) {
        outcome_.e2e_s = Since(sent_, now);
        outcome_.output_tokens = usage_tokens_ >= 0 ? usage_tokens_ : text_chunks_;
        if (!error_.empty()) return Fail(error_);
        if (parser_.get().result() != http::status::ok) {
            return Fail("HTTP " + std::to_string(parser_.get().result_int()) + ": " +
                        error_body_.substr(0, 500));
        }
        if (!done_seen_) return Fail("the stream ended without data: [DONE] (or message_stop)");
        outcome_.ok = true;
        Done();
    }

    void Fail(const std::string& why) {
        outcome_.ok = false;
        outcome_.error = why;
        if (outcome_.e2e_s == 0) outcome_.e2e_s = Since(sent_, Clock::now());
        Done();
    }

    void Done() {
        if (!done_) return;
        beast::error_code ignored;
        stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
        auto done = std::move(done_);
        done_ = nullptr;
        done(std::move(outcome_));
    }

    tcp::resolver resolver_;
    beast::tcp_stream stream_;
    beast::flat_buffer buffer_;
    HttpTarget target_;
    http::request<http::string_body> request_;
    http::response_parser<http::buffer_body> parser_;
    std::array<char, 16384> chunk_;
    SseParser sse_;
    Clock::time_point run_start_;
    Clock::time_point sent_;
    Clock::time_point last_text_;
    std::function<void(RequestOutcome)> done_;
    RequestOutcome outcome_;
    std::string error_;
    std::string error_body_;
    int64_t text_chunks_ = 0;
    int64_t usage_tokens_ = -1;
    bool done_seen_ = false;
};

}  // namespace

void StartStreamingRequest(net::io_context& io, const HttpTarget& target,
                           Clock::time_point run_start, std::function<void(RequestOutcome)> done) {
    std::make_shared<StreamingRequest>(io, target, run_start, std::move(done))->Run();
}

Result<std::string> HttpGet(const BaseUrl& url, const std::string& path, const std::string& api_key,
                            double timeout_s) {
    const std::string where = "GET http://" + url.host + ":" + url.port + url.prefix + path;
    net::io_context io;
    tcp::resolver resolver(io);
    beast::tcp_stream stream(io);
    beast::flat_buffer buffer;
    http::request<http::empty_body> req{http::verb::get, url.prefix + path, 11};
    req.set(http::field::host, url.host);
    if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
    http::response<http::string_body> res;
    beast::error_code error;
    bool finished = false;
    auto fail = [&](beast::error_code ec) {
        error = ec;
        finished = true;
    };
    resolver.async_resolve(
        url.host, url.port, [&](beast::error_code ec, tcp::resolver::results_type results) {
            if (ec) return fail(ec);
            stream.expires_after(Seconds(timeout_s));
            stream.async_connect(results, [&](beast::error_code ec, const tcp::endpoint&) {
                if (ec) return fail(ec);
                http::async_write(stream, req, [&](beast::error_code ec, size_t) {
                    if (ec) return fail(ec);
                    http::async_read(stream, buffer, res, [&](beast::error_code ec, size_t) {
                        if (ec) return fail(ec);
                        finished = true;
                    });
                });
            });
        });
    io.run_for(Seconds(timeout_s));
    if (!finished) return Status(StatusCode::kUnavailable, where + ": timed out");
    if (error) return Status(StatusCode::kUnavailable, where + ": " + error.message());
    if (res.result() != http::status::ok) {
        return Status(StatusCode::kUnavailable, where + ": HTTP " +
                                                    std::to_string(res.result_int()) + ": " +
                                                    res.body().substr(0, 500));
    }
    return res.body();
}

}  // namespace kvshard::loadgen
