#include "model/hf_export.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "config/hf_config.h"
#include "model/hf_names.h"
#include "model/safetensors.h"
#include "model/tokenizer_data.h"

namespace kvshard {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

Status WriteText(const fs::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) return NotFound(path.string() + ": cannot create");
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) return Internal(path.string() + ": write failed");
    return Status::Ok();
}

std::string_view TorchDType(DType dtype) {
    switch (dtype) {
        case DType::kF32:
            return "float32";
        case DType::kBF16:
            return "bfloat16";
        case DType::kF16:
            return "float16";
        default:  // the block types are dequantized into one of the three
            break;
    }
    return "";
}

std::string GenerationConfigText(const ModelSpec& s) {
    ordered_json j;
    if (s.bos_token_id >= 0) j["bos_token_id"] = s.bos_token_id;
    if (s.eos_token_id >= 0) j["eos_token_id"] = s.eos_token_id;
    j["do_sample"] = false;
    return j.dump(2) + "\n";
}

std::string ShardName(size_t index, size_t count) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
    return buf;
}

// The export entry of one canonical tensor: dequantized, Q/K permuted, Gemma 3's norms shifted
// back to the w of x * (1 + w), encoded as `dtype`.
SafetensorsWriteEntry MakeEntry(const ModelFile& model, const TensorInfo& t, DType dtype) {
    const ModelSpec& spec = model.spec();
    const bool shift_norm = spec.architecture == "gemma3" && t.name.ends_with("norm.weight");
    int64_t permute_heads = 0;
    if (spec.qk_layout == QkLayout::kInterleaved) {
        const std::string_view name = t.name;
        auto ends = [&](std::string_view s) {
            return name.size() >= s.size() && name.substr(name.size() - s.size()) == s;
        };
        if (ends(".attn_q.weight")) permute_heads = spec.num_heads;
        if (ends(".attn_k.weight")) permute_heads = spec.num_kv_heads;
    }
    SafetensorsWriteEntry e;
    e.name = HfNameFromCanonical(t.name, spec.architecture);
    e.dtype = dtype;
    e.shape = t.shape;
    const TensorInfo* tensor = &t;
    const int64_t head_dim = spec.head_dim;
    e.fill = [tensor, dtype, permute_heads, head_dim, shift_norm](uint8_t* out) {
        const int64_t rows = tensor->NumRows();
        const int64_t cols = tensor->NumCols();
        std::vector<float> values(static_cast<size_t>(rows * cols));
        DequantizeRows(*tensor, 0, rows, values.data());
        if (shift_norm) {
            for (float& v : values) v -= 1.0f;
        }
        if (permute_heads > 0) {
            std::vector<float> permuted(values.size());
            InterleavedToHalfSplit(values.data(), permute_heads, head_dim, cols, permuted.data());
            values.swap(permuted);
        }
        QuantizeRows(dtype, values.data(), rows, cols, out);
    };
    return e;
}

}  // namespace

void InterleavedToHalfSplit(const float* in, int64_t num_heads, int64_t head_dim, int64_t cols,
                            float* out) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; ++h) {
        const float* src = in + h * head_dim * cols;
        float* dst = out + h * head_dim * cols;
        for (int64_t k = 0; k < 2; ++k) {
            for (int64_t i = 0; i < half; ++i) {
                std::memcpy(dst + (k * half + i) * cols, src + (2 * i + k) * cols,
                            static_cast<size_t>(cols) * sizeof(float));
            }
        }
    }
}

Status ExportHuggingFace(const ModelFile& model, const std::string& out_dir,
                         const HfExportOptions& opts) {
    if (TorchDType(opts.dtype).empty()) {
        return InvalidArgument("export dtype must be F32, BF16 or F16, got " +
                               std::string(DTypeName(opts.dtype)));
    }
    const fs::path dir(out_dir);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return NotFound(out_dir + ": cannot create folder: " + ec.message());

    std::vector<SafetensorsWriteEntry> entries;
    for (const ExpectedTensor& expected : ExpectedTensors(model.spec())) {
        KV_ASSIGN_OR_RETURN(const TensorInfo* t, model.GetTensor(expected.name, expected.shape));
        entries.push_back(MakeEntry(model, *t, opts.dtype));
    }

    // Shards: consecutive tensors, a new shard when the next tensor would overflow this one.
    std::vector<std::vector<SafetensorsWriteEntry>> shards(1);
    uint64_t shard_bytes = 0;
    uint64_t total_bytes = 0;
    for (SafetensorsWriteEntry& e : entries) {
        const uint64_t bytes = SafetensorsDataBytes(e);
        if (opts.max_shard_bytes > 0 && !shards.back().empty() &&
            shard_bytes + bytes > opts.max_shard_bytes) {
            shards.emplace_back();
            shard_bytes = 0;
        }
        shard_bytes += bytes;
        total_bytes += bytes;
        shards.back().push_back(std::move(e));
    }
    const std::vector<std::pair<std::string, std::string>> metadata = {{"format", "pt"}};
    const fs::path single = dir / "model.safetensors";
    const fs::path index = dir / "model.safetensors.index.json";
    if (opts.max_shard_bytes == 0) {
        KV_RETURN_IF_ERROR(WriteSafetensors(single.string(), shards[0], metadata));
        fs::remove(index, ec);
    } else {
        ordered_json weight_map = ordered_json::object();
        for (size_t i = 0; i < shards.size(); ++i) {
            const std::string name = ShardName(i, shards.size());
            KV_RETURN_IF_ERROR(WriteSafetensors((dir / name).string(), shards[i], metadata));
            for (const SafetensorsWriteEntry& e : shards[i]) weight_map[e.name] = name;
        }
        ordered_json j;
        j["metadata"] = {{"total_size", total_bytes}};
        j["weight_map"] = weight_map;
        KV_RETURN_IF_ERROR(WriteText(index, j.dump(2) + "\n"));
        fs::remove(single, ec);
    }

    KV_RETURN_IF_ERROR(
        WriteText(dir / "config.json", HfConfigText(model.spec(), TorchDType(opts.dtype))));
    KV_RETURN_IF_ERROR(
        WriteText(dir / "generation_config.json", GenerationConfigText(model.spec())));
    return ExportHfTokenizer(model, out_dir);
}

HfTokenizerFiles HfTokenizerFilesOf(const ModelFile& model) {
    HfTokenizerFiles files;
    files.tokenizer_json = TokenizerJsonText(model.tokenizer_data()) + "\n";
    // The chat template is the spec's (GGUF keeps it beside the tokenizer keys; HF in
    // tokenizer_config.json), so it travels in tokenizer_config.json.
    TokenizerData tokenizer = model.tokenizer_data();
    if (!model.spec().chat_template.empty()) tokenizer.chat_template = model.spec().chat_template;
    files.tokenizer_config_json = TokenizerConfigJsonText(tokenizer) + "\n";
    return files;
}

Status ExportHfTokenizer(const ModelFile& model, const std::string& out_dir) {
    const fs::path dir(out_dir);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return NotFound(out_dir + ": cannot create folder: " + ec.message());
    const HfTokenizerFiles files = HfTokenizerFilesOf(model);
    KV_RETURN_IF_ERROR(WriteText(dir / "tokenizer.json", files.tokenizer_json));
    return WriteText(dir / "tokenizer_config.json", files.tokenizer_config_json);
}

}  // namespace kvshard
