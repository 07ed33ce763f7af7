// `kvshard convert`: write any model kvshard reads as a Hugging Face directory
// (config.json, safetensors, tokenizer.json), or with --tokenizer-only just its tokenizer files.
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
    bool tokenizer_only = false;
};

int RunConvert(const ConvertFlags& f) {
    InitLogging("convert", "info");
    if (f.tokenizer_only && (f.dtype != "f32" || f.max_shard_mib != 0)) {
        return Fail(std::string(f.dtype != "f32" ? "--dtype" : "--max-shard-mib") +
                    ": no weights are written with --tokenizer-only");
    }
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
    if (f.tokenizer_only) {
        Status st = ExportHfTokenizer(**model, f.out);
        if (!st.ok()) return Fail(st.message());
        spdlog::info("wrote {}/tokenizer.json and tokenizer_config.json", f.out);
        return 0;
    }
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
    sub->add_option("--dtype", f->dtype, "f32 (exact for dequantized GGUF), bf16 or f16")
        ->capture_default_str();
    sub->add_option("--max-shard-mib", f->max_shard_mib,
                    "Split into shards of at most this size (0: one file)");
    sub->add_flag("--tokenizer-only", f->tokenizer_only,
                  "Write only tokenizer.json and tokenizer_config.json (for benchmark clients "
                  "that load a Hugging Face tokenizer)");
    return [f] { return RunConvert(*f); };
}

}  // namespace kvshard::cli
