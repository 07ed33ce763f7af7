#include "model/model_file.h"

#include <filesystem>
#include <fstream>
#include <functional>

#include "model/model_file_internal.h"

namespace kvshard {
namespace {

namespace fs = std::filesystem;

bool EndsWith(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool HasGgufMagic(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    char magic[4] = {};
    in.read(magic, 4);
    return in.gcount() == 4 && std::string_view(magic, 4) == "GGUF";
}

// What OpenModel promises for every format: a valid spec, every tensor the spec implies with
// its shape, and a tokenizer of the model's vocabulary.
Status CheckModel(const ModelFile& model) {
    Status valid = model.spec().Validate();
    if (!valid.ok()) return valid.WithContext(model.path());
    // One tensor at a time, so a corrupted layer count fails at the first missing tensor
    // instead of listing billions of names.
    KV_RETURN_IF_ERROR(ForEachExpectedTensor(model.spec(), [&model](const ExpectedTensor& e) {
        return model.GetTensor(e.name, e.shape).status();
    }));
    const int64_t vocab = static_cast<int64_t>(model.tokenizer_data().tokens.size());
    if (vocab != model.spec().vocab_size) {
        const std::string& source =
            model.tokenizer_data().source.empty() ? model.path() : model.tokenizer_data().source;
        return InvalidArgument(source + ": vocabulary has " + std::to_string(vocab) +
                               " tokens, model " + model.path() + " has " +
                               std::to_string(model.spec().vocab_size));
    }
    return Status::Ok();
}

}  // namespace

namespace internal {

Status NameFile(Status status, const std::string& path) {
    if (status.ok() || status.message().find(path) != std::string::npos) return status;
    return status.WithContext(path);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
        if (i > 0) s += ", ";
        s += std::to_string(shape[i]);
    }
    return s + "]";
}

}  // namespace internal

std::string_view ModelFormatName(ModelFormat format) {
    switch (format) {
        case ModelFormat::kGguf:
            return "gguf";
        case ModelFormat::kHuggingFace:
            return "huggingface";
        case ModelFormat::kLlama2c:
            return "llama2c";
    }
    return "?";
}

std::string LayerTensorName(int64_t layer, std::string_view suffix) {
    return "blk." + std::to_string(layer) + "." + std::string(suffix) + ".weight";
}

Status ForEachExpectedTensor(const ModelSpec& spec,
                             const std::function<Status(const ExpectedTensor&)>& visit) {
    const int64_t h = spec.hidden_size;
    const int64_t q = spec.num_heads * spec.head_dim;
    const int64_t kv = spec.num_kv_heads * spec.head_dim;
    const int64_t f = spec.ffn_size;
    KV_RETURN_IF_ERROR(visit({"token_embd.weight", {spec.vocab_size, h}}));
    for (int64_t l = 0; l < spec.num_layers; ++l) {
        const ExpectedTensor layer[] = {
            {LayerTensorName(l, "attn_norm"), {h}},      {LayerTensorName(l, "attn_q"), {q, h}},
            {LayerTensorName(l, "attn_k"), {kv, h}},     {LayerTensorName(l, "attn_v"), {kv, h}},
            {LayerTensorName(l, "attn_output"), {h, q}}, {LayerTensorName(l, "ffn_norm"), {h}},
            {LayerTensorName(l, "ffn_gate"), {f, h}},    {LayerTensorName(l, "ffn_up"), {f, h}},
            {LayerTensorName(l, "ffn_down"), {h, f}},
        };
        for (const ExpectedTensor& e : layer) KV_RETURN_IF_ERROR(visit(e));
        const std::string blk = "blk." + std::to_string(l) + ".";
        if (spec.attn_bias) {
            KV_RETURN_IF_ERROR(visit({blk + "attn_q.bias", {q}}));
            KV_RETURN_IF_ERROR(visit({blk + "attn_k.bias", {kv}}));
            KV_RETURN_IF_ERROR(visit({blk + "attn_v.bias", {kv}}));
        }
        if (spec.qk_norm) {
            KV_RETURN_IF_ERROR(visit({LayerTensorName(l, "attn_q_norm"), {spec.head_dim}}));
            KV_RETURN_IF_ERROR(visit({LayerTensorName(l, "attn_k_norm"), {spec.head_dim}}));
        }
        if (spec.post_norms) {
            KV_RETURN_IF_ERROR(visit({LayerTensorName(l, "post_attention_norm"), {h}}));
            KV_RETURN_IF_ERROR(visit({LayerTensorName(l, "post_ffw_norm"), {h}}));
        }
    }
    KV_RETURN_IF_ERROR(visit({"output_norm.weight", {h}}));
    if (!spec.tied_embeddings) KV_RETURN_IF_ERROR(visit({"output.weight", {spec.vocab_size, h}}));
    return Status::Ok();
}

std::vector<ExpectedTensor> ExpectedTensors(const ModelSpec& spec) {
    std::vector<ExpectedTensor> out;
    Status st = ForEachExpectedTensor(spec, [&out](const ExpectedTensor& e) {
        out.push_back(e);
        return Status::Ok();
    });
    KV_CHECK(st.ok());
    return out;
}

const TensorInfo* TensorListModelFile::FindTensor(std::string_view name) const {
    auto it = index_.find(std::string(name));
    return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::vector<std::string> TensorListModelFile::TensorNames() const {
    std::vector<std::string> names;
    for (const TensorInfo& t : tensors_) names.push_back(t.name);
    return names;
}

Status TensorListModelFile::AddTensor(TensorInfo tensor) {
    if (!index_.emplace(tensor.name, tensors_.size()).second) {
        return InvalidArgument("two tensors are named " + tensor.name);
    }
    tensors_.push_back(std::move(tensor));
    return Status::Ok();
}

Result<const TensorInfo*> ModelFile::GetTensor(std::string_view name,
                                               const std::vector<int64_t>& expected_shape) const {
    const TensorInfo* t = FindTensor(name);
    if (t == nullptr) {
        return NotFound(path_ + ": tensor '" + std::string(name) + "' not found");
    }
    if (!expected_shape.empty() && t->shape != expected_shape) {
        return InvalidArgument(path_ + ": tensor '" + std::string(name) + "' has shape " +
                               internal::ShapeString(t->shape) + ", expected " +
                               internal::ShapeString(expected_shape));
    }
    return t;
}

Result<std::unique_ptr<ModelFile>> OpenModel(const std::string& path,
                                             const OpenModelOptions& options) {
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    if (ec || !fs::exists(st)) return NotFound(path + ": no such file or directory");
    const std::string name = fs::path(path).filename().string();
    std::unique_ptr<ModelFile> model;
    if (fs::is_directory(st)) {
        KV_ASSIGN_OR_RETURN(model, internal::OpenHfModel(path));
    } else if (name == "config.json" || EndsWith(name, ".safetensors") ||
               EndsWith(name, ".safetensors.index.json")) {
        // A file inside a Hugging Face folder stands for the folder.
        std::string dir = fs::path(path).parent_path().string();
        KV_ASSIGN_OR_RETURN(model, internal::OpenHfModel(dir.empty() ? "." : dir));
    } else if (EndsWith(name, ".gguf") || HasGgufMagic(path)) {
        KV_ASSIGN_OR_RETURN(model, internal::OpenGgufModel(path));
    } else if (EndsWith(name, ".bin") || internal::LooksLikeLlama2c(path)) {
        KV_ASSIGN_OR_RETURN(model, internal::OpenLlama2cModel(path, options));
    } else {
        return InvalidArgument(path +
                               ": not a model file (expected GGUF, a llama2.c .bin checkpoint or "
                               "a Hugging Face folder)");
    }
    KV_RETURN_IF_ERROR(CheckModel(*model));
    return model;
}

}  // namespace kvshard
