// ModelFile over a llama2.c checkpoint (legacy "version 0" export): a 7 x int32 header, then fp32
// arrays in a fixed order. Tensors point into the memory map; the tokenizer is a separate file.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "common/mapped_file.h"
#include "model/model_file_internal.h"
#include "model/tokenizer_data.h"

namespace kvshard::internal {
namespace {

namespace fs = std::filesystem;

// export.py's versioned formats start with this magic ("ak42") instead of the header.
constexpr uint32_t kVersionedMagic = 0x616b3432;

struct Header {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

class Llama2cModel : public TensorListModelFile {
  public:
    static Result<std::unique_ptr<ModelFile>> Open(const std::string& path,
                                                   const OpenModelOptions& options);

    ModelFormat format() const override { return ModelFormat::kLlama2c; }

  private:
    Status MapTensors(const Header& h);
    void Add(std::string name, std::vector<int64_t> shape, const uint8_t* data);

    MappedFile file_;
};

Status CheckHeader(const Header& h, const std::string& path) {
    auto bad = [&](const std::string& what) {
        return DataLoss(path + ": llama2.c header: " + what);
    };
    const std::pair<const char*, int32_t> positive[] = {
        {"dim", h.dim},         {"hidden_dim", h.hidden_dim}, {"n_layers", h.n_layers},
        {"n_heads", h.n_heads}, {"n_kv_heads", h.n_kv_heads}, {"seq_len", h.seq_len}};
    for (const auto& [name, value] : positive) {
        if (value <= 0) return bad(std::string(name) + " = " + std::to_string(value));
    }
    if (h.vocab_size == 0 || h.vocab_size == INT32_MIN) {
        return bad("vocab_size = " + std::to_string(h.vocab_size));
    }
    if (h.dim % h.n_heads != 0 || (h.dim / h.n_heads) % 2 != 0) {
        return bad("dim " + std::to_string(h.dim) + " is not n_heads " + std::to_string(h.n_heads) +
                   " times an even head size");
    }
    if (h.n_kv_heads > h.n_heads || h.n_heads % h.n_kv_heads != 0) {
        return bad("n_heads " + std::to_string(h.n_heads) + " is not a multiple of n_kv_heads " +
                   std::to_string(h.n_kv_heads));
    }
    return Status::Ok();
}

// Bytes the checkpoint described by `h` takes (the header is checked already). 128-bit, so no
// header value can overflow it.
unsigned __int128 ExpectedBytes(const Header& h) {
    using U = unsigned __int128;
    const U dim = h.dim, hidden = h.hidden_dim, layers = h.n_layers, seq = h.seq_len;
    const U vocab = h.vocab_size < 0 ? -static_cast<int64_t>(h.vocab_size) : h.vocab_size;
    const U head_size = dim / h.n_heads;
    const U kv_dim = head_size * h.n_kv_heads;
    U floats = vocab * dim                        // token_embedding_table
               + layers * dim * 2                 // rms_att, rms_ffn
               + layers * dim * dim * 2           // wq, wo
               + layers * kv_dim * dim * 2        // wk, wv
               + layers * hidden * dim * 3        // w1, w2, w3
               + dim                              // rms_final
               + seq * head_size;                 // freq_cis_real, freq_cis_imag
    if (h.vocab_size < 0) floats += vocab * dim;  // wcls
    return floats * 4 + sizeof(Header);
}

std::string U128String(unsigned __int128 v) {
    std::string s;
    do {
        s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
        v /= 10;
    } while (v != 0);
    return s;
}

// The tokenizer beside the checkpoint: tokenizer.bin, else the first tok*.bin by name.
Result<std::string> FindTokenizer(const std::string& checkpoint) {
    fs::path dir = fs::path(checkpoint).parent_path();
    if (dir.empty()) dir = ".";
    if (fs::exists(dir / "tokenizer.bin")) return (dir / "tokenizer.bin").string();
    std::vector<std::string> candidates;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("tok", 0) == 0 && name.size() > 7 &&
            name.compare(name.size() - 4, 4, ".bin") == 0 &&
            !fs::equivalent(entry.path(), checkpoint, ec)) {
            candidates.push_back(entry.path().string());
        }
    }
    if (candidates.empty()) {
        return NotFound(checkpoint +
                        ": no tokenizer.bin or tok*.bin beside the checkpoint (pass "
                        "the tokenizer file)");
    }
    return *std::min_element(candidates.begin(), candidates.end());
}

void Llama2cModel::Add(std::string name, std::vector<int64_t> shape, const uint8_t* data) {
    TensorInfo t;
    t.name = std::move(name);
    t.dtype = DType::kF32;
    t.shape = std::move(shape);
    t.data = data;
    t.num_bytes = static_cast<size_t>(t.NumElements()) * sizeof(float);
    const Status added = AddTensor(std::move(t));  // names come from this file's own table
    KV_CHECK(added.ok()) << added.ToString();
}

Status Llama2cModel::MapTensors(const Header& h) {
    const int64_t dim = h.dim, hidden = h.hidden_dim, layers = h.n_layers;
    const int64_t vocab = h.vocab_size < 0 ? -static_cast<int64_t>(h.vocab_size) : h.vocab_size;
    const int64_t head_size = dim / h.n_heads;
    const int64_t kv_dim = head_size * h.n_kv_heads;
    const uint8_t* p = file_.data() + sizeof(Header);
    // Takes the next array of `floats` floats.
    auto take = [&p](int64_t floats) {
        const uint8_t* start = p;
        p += static_cast<size_t>(floats) * sizeof(float);
        return start;
    };
    Add("token_embd.weight", {vocab, dim}, take(vocab * dim));
    // The arrays are grouped by kind, each holding all layers.
    struct PerLayer {
        const char* suffix;
        std::vector<int64_t> shape;
    };
    const PerLayer kinds[] = {
        {"attn_norm", {dim}},        {"attn_q", {dim, dim}},      {"attn_k", {kv_dim, dim}},
        {"attn_v", {kv_dim, dim}},   {"attn_output", {dim, dim}}, {"ffn_norm", {dim}},
        {"ffn_gate", {hidden, dim}}, {"ffn_down", {dim, hidden}}, {"ffn_up", {hidden, dim}},
    };
    for (const PerLayer& kind : kinds) {
        int64_t floats = 1;
        for (int64_t d : kind.shape) floats *= d;
        for (int64_t l = 0; l < layers; ++l)
            Add(LayerTensorName(l, kind.suffix), kind.shape, take(floats));
    }
    Add("output_norm.weight", {dim}, take(dim));
    take(static_cast<int64_t>(h.seq_len) * head_size);  // freq_cis_real, freq_cis_imag: unused
    if (h.vocab_size < 0) Add("output.weight", {vocab, dim}, take(vocab * dim));
    KV_CHECK_EQ(static_cast<size_t>(p - file_.data()), file_.size());
    return Status::Ok();
}

Result<std::unique_ptr<ModelFile>> Llama2cModel::Open(const std::string& path,
                                                      const OpenModelOptions& options) {
    std::unique_ptr<Llama2cModel> model(new Llama2cModel());
    KV_ASSIGN_OR_RETURN(model->file_, MappedFile::Open(path));
    model->path_ = path;
    const MappedFile& f = model->file_;
    if (f.size() >= 4) {
        uint32_t magic = 0;
        std::memcpy(&magic, f.data(), 4);
        if (magic == kVersionedMagic) {
            int32_t version = -1;
            if (f.size() >= 8) std::memcpy(&version, f.data() + 4, 4);
            return Unimplemented(path + ": llama2.c checkpoint version " + std::to_string(version) +
                                 " is not supported (only the legacy version 0 format is)");
        }
    }
    if (f.size() < sizeof(Header)) {
        return DataLoss(path + ": file of " + std::to_string(f.size()) +
                        " bytes is too short for a llama2.c header");
    }
    Header h;
    std::memcpy(&h, f.data(), sizeof(Header));
    KV_RETURN_IF_ERROR(CheckHeader(h, path));
    const unsigned __int128 expected = ExpectedBytes(h);
    if (expected != f.size()) {
        return DataLoss(path + ": file has " + std::to_string(f.size()) +
                        " bytes, a llama2.c checkpoint with this header has " +
                        U128String(expected));
    }
    KV_RETURN_IF_ERROR(model->MapTensors(h));

    const int64_t vocab = h.vocab_size < 0 ? -static_cast<int64_t>(h.vocab_size) : h.vocab_size;
    ModelSpec& s = model->spec_;
    s.architecture = "llama";
    s.num_layers = h.n_layers;
    s.hidden_size = h.dim;
    s.num_heads = h.n_heads;
    s.num_kv_heads = h.n_kv_heads;
    s.head_dim = h.dim / h.n_heads;
    s.ffn_size = h.hidden_dim;
    s.vocab_size = vocab;
    s.max_position = h.seq_len;
    s.rope_theta = 10000.0f;
    s.norm_eps = 1e-5f;
    s.tied_embeddings = h.vocab_size > 0;
    s.bos_token_id = 1;
    s.eos_token_id = 2;
    s.qk_layout = QkLayout::kInterleaved;

    std::string tokenizer_path = options.tokenizer_path;
    if (tokenizer_path.empty()) {
        KV_ASSIGN_OR_RETURN(tokenizer_path, FindTokenizer(path));
    }
    Result<TokenizerData> tokenizer = ReadLlama2cTokenizer(tokenizer_path, vocab);
    if (!tokenizer.ok()) return NameFile(tokenizer.status(), tokenizer_path);
    *model->tokenizer_data_ = std::move(tokenizer).value();
    if (model->tokenizer_data_->source.empty()) model->tokenizer_data_->source = tokenizer_path;
    return std::unique_ptr<ModelFile>(std::move(model));
}

}  // namespace

bool LooksLikeLlama2c(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    char bytes[sizeof(Header)] = {};
    in.read(bytes, sizeof(Header));
    const std::streamsize got = in.gcount();
    uint32_t magic = 0;
    if (got >= 4) std::memcpy(&magic, bytes, 4);
    if (magic == kVersionedMagic) return true;
    if (got != static_cast<std::streamsize>(sizeof(Header))) return false;
    Header h;
    std::memcpy(&h, bytes, sizeof(Header));
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    return !ec && CheckHeader(h, path).ok() && ExpectedBytes(h) == size;
}

Result<std::unique_ptr<ModelFile>> OpenLlama2cModel(const std::string& path,
                                                    const OpenModelOptions& options) {
    return Llama2cModel::Open(path, options);
}

}  // namespace kvshard::internal
