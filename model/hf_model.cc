// ModelFile over a Hugging Face folder: config.json, model.safetensors (or shards listed by
// model.safetensors.index.json), tokenizer.json. Tensors keep their stored order of Q/K rows
// (half-split, spec().qk_layout == kHalfSplit); they are renamed to the canonical names of the
// config's architecture. Gemma 3 computes its RMSNorms as x * (1 + w) and stores w: its norm
// weights are read into F32 copies holding 1 + w, the weight a plain RMSNorm multiplies by (as
// llama.cpp's converter writes them into GGUF files). The copies live in a read-only mapping of
// an anonymous file (memfd), so that they are a file mapping like every other tensor: the weight
// loader gives a tensor's pages back after copying it (ReleaseMappedPages), which on heap memory
// would drop the data.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <unordered_map>
#include <vector>

#include "config/hf_config.h"
#include "model/hf_names.h"
#include "model/model_file_internal.h"
#include "model/safetensors.h"
#include "model/tokenizer_data.h"

namespace kvshard::internal {
namespace {

namespace fs = std::filesystem;

// `bytes` bytes copied into a private read-only mapping of a memfd.
class MappedCopy {
  public:
    static Result<std::unique_ptr<MappedCopy>> Create(const void* data, size_t bytes) {
        auto out = std::unique_ptr<MappedCopy>(new MappedCopy());
        if (bytes == 0) return out;
        const int fd = ::memfd_create("kvshard-hf-norms", MFD_CLOEXEC);
        if (fd < 0) return Internal(std::string("memfd_create: ") + std::strerror(errno));
        const auto* p = static_cast<const uint8_t*>(data);
        size_t done = 0;
        while (done < bytes) {
            const ssize_t n = ::write(fd, p + done, bytes - done);
            if (n <= 0) {
                const int err = errno;
                ::close(fd);
                return Internal(std::string("memfd write: ") + std::strerror(err));
            }
            done += static_cast<size_t>(n);
        }
        void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
        const int err = errno;
        ::close(fd);
        if (map == MAP_FAILED) return Internal(std::string("mmap: ") + std::strerror(err));
        out->data_ = static_cast<const uint8_t*>(map);
        out->size_ = bytes;
        return out;
    }
    ~MappedCopy() {
        if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
    }
    MappedCopy(const MappedCopy&) = delete;
    MappedCopy& operator=(const MappedCopy&) = delete;
    const uint8_t* data() const { return data_; }

  private:
    MappedCopy() = default;
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
};

class HfModel : public TensorListModelFile {
  public:
    static Result<std::unique_ptr<ModelFile>> Open(const std::string& dir);

    ModelFormat format() const override { return ModelFormat::kHuggingFace; }

  private:
    std::unique_ptr<SafetensorsModel> weights_;
    std::unique_ptr<MappedCopy> shifted_norms_;  // Gemma 3's 1 + w
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
    const std::string& arch = model->spec_.architecture;
    // Canonical names, pointing into weights_' maps; Gemma 3's norms into the shifted copies,
    // which are placed once all of them are known.
    std::vector<std::pair<std::string, TensorInfo>> tensors;
    std::vector<float> shifted;
    std::vector<size_t> shifted_at;  // per tensor: its first float in `shifted`, or npos
    for (const std::string& hf_name : model->weights_->TensorNames()) {
        std::optional<std::string> name = CanonicalNameFromHf(hf_name, arch);
        if (!name) continue;  // rotary_emb.inv_freq and other buffers kvshard does not use
        TensorInfo t = *model->weights_->FindTensor(hf_name);
        t.name = *name;
        size_t at = std::string::npos;
        if (arch == "gemma3" && t.name.ends_with("norm.weight") && t.shape.size() == 1) {
            at = shifted.size();
            shifted.resize(at + static_cast<size_t>(t.NumElements()));
            DequantizeRows(t, 0, 1, shifted.data() + at);
            for (size_t i = at; i < shifted.size(); ++i) shifted[i] += 1.0f;
            t.dtype = DType::kF32;
            t.num_bytes = static_cast<size_t>(t.NumElements()) * sizeof(float);
        }
        shifted_at.push_back(at);
        tensors.emplace_back(hf_name, std::move(t));
    }
    KV_ASSIGN_OR_RETURN(model->shifted_norms_,
                        MappedCopy::Create(shifted.data(), shifted.size() * sizeof(float)));
    for (size_t i = 0; i < tensors.size(); ++i) {
        auto& [hf_name, t] = tensors[i];
        if (shifted_at[i] != std::string::npos) {
            t.data = model->shifted_norms_->data() + shifted_at[i] * sizeof(float);
        }
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
        return NotFound(weights_path + ": no tensor '" + HfNameFromCanonical(e.name, arch) + "'");
    }));

    const std::string tokenizer_path = (d / "tokenizer.json").string();
    if (!fs::exists(tokenizer_path)) return NotFound(dir + ": no tokenizer.json");
    Result<TokenizerData> tokenizer = ReadTokenizerJson(tokenizer_path);
    if (!tokenizer.ok()) return NameFile(tokenizer.status(), tokenizer_path);
    *model->tokenizer_data_ = std::move(tokenizer).value();
    if (model->tokenizer_data_->source.empty()) model->tokenizer_data_->source = tokenizer_path;
    ModelSpec& s = model->spec_;
    s.chat_template = model->tokenizer_data_->chat_template;
    if (s.bos_token_id < 0) s.bos_token_id = model->tokenizer_data_->bos_id;
    if (s.eos_token_id < 0) s.eos_token_id = model->tokenizer_data_->eos_id;
    return std::unique_ptr<ModelFile>(std::move(model));
}

}  // namespace

Result<std::unique_ptr<ModelFile>> OpenHfModel(const std::string& dir) {
    return HfModel::Open(dir);
}

}  // namespace kvshard::internal
