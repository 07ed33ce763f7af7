// The decode graphs' memory estimate (config/device_plan.h CudaGraphBytes) counts
// kCudaGraphKernelsPerLayer kernel nodes per layer and kCudaGraphFixedNodes outside the layers.
// Those constants must follow what the runner queues: a decode step of stories260K on a backend
// that logs the ModelRunner's ops (tests/worker/op_log_backend.h, with the fused RoPE + KV write
// that the CUDA backend offers), each op weighted by the kernels the CUDA backend launches for it
// (the table below), must give exactly kCudaGraphKernelsPerLayer per layer. A new op in the
// layer loop, or one taken away, fails here. What this cannot see without a GPU: a change in the
// number of kernels the CUDA backend launches for one op (the table is read from
// kernels/cuda/cuda_backend.cc and cuda_backend_ops.cc, not measured).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/device_plan.h"
#include "kernels/cuda/launch_math.h"
#include "model/model_file.h"
#include "tests/test_util.h"
#include "tests/worker/op_log_backend.h"
#include "worker/model_runner.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

using testing::FusedOpLogBackend;
using testing::SharedModel;

// Kernels the CUDA backend launches per op of a decode step, bf16 weights.
// clang-format off
const std::map<std::string, int64_t> kCudaKernelsPerOp = {
    {"Embedding", 1},
    {"RmsNorm", 1},
    {"AddRmsNorm", 1},
    {"Add", 1},             // the last layer's residual (the final norm follows the gather)
    {"MatMul", 2},          // LaunchF32ToBf16 (the activations) + cublasLtMatmul
    {"RopeKvWrite", 1},     // LaunchRopeKvWrite
    {"PagedAttention", 2},  // the split-KV kernel + MergeSplitsKernel (no prefill kernel)
    {"SiluMul", 1},
    {"GatherRows", 1},
};
// clang-format on

TEST(CudaGraphNodes, DecodeLayerKernelsMatchTheEstimate) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K");
    Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    const ModelSpec& spec = (*file)->spec();
    Result<std::unique_ptr<Backend>> cpu = MakeBackend({});
    ASSERT_TRUE(cpu.ok());
    auto backend = std::make_unique<FusedOpLogBackend>(std::move(*cpu));
    FusedOpLogBackend* log = backend.get();
    Result<ModelWeights> w = LoadWeights(**file, *backend);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    RunnerOptions o;
    o.max_context = 64;
    o.block_size = 16;
    o.num_kv_blocks = 4;
    o.max_step_tokens = 64;
    o.max_step_seqs = 4;
    ModelRunner runner(spec, std::move(backend), std::move(*w), o);

    const std::vector<int32_t> table = {0, 1, 2, 3};
    const std::vector<int32_t> prompt = {5, 17, 42, 9};
    const std::vector<int64_t> prompt_slots = {0, 1, 2, 3};
    std::vector<float> logits;
    const SequenceChunk prefill{.seq_id = 0,
                                .tokens = prompt,
                                .start_pos = 0,
                                .block_table = table,
                                .slot_mapping = prompt_slots};
    ASSERT_TRUE(runner.Forward({&prefill, 1}, &logits).ok());
    const std::map<std::string, int64_t> before = log->calls;
    const std::vector<int32_t> next = {7};
    const std::vector<int64_t> next_slot = {4};
    const SequenceChunk decode{.seq_id = 0,
                               .tokens = next,
                               .start_pos = 4,
                               .block_table = table,
                               .slot_mapping = next_slot};
    ASSERT_TRUE(runner.Forward({&decode, 1}, &logits).ok());
    // A decode step launches no prefill attention kernel (the table's PagedAttention).
    EXPECT_FALSE(cuda::LaunchesPrefillAttention(1));

    int64_t kernels = 0;
    std::string ops;  // for the message
    for (const auto& [op, n] : log->calls) {
        const int64_t step_calls = n - (before.count(op) != 0 ? before.at(op) : 0);
        if (step_calls == 0) continue;
        const auto it = kCudaKernelsPerOp.find(op);
        if (it == kCudaKernelsPerOp.end()) {
            ADD_FAILURE() << "the decode step queues " << op
                          << ", which the table of CUDA kernels per op does not know";
            continue;
        }
        kernels += step_calls * it->second;
        ops += " " + op + " " + std::to_string(step_calls);
    }
    // The graph ends at the final norm: the classifier's product follows it eagerly.
    const int64_t graph_kernels = kernels - kCudaKernelsPerOp.at("MatMul");
    // Outside the layers: the embedding, the first norm, the gather of the last rows, the final
    // norm (and at tp > 1 the embedding's all-reduce).
    const int64_t fixed = 4;
    EXPECT_LE(fixed + 1, kCudaGraphFixedNodes);
    EXPECT_EQ(graph_kernels - fixed, spec.num_layers * kCudaGraphKernelsPerLayer)
        << spec.num_layers << " layers: " << graph_kernels << " kernels in the graph; the step:" << ops;
    EXPECT_EQ(CudaGraphNodesPerLayer(1), kCudaGraphKernelsPerLayer);
}

}  // namespace
}  // namespace kvshard
