// ParseHostPort (common/host_port.h): what `kvshard worker --coordinator` and the KV transports'
// endpoints accept, and the one line a bad address gets.
#include "common/host_port.h"

#include <gtest/gtest.h>

#include <string>

namespace kvshard {
namespace {

TEST(HostPort, ParsesHostAndPortAtTheLastColon) {
    struct Case {
        const char* text;
        const char* host;
        uint16_t port;
    };
    const Case cases[] = {
        {"127.0.0.1:8000", "127.0.0.1", 8000},
        {"coordinator.svc:1", "coordinator.svc", 1},
        {"h:65535", "h", 65535},
        {"[::1]:9000", "::1", 9000},
        {"::1:9000", "::1", 9000},
        {"[fe80::1%eth0]:80", "fe80::1%eth0", 80},
    };
    for (const Case& c : cases) {
        Result<HostPort> parsed = ParseHostPort(c.text);
        ASSERT_TRUE(parsed.ok()) << c.text << ": " << parsed.status().ToString();
        EXPECT_EQ(parsed->host, c.host) << c.text;
        EXPECT_EQ(parsed->port, c.port) << c.text;
    }
}

TEST(HostPort, RefusesWhatIsNotHostColonPort) {
    struct Case {
        const char* text;
        const char* message_part;
    };
    const Case cases[] = {
        {"", "is not HOST:PORT"},        {"nocolon", "is not HOST:PORT"},
        {":80", "is not HOST:PORT"},     {"127.0.0.1:", "is not HOST:PORT"},
        {"127.0.0.1:0", "port '0'"},     {"127.0.0.1:65536", "port '65536'"},
        {"127.0.0.1:8x", "port '8x'"},   {"127.0.0.1:-1", "port '-1'"},
        {"127.0.0.1: 80", "port ' 80'"}, {"local:r", "port 'r'"},
    };
    for (const Case& c : cases) {
        Result<HostPort> parsed = ParseHostPort(c.text);
        ASSERT_FALSE(parsed.ok()) << c.text;
        EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << c.text;
        EXPECT_NE(parsed.status().message().find(c.message_part), std::string::npos)
            << c.text << ": " << parsed.status().message();
        EXPECT_NE(parsed.status().message().find("'" + std::string(c.text) + "'"),
                  std::string::npos)
            << c.text << ": " << parsed.status().message();
    }
}

}  // namespace
}  // namespace kvshard
