// The accelerator catalog: datasheet figures, alias lookup, and catalog-file overrides and errors.
#include "sim/accelerator.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace kvshard::sim {
namespace {

TEST(AcceleratorTest, AliasesFindTheCanonicalKind) {
    const struct {
        const char* query;
        const char* name;
    } cases[] = {
        {"h200", "H200-SXM"},
        {"H200-SXM", "H200-SXM"},
        {"h200_sxm", "H200-SXM"},
        {"H100", "H100-SXM"},
        {"h100-sxm5", "H100-SXM"},
        {"a100", "A100-80GB-SXM"},
        {"A100-SXM4-80GB", "A100-80GB-SXM"},
        {"B200", "B200"},
        {"CPU", "cpu"},
    };
    for (const auto& c : cases) {
        Result<Accelerator> a = FindAccelerator(c.query);
        ASSERT_TRUE(a.ok()) << c.query << ": " << a.status().ToString();
        EXPECT_EQ(a->name, c.name) << c.query;
    }
    Result<Accelerator> missing = FindAccelerator("tpu-v5");
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
    EXPECT_NE(missing.status().message().find("H200-SXM"), std::string::npos)
        << missing.status().message();
}

// The datasheet numbers (sources in accelerator.cc and docs/simulate.md).
TEST(AcceleratorTest, BuiltinsCarryDatasheetNumbers) {
    const struct {
        const char* name;
        double memory_gb, bandwidth_tb_s, bf16_tflops, fp8_tflops, nvlink_gb_s, network_gbit_s;
    } cases[] = {
        {"A100-80GB-SXM", 80, 2.039, 312, 0, 300, 200},
        {"H100-SXM", 80, 3.35, 989, 1979, 450, 400},
        {"H200-SXM", 141, 4.8, 989, 1979, 450, 400},
        {"B200", 180, 8.0, 2250, 4500, 900, 400},
    };
    for (const auto& c : cases) {
        Result<Accelerator> a = FindAccelerator(c.name);
        ASSERT_TRUE(a.ok()) << c.name;
        EXPECT_EQ(a->memory_bytes, static_cast<int64_t>(c.memory_gb * 1e9)) << c.name;
        EXPECT_DOUBLE_EQ(a->memory_bandwidth, c.bandwidth_tb_s * 1e12) << c.name;
        EXPECT_DOUBLE_EQ(a->bf16_flops, c.bf16_tflops * 1e12) << c.name;
        EXPECT_DOUBLE_EQ(a->fp8_flops, c.fp8_tflops * 1e12) << c.name;
        EXPECT_DOUBLE_EQ(a->intra_node_bandwidth, c.nvlink_gb_s * 1e9) << c.name;
        EXPECT_DOUBLE_EQ(a->network_bandwidth, c.network_gbit_s * 1e9 / 8) << c.name;
        EXPECT_EQ(a->gpus_per_node, 8);
        EXPECT_FALSE(a->source.empty());
        EXPECT_TRUE(ValidateAccelerator(*a, c.name).ok());
    }
    for (const Accelerator& a : BuiltinAccelerators()) {
        EXPECT_TRUE(ValidateAccelerator(a, a.name).ok()) << a.name;
    }
}

TEST(AcceleratorTest, CatalogFileOverridesAndAddsKinds) {
    const std::string yaml = R"(accelerators:
  h200:
    bandwidth_efficiency: 0.9
    step_overhead_s: 1e-3
  my-gpu:
    base: h100
    memory_bytes: 96e9
  bare:
    memory_bytes: 1e10
    memory_bandwidth: 1e12
    bf16_flops: 1e14
    intra_node_bandwidth: 1e11
    network_bandwidth: 1e10
)";
    Result<std::vector<Accelerator>> catalog = ParseAcceleratorCatalog(yaml, "acc.yaml");
    ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
    Result<Accelerator> h200 = FindAccelerator("H200-SXM", *catalog);
    ASSERT_TRUE(h200.ok());
    EXPECT_DOUBLE_EQ(h200->bandwidth_efficiency, 0.9);
    EXPECT_DOUBLE_EQ(h200->step_overhead_s, 1e-3);
    EXPECT_DOUBLE_EQ(h200->memory_bandwidth, 4.8e12);  // untouched
    Result<Accelerator> mine = FindAccelerator("my-gpu", *catalog);
    ASSERT_TRUE(mine.ok());
    EXPECT_EQ(mine->memory_bytes, 96'000'000'000);
    EXPECT_DOUBLE_EQ(mine->memory_bandwidth, 3.35e12);  // from the base
    Result<Accelerator> bare = FindAccelerator("bare", *catalog);
    ASSERT_TRUE(bare.ok());
    EXPECT_DOUBLE_EQ(bare->flops_efficiency, 0.7);  // calibration defaults
    EXPECT_EQ(catalog->size(), BuiltinAccelerators().size() + 2);

    // The list form.
    Result<std::vector<Accelerator>> list = ParseAcceleratorCatalog(
        "accelerators:\n  - name: B200\n    flops_efficiency: 0.5\n", "list.yaml");
    ASSERT_TRUE(list.ok()) << list.status().ToString();
    EXPECT_DOUBLE_EQ(FindAccelerator("b200", *list)->flops_efficiency, 0.5);
}

TEST(AcceleratorTest, CatalogFileErrorsNameFileFieldAndProblem) {
    const struct {
        const char* yaml;
        const char* message;
    } cases[] = {
        {"accelerators:\n  h200:\n    memory_bandwidth: -1\n",
         "file: accelerators.h200.memory_bandwidth: must be positive, got -1"},
        {"accelerators:\n  h200:\n    memory_bandwith: 1e12\n",
         "file: accelerators.h200.memory_bandwith: unknown field"},
        {"accelerators:\n  h200:\n    bf16_flops: lots\n",
         "file: accelerators.h200.bf16_flops: 'lots' is not a number"},
        {"accelerators:\n  h100:\n    flops_efficiency: 1.5\n",
         "file: accelerators.h100.flops_efficiency: must be in (0, 1], got 1.5"},
        {"accelerators:\n  a100:\n    gpus_per_node: 2.5\n",
         "file: accelerators.a100.gpus_per_node: 2.5 is not an integer"},
        {"accelerators:\n  new:\n    memory_bytes: 1e9\n",
         "file: accelerators.new.memory_bandwidth: missing (a new kind without base: gives every "
         "number)"},
        {"accelerators:\n  new:\n    base: tpu\n",
         "file: accelerators.new.base: unknown accelerator 'tpu'"},
        {"gpus: []\n", "file: gpus: unknown key"},
        {"accelerators: 3\n", "file: accelerators: expected a map or a list"},
        {"accelerators:\n  - memory_bytes: 1\n", "file: accelerators[0].name: missing"},
        {"accelerators:\n  h200: [1, 2]\n", "file: accelerators.h200: expected a map of fields"},
    };
    EXPECT_NE(ParseAcceleratorCatalog("accelerators: {h200: [\n", "file")
                  .status()
                  .message()
                  .find("file: line "),
              std::string::npos);
    for (const auto& c : cases) {
        Result<std::vector<Accelerator>> r = ParseAcceleratorCatalog(c.yaml, "file");
        ASSERT_FALSE(r.ok()) << c.yaml;
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.yaml;
        EXPECT_EQ(r.status().message(), c.message) << c.yaml;
    }
}

TEST(AcceleratorTest, LoadsAFileAndReportsAMissingOne) {
    testing::TempDir dir;
    testing::WriteFile(dir.File("acc.yaml"), "accelerators:\n  h200:\n    memory_bytes: 1.4e11\n");
    Result<std::vector<Accelerator>> c = LoadAcceleratorCatalog(dir.File("acc.yaml"));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(FindAccelerator("h200", *c)->memory_bytes, 140'000'000'000);
    Result<std::vector<Accelerator>> missing = LoadAcceleratorCatalog(dir.File("none.yaml"));
    EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvshard::sim
