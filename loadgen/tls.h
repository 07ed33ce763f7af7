// TLS for `kvshard bench --base-url https://...`: the OpenSSL context that says how a server's
// certificate is checked, and the one line a failed handshake is reported as.
//
// By default the server's chain is verified against the system's trust store (OpenSSL's default
// paths) plus, with `ca_cert_file`, the PEM certificates of that file; the name in the URL must
// match the certificate (a DNS name against its subjectAltName DNS entries, an IP address against
// its IP entries). `insecure` skips both checks (the connection is still encrypted).
#pragma once

#include <boost/asio/ssl/context.hpp>
#include <boost/system/error_code.hpp>
#include <memory>
#include <string>

#include "common/status.h"

struct ssl_st;  // OpenSSL's SSL

namespace kvshard::loadgen {

struct TlsOptions {
    bool insecure = false;     // skip certificate and name checks
    std::string ca_cert_file;  // PEM file of more trusted certificates; "" for none
};

// InvalidArgument naming the file when `ca_cert_file` cannot be read as PEM certificates.
Result<std::shared_ptr<boost::asio::ssl::context>> MakeTlsContext(const TlsOptions& options);

// Prepares a client connection's SSL object before its handshake: SNI (for a DNS name, not for an
// IP address, which RFC 6066 forbids there) and the name the certificate must carry.
// False when OpenSSL refuses the name.
bool PrepareTlsClient(ssl_st* ssl, const std::string& host);

// One line for a failed handshake: OpenSSL's reason, and for a certificate that did not verify,
// why (X509_verify_cert_error_string) and the flags that trust or skip it.
std::string TlsHandshakeError(const boost::system::error_code& ec, ssl_st* ssl);

}  // namespace kvshard::loadgen
