// `kvshard convert`: write any model kvshard reads as a Hugging Face directory
// (config.json, safetensors, tokenizer.json).
#include <memory>
#include <string>

#include "cli/commands.h"
#include "common/logging.h"
#include "model/hf_export.h"
#include "model/model_file.h"

namespace kvshard::cli {
namespace {

struct ConvertFlags {
    std::string model;
    std::string tokenizer;
    std::string out;
    std::string dtype = "f32";
    int64_t max_shard_mib = 0;
};

int RunConvert(const ConvertFlags& f) {
    InitLogging("convert", "info");
    HfExportOptions opts;
    if (f.dtype == "f32") {
        opts.dtype = DType::kF32;
    } else if (f.dtype == "bf16") {
        opts.dtype = DType::kBF16;
    } else if (f.dtype == "f16") {
        opts.dtype = DType::kF16;
    } else {
        return Fail("--dtype: '" + f.dtype + "' is not one of f32, bf16, f16");
    }
    opts.max_shard_bytes = static_cast<uint64_t>(f.max_shard_mib) << 20;
    OpenModelOptions open;
    open.tokenizer_path = f.tokenizer;
    Result<std::unique_ptr<ModelFile>> model = OpenModel(f.model, open);
    if (!model.ok()) return Fail(model.status().message());
    Status st = ExportHuggingFace(**model, f.out, opts);
    if (!st.ok()) return Fail(st.message());
    spdlog::info("wrote {} ({})", f.out, f.dtype);
    return 0;
}

}  // namespace

Command RegisterConvert(CLI::App& app) {
    auto f = std::make_shared<ConvertFlags>();
    CLI::App* sub = app.add_subcommand("convert", "Write a model as a Hugging Face directory (safetensors)");
    sub->add_option("--model", f->model, "Input: .gguf, Hugging Face directory or llama2.c .bin")->required();
    sub->add_option("--tokenizer", f->tokenizer, "llama2.c tokenizer.bin (default: found beside --model)");
    sub->add_option("--out", f->out, "Output directory (created)")->required();
    sub->add_option("--dtype", f->dtype, "f32 (exact for dequantized GGUF), bf16 or f16")->capture_default_str();
    sub->add_option("--max-shard-mib", f->max_shard_mib, "Split into shards of at most this size (0: one file)");
    return [f] { return RunConvert(*f); };
}

}  // namespace kvshard::cli
