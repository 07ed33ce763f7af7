// `kvshard plan`: how much KV cache a cluster holds for a model, from its config.json alone.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "config/arch_config.h"
#include "kv/capacity_planner.h"
#include "kv/capacity_report.h"

namespace kvshard::cli {
namespace {

struct PlanFlags {
    std::string hf_config;
    int64_t tp = 1;
    int64_t gpus = 0;
    std::string kv_dtype = "bf16";
    std::string weight_dtype = "bf16";
    double gpu_memory_gib = 80;
    double gpu_memory_gb = 0;  // overrides --gpu-memory-gib when given (vendors quote GB)
    double memory_utilization = 0.9;
    double overhead_gib = 1;
    int64_t context = 0;
    int64_t block_size = 16;
    bool json = false;
};

int RunPlan(const PlanFlags& f) {
    Result<ArchConfig> arch = ReadArchConfig(f.hf_config);
    if (!arch.ok()) return Fail(arch.status().message());
    Result<KvDtype> kv_dtype = ParseKvDtype(f.kv_dtype);
    if (!kv_dtype.ok()) return Fail("--kv-dtype: " + kv_dtype.status().message());
    Result<kv::WeightDtype> weight_dtype = kv::ParseWeightDtype(f.weight_dtype);
    if (!weight_dtype.ok()) return Fail("--weight-dtype: " + weight_dtype.status().message());

    kv::PlannerInput in;
    in.tp = f.tp;
    in.num_gpus = f.gpus;
    in.kv_dtype = *kv_dtype;
    in.weight_dtype = *weight_dtype;
    const double memory_bytes = f.gpu_memory_gb > 0
                                    ? f.gpu_memory_gb * 1e9
                                    : f.gpu_memory_gib * static_cast<double>(kv::kGiB);
    in.gpu_memory_bytes = static_cast<int64_t>(std::llround(memory_bytes));
    in.memory_utilization = f.memory_utilization;
    in.overhead_bytes_per_gpu =
        static_cast<int64_t>(std::llround(f.overhead_gib * static_cast<double>(kv::kGiB)));
    in.context_tokens = f.context;
    in.block_size = f.block_size;
    Result<kv::CapacityPlan> plan = kv::PlanCapacity(*arch, in);
    if (!plan.ok()) return Fail(plan.status().message());

    if (f.json) {
        std::printf("%s\n", kv::CapacityPlanJson(*plan).c_str());
    } else {
        std::fputs(kv::CapacityPlanTable(*plan).c_str(), stdout);
    }
    if (!plan->weights_fit) {
        return Fail("the weights of " + f.hf_config +
                    " and the overhead reserve do not fit in one GPU's usable memory");
    }
    return 0;
}

}  // namespace

Command RegisterPlan(CLI::App& app) {
    auto f = std::make_shared<PlanFlags>();
    CLI::App* sub = app.add_subcommand(
        "plan", "KV cache capacity of a cluster for a model, from its Hugging Face config.json");
    sub->add_option("--hf-config", f->hf_config, "The model's config.json")->required();
    sub->add_option("--tp", f->tp, "Tensor-parallel GPUs per instance")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--gpus", f->gpus, "GPUs in all, a multiple of --tp (default: --tp)")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--kv-dtype", f->kv_dtype, "bf16|fp16|fp8|fp32|int8")->capture_default_str();
    sub->add_option("--weight-dtype", f->weight_dtype, "bf16|fp16|fp8|fp32|int4")
        ->capture_default_str();
    sub->add_option("--gpu-memory-gib", f->gpu_memory_gib, "Memory of one GPU in GiB")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--gpu-memory-gb", f->gpu_memory_gb,
                    "Memory of one GPU in GB (1e9 bytes), as vendors quote it; overrides GiB")
        ->check(CLI::PositiveNumber);
    sub->add_option("--memory-utilization", f->memory_utilization,
                    "Share of each GPU's memory kvshard may use, (0, 1]")
        ->capture_default_str();
    sub->add_option("--overhead-gib", f->overhead_gib,
                    "Per-GPU reserve for activations and workspaces, GiB")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--context", f->context,
                    "Tokens per sequence (default: max_position_embeddings)")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--block-size", f->block_size, "Token slots per KV block")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_flag("--json", f->json, "Print one JSON object instead of the table");
    return [f] { return RunPlan(*f); };
}

}  // namespace kvshard::cli
