#include "loadgen/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <boost/asio/ip/address.hpp>

namespace kvshard::loadgen {

namespace ssl = boost::asio::ssl;

Result<std::shared_ptr<ssl::context>> MakeTlsContext(const TlsOptions& options) {
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls_client);
    boost::system::error_code ec;
    if (options.insecure) {
        ctx->set_verify_mode(ssl::verify_none, ec);
        return ctx;
    }
    ctx->set_default_verify_paths(ec);
    if (ec) {
        return Status(StatusCode::kUnavailable,
                      "could not load the system's trusted certificates: " + ec.message());
    }
    if (!options.ca_cert_file.empty()) {
        ctx->load_verify_file(options.ca_cert_file, ec);
        if (ec) {
            return InvalidArgument("--ca-cert " + options.ca_cert_file +
                                   ": not a readable PEM certificate file (" + ec.message() + ")");
        }
    }
    ctx->set_verify_mode(ssl::verify_peer, ec);
    return ctx;
}

bool PrepareTlsClient(ssl_st* ssl, const std::string& host) {
    boost::system::error_code ec;
    const auto address = boost::asio::ip::make_address(host, ec);
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    if (!ec) return X509_VERIFY_PARAM_set1_ip_asc(param, address.to_string().c_str()) == 1;
    if (SSL_set_tlsext_host_name(ssl, host.c_str()) != 1) return false;
    return SSL_set1_host(ssl, host.c_str()) == 1;
}

std::string TlsHandshakeError(const boost::system::error_code& ec, ssl_st* ssl) {
    // Without verify_peer (--insecure) a failed check is recorded but was not the reason.
    const long verify = SSL_get_verify_result(ssl);
    if ((SSL_get_verify_mode(ssl) & SSL_VERIFY_PEER) != 0 && verify != X509_V_OK) {
        return std::string("the server's certificate is not trusted: ") +
               X509_verify_cert_error_string(verify) +
               " (--ca-cert FILE trusts its issuer, --insecure skips the check)";
    }
    return "TLS handshake failed: " + ec.message();
}

}  // namespace kvshard::loadgen
