// ModelFile over a Hugging Face folder: config.json, model.safetensors (or shards listed by
// model.safetensors.index.json), tokenizer.json. Tensors keep their stored order of Q/K rows
// (half-split, spec().qk_layout == kHalfSplit); they are renamed to the canonical names.
#include <filesystem>
#include <unordered_map>

#include "config/hf_config.h"
#include "model/hf_names.h"
#include "model/model_file_internal.h"
#include "model/safetensors.h"
#include "model/tokenizer_data.h"

namespace kvshard::internal {
namespace {

namespace fs = std::filesystem;

class HfModel : public TensorListModelFile {
  public:
    static Result<std::unique_ptr<ModelFile>> Open(const std::string& dir);

    ModelFormat format() const override { return ModelFormat::kHuggingFace; }

  private:
    std::unique_ptr<SafetensorsModel> weights_;
};

Result<std::unique_ptr<ModelFile>> HfModel::Open(const std::string& dir) {
    std::unique_ptr<HfModel> model(new HfModel());
    model->path_ = dir;
    const fs::path d(dir);
    const std::string config_path = (d / "config.json").string();
    if (!fs::exists(config_path)) return NotFound(dir + ": no config.json");
    KV_ASSIGN_OR_RETURN(model->spec_, ReadHfConfig(config_path));

    std::string weights_path = (d / "model.safetensors").string();
    if (!fs::exists(weights_path)) weights_path = (d / "model.safetensors.index.json").string();
    if (!fs::exists(weights_path)) {
        return NotFound(dir + ": no model.safetensors or model.safetensors.index.json");
    }
    KV_ASSIGN_OR_RETURN(model->weights_, SafetensorsModel::Open(weights_path));
    for (const std::string& hf_name : model->weights_->TensorNames()) {
        std::optional<std::string> name = CanonicalNameFromHf(hf_name);
        if (!name) continue;  // rotary_emb.inv_freq and other buffers kvshard does not use
        TensorInfo t = *model->weights_->FindTensor(hf_name);
        t.name = *name;
        // Canonical name, pointing into weights_' maps.
        if (Status st = model->AddTensor(std::move(t)); !st.ok()) {
            return InvalidArgument(weights_path + ": " + hf_name + ": " + st.message());
        }
    }
    // What the weights say wins over config.json: some configs omit tie_word_embeddings.
    model->spec_.tied_embeddings = model->FindTensor("output.weight") == nullptr;
    // Missing weights are reported by their Hugging Face names and file here; OpenModel checks
    // shapes and the rest.
    KV_RETURN_IF_ERROR(ForEachExpectedTensor(model->spec_, [&](const ExpectedTensor& e) {
        if (model->FindTensor(e.name) != nullptr) return Status::Ok();
        return NotFound(weights_path + ": no tensor '" + HfNameFromCanonical(e.name) + "'");
    }));

    const std::string tokenizer_path = (d / "tokenizer.json").string();
    if (!fs::exists(tokenizer_path)) return NotFound(dir + ": no tokenizer.json");
    Result<TokenizerData> tokenizer = ReadTokenizerJson(tokenizer_path);
    if (!tokenizer.ok()) return NameFile(tokenizer.status(), tokenizer_path);
    model->tokenizer_data_ = std::move(tokenizer).value();
    if (model->tokenizer_data_.source.empty()) model->tokenizer_data_.source = tokenizer_path;
    ModelSpec& s = model->spec_;
    s.chat_template = model->tokenizer_data_.chat_template;
    if (s.bos_token_id < 0) s.bos_token_id = model->tokenizer_data_.bos_id;
    if (s.eos_token_id < 0) s.eos_token_id = model->tokenizer_data_.eos_id;
    return std::unique_ptr<ModelFile>(std::move(model));
}

}  // namespace

Result<std::unique_ptr<ModelFile>> OpenHfModel(const std::string& dir) {
    return HfModel::Open(dir);
}

}  // namespace kvshard::internal
