// ModelFile: one opened model, whatever its format — a ModelSpec, named tensors in memory-mapped
// files, and the tokenizer description that came with it.
//
// Tensor names are canonical, in GGUF's naming, for every format:
//   token_embd.weight            {vocab, hidden}
//   blk.N.attn_norm.weight       {hidden}
//   blk.N.attn_q.weight          {heads*head_dim, hidden}
//   blk.N.attn_k.weight          {kv_heads*head_dim, hidden}
//   blk.N.attn_v.weight          {kv_heads*head_dim, hidden}
//   blk.N.attn_output.weight     {hidden, heads*head_dim}
//   blk.N.ffn_norm.weight        {hidden}
//   blk.N.ffn_gate.weight        {ffn, hidden}
//   blk.N.ffn_up.weight          {ffn, hidden}
//   blk.N.ffn_down.weight        {hidden, ffn}
//   output_norm.weight           {hidden}
//   output.weight                {vocab, hidden}   (absent when embeddings are tied)
// and, where the spec's architecture features ask for them (config/model_spec.h):
//   blk.N.attn_{q,k,v}.bias      {heads*head_dim}, {kv_heads*head_dim} x 2   (attn_bias)
//   blk.N.attn_{q,k}_norm.weight {head_dim}                                 (qk_norm)
//   blk.N.post_attention_norm.weight, blk.N.post_ffw_norm.weight {hidden}   (post_norms)
// spec().qk_layout says how attn_q/attn_k rows are ordered inside each head (HF: kHalfSplit).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "config/model_spec.h"
#include "model/tensor.h"
#include "model/tokenizer_data.h"

namespace kvshard {

enum class ModelFormat { kGguf, kHuggingFace, kLlama2c };
std::string_view ModelFormatName(ModelFormat format);

struct OpenModelOptions {
    // llama2.c only: the tokenizer file. Empty: look beside the checkpoint for tokenizer.bin,
    // then tok*.bin.
    std::string tokenizer_path;
};

class ModelFile {
  public:
    virtual ~ModelFile() = default;

    virtual ModelFormat format() const = 0;
    const std::string& path() const { return path_; }
    const ModelSpec& spec() const { return spec_; }
    const TokenizerData& tokenizer_data() const { return *tokenizer_data_; }
    // The same data, for a Tokenizer to share (Tokenizer::Create) instead of copying it.
    std::shared_ptr<const TokenizerData> shared_tokenizer_data() const { return tokenizer_data_; }

    // nullptr when absent.
    virtual const TensorInfo* FindTensor(std::string_view name) const = 0;
    // NotFound naming the file and tensor when absent; InvalidArgument when the shape differs
    // from `expected_shape` (if given).
    Result<const TensorInfo*> GetTensor(std::string_view name,
                                        const std::vector<int64_t>& expected_shape = {}) const;
    virtual std::vector<std::string> TensorNames() const = 0;

  protected:
    std::string path_;
    ModelSpec spec_;
    std::shared_ptr<TokenizerData> tokenizer_data_ = std::make_shared<TokenizerData>();
};

// A ModelFile whose tensors are a list built when it is opened (llama2.c checkpoints, Hugging
// Face directories): a name index over it answers FindTensor and TensorNames.
class TensorListModelFile : public ModelFile {
  public:
    const TensorInfo* FindTensor(std::string_view name) const final;
    std::vector<std::string> TensorNames() const final;

  protected:
    // InvalidArgument (nothing added) when a tensor of that name is already there.
    Status AddTensor(TensorInfo tensor);

  private:
    std::vector<TensorInfo> tensors_;
    std::unordered_map<std::string, size_t> index_;
};

// Opens `path`: a .gguf file, a Hugging Face directory (config.json + model.safetensors or
// model.safetensors.index.json + tokenizer.json), or a llama2.c .bin checkpoint. Checks that the
// spec is valid, that every tensor the spec implies exists with the right shape and a supported
// type, and that the tokenizer's vocabulary matches the model's. Any failure is one Status whose
// message names the file and the problem.
Result<std::unique_ptr<ModelFile>> OpenModel(const std::string& path,
                                             const OpenModelOptions& options = {});

// Canonical tensor names, built in one place.
std::string LayerTensorName(int64_t layer,
                            std::string_view suffix);  // ("attn_q") -> blk.L.attn_q.weight

struct ExpectedTensor {
    std::string name;
    std::vector<int64_t> shape;
};
// Every tensor `spec` implies, with its shape, in canonical order: token_embd, each layer's
// tensors (attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
// ffn_down, then the biases, q/k norms and post norms the spec asks for), output_norm, and output
// unless embeddings are tied.
// REQUIRES: `spec` is of an opened model (a valid spec from a file is checked against the
// tensors there before its layer count is trusted with a list this long).
std::vector<ExpectedTensor> ExpectedTensors(const ModelSpec& spec);
// The same list, one tensor at a time; stops at and returns the first error `visit` returns.
Status ForEachExpectedTensor(const ModelSpec& spec,
                             const std::function<Status(const ExpectedTensor&)>& visit);

}  // namespace kvshard
