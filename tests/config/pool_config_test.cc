// The pools: and kv_transfer: sections of the serve config, and the shipped examples.
#include <gtest/gtest.h>

#include <string>

#include "common/build_config.h"
#include "config/server_config.h"

namespace kvshard {
namespace {

TEST(PoolConfig, NoPoolsIsOneMixedInstanceOfTp) {
    auto c = ParseServerConfig("model: m.gguf\ntp: 3\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    const auto pools = c->EffectivePools();
    ASSERT_EQ(pools.size(), 1u);
    EXPECT_EQ(pools[0].role, PoolRole::kMixed);
    ASSERT_EQ(pools[0].instances.size(), 1u);
    EXPECT_EQ(pools[0].instances[0].tp, 3);
    EXPECT_FALSE(c->kv_transfer.layerwise);
    EXPECT_EQ(c->kv_transfer.timeout_ms, 10'000);
}

TEST(PoolConfig, ReadsRolesInstancesDevicesAndTransfer) {
    auto c = ParseServerConfig(R"(model: m.gguf
pools:
  - name: p
    role: prefill
    instances:
      - tp: 2
        devices: [0, 1]
      - {}
  - name: d
    role: decode
    instances: [{tp: 1, devices: [cpu]}]
kv_transfer:
  mode: layerwise
  timeout_ms: 250
)",
                               "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->pools.size(), 2u);
    EXPECT_EQ(c->pools[0].name, "p");
    EXPECT_EQ(c->pools[0].role, PoolRole::kPrefill);
    ASSERT_EQ(c->pools[0].instances.size(), 2u);
    EXPECT_EQ(c->pools[0].instances[0].tp, 2);
    EXPECT_EQ(c->pools[0].instances[0].devices, (std::vector<std::string>{"0", "1"}));
    EXPECT_EQ(c->pools[0].instances[1].tp, 1);
    EXPECT_EQ(c->pools[1].role, PoolRole::kDecode);
    EXPECT_TRUE(c->kv_transfer.layerwise);
    EXPECT_EQ(c->kv_transfer.timeout_ms, 250);
}

struct BadCase {
    const char* yaml;
    const char* expected;  // in the message
};

TEST(PoolConfig, ErrorsNameTheKeyAndValue) {
    const BadCase cases[] = {
        {"pools: 3\n", "pools: expected a list"},
        {"pools:\n  - role: prefill\n    instances: [{tp: 1}]\n", "pools[0].name: required"},
        {"pools:\n  - name: a\n    role: boss\n    instances: [{tp: 1}]\n", "invalid value 'boss'"},
        {"pools:\n  - name: a\n    instances: []\n",
         "pools[0].instances: expected a non-empty list"},
        {"pools:\n  - name: a\n    instances: [{tp: 0}]\n",
         "pools[0].instances[0].tp: invalid value '0'"},
        {"pools:\n  - name: a\n    instances: [{tp: 2, devices: [0]}]\n", "1 devices for tp 2"},
        {"pools:\n  - name: a\n    instances: [{tp: 1, devices: [gpu7]}]\n",
         "invalid value 'gpu7'"},
        {"pools:\n  - name: a\n    instances: [{tp: 1, cores: 3}]\n",
         "pools[0].instances[0].cores: unknown key"},
        {"pools:\n  - name: a\n    instances: [{tp: 1}]\n  - name: a\n    instances: [{tp: 1}]\n",
         "two pools are named 'a'"},
        {"pools:\n  - name: a\n    role: prefill\n    instances: [{tp: 1}]\n",
         "needs a decode pool"},
        {"pools:\n  - name: a\n    role: mixed\n    instances: [{tp: 1}]\n  - name: b\n    role: "
         "decode\n    instances: [{tp: 1}]\n"
         "  - name: c\n    role: prefill\n    instances: [{tp: 1}]\n",
         "mixed pools cannot be combined"},
        {"kv_transfer:\n  mode: sideways\n", "kv_transfer.mode: invalid value 'sideways'"},
    };
    for (const BadCase& bc : cases) {
        auto c = ParseServerConfig(std::string("model: m.gguf\n") + bc.yaml, "serve.yaml");
        ASSERT_FALSE(c.ok()) << bc.yaml;
        EXPECT_NE(c.status().message().find(bc.expected), std::string::npos)
            << c.status().message();
        EXPECT_NE(c.status().message().find("serve.yaml"), std::string::npos)
            << c.status().message();
    }
}

TEST(PoolConfig, ShippedExamplesParse) {
    const std::string root = KVSHARD_SOURCE_DIR;
    for (const char* name : {"colocated-tp2.yaml", "disagg-1p1d.yaml", "disagg-p2-d1.yaml"}) {
        auto c =
            LoadServerConfig(root + "/config/examples/" + name, {{"model", "m.gguf", "--model"}});
        ASSERT_TRUE(c.ok()) << name << ": " << c.status().ToString();
        EXPECT_FALSE(c->pools.empty()) << name;
    }
}

}  // namespace
}  // namespace kvshard
