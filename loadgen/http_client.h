// The load generator's HTTP side (Boost.Beast, HTTP/1.1, over TCP or TLS): one streamed request
// on an io_context, timed chunk by chunk — OpenAI's stream (chunks, then "data: [DONE]") or
// Anthropic's Messages stream (message_start ... content_block_delta ... message_stop) — and a
// blocking GET for /v1/models and a blocking POST for /tokenize.
//
// Thread-safety: a request lives on the io_context it was started on; run that context on one
// thread (the bench does) and the callback runs there.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ssl/context.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace kvshard::loadgen {

// http[s]://host[:port][/prefix]; a trailing "/v1" is dropped (OpenAI clients' base URLs have
// it), so paths are always written "/v1/...".
struct BaseUrl {
    bool https = false;
    std::string host;
    std::string port = "80";  // 443 for https unless given
    std::string prefix;       // "" or "/something", no trailing slash
    // https: how the server's certificate is checked (loadgen/tls.h MakeTlsContext). REQUIRES:
    // set before any request when `https`; shared by every connection of the run.
    std::shared_ptr<boost::asio::ssl::context> tls;
};
// Does not set `tls`.
Result<BaseUrl> ParseBaseUrl(std::string_view url);
// "https://host:port/prefix", for messages.
std::string UrlText(const BaseUrl& url);

struct HttpTarget {
    BaseUrl url;
    std::string path;             // "/v1/completions"
    std::string body;             // JSON
    std::string api_key;          // sent as "Authorization: Bearer" when not empty
    double read_timeout_s = 600;  // a request that receives nothing this long fails
    std::vector<std::pair<std::string, std::string>> headers = {};  // more request headers
};

// What one streamed request measured. Times are seconds.
struct RequestOutcome {
    bool ok = false;
    std::string error;           // why it failed (HTTP status and body, or the socket error)
    double start_s = 0;          // when it was sent, since the run began
    double ttft_s = 0;           // to the first chunk that carried text
    double e2e_s = 0;            // to the end of the stream
    std::vector<double> itl_s;   // between consecutive chunks that carried text
    int64_t output_tokens = 0;   // the server's usage.completion_tokens, else text chunks
    int64_t prompt_tokens = -1;  // the server's usage.prompt_tokens; -1 when not reported
    // Prompt tokens read from the prefix cache (OpenAI usage.prompt_tokens_details.cached_tokens,
    // Anthropic cache_read_input_tokens) and written to it up to the cache breakpoints
    // (cache_creation_input_tokens); -1 when not reported.
    int64_t cached_tokens = -1;
    int64_t cache_creation_tokens = -1;
};

// Sends `target` as a POST and reads its server-sent events until "data: [DONE]" or the end of
// the response. `run_start` is the run's time origin. `done` runs once, on `io`'s thread.
void StartStreamingRequest(boost::asio::io_context& io, const HttpTarget& target,
                           std::chrono::steady_clock::time_point run_start,
                           std::function<void(RequestOutcome)> done);

// GET prefix + path; the body of a 200 answer, else Unavailable with the status and body (or the
// socket or TLS error), on one line.
Result<std::string> HttpGet(const BaseUrl& url, const std::string& path, const std::string& api_key,
                            double timeout_s);
// POST prefix + path with a JSON body; as HttpGet.
Result<std::string> HttpPost(const BaseUrl& url, const std::string& path, const std::string& body,
                             const std::string& api_key, double timeout_s);
// https: connects and completes a TLS handshake (nothing is sent), so a certificate the client
// does not trust is one clear error before a run starts; Ok at once for http.
Status CheckConnection(const BaseUrl& url, double timeout_s);

}  // namespace kvshard::loadgen
