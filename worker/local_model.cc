#include "worker/local_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

namespace kvshard {

std::vector<int32_t> LocalModel::EncodePrompt(const std::string& text) const {
    EncodeOptions opts;
    opts.add_bos = tokenizer->data().add_bos;
    if (text.empty()) {
        return opts.add_bos && tokenizer->bos_id() >= 0 ? std::vector<int32_t>{tokenizer->bos_id()}
                                                        : std::vector<int32_t>{};
    }
    return tokenizer->Encode(text, opts);
}

std::vector<int32_t> LocalModel::StopTokenIds() const {
    std::vector<int32_t> ids;
    auto add = [&](int32_t id) {
        if (id >= 0 && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    };
    add(file->spec().eos_token_id);
    add(tokenizer->eos_id());
    if (file->format() == ModelFormat::kLlama2c) add(file->spec().bos_token_id);
    return ids;
}

Result<LocalModel> LoadLocalModel(const std::string& path, const LocalModelOptions& options) {
    const auto t0 = std::chrono::steady_clock::now();
    LocalModel m;
    KV_ASSIGN_OR_RETURN(m.file, OpenModel(path, options.open));
    KV_ASSIGN_OR_RETURN(m.tokenizer, Tokenizer::Create(m.file->shared_tokenizer_data()));
    if (options.shard.tp > 1 &&
        (options.collective == nullptr || options.collective->size() != options.shard.tp ||
         options.collective->rank() != options.shard.rank)) {
        return InvalidArgument("rank " + std::to_string(options.shard.rank) + " of tp " +
                               std::to_string(options.shard.tp) +
                               " needs a communicator of that rank and size");
    }
    KV_ASSIGN_OR_RETURN(
        m.runner, MakeModelRunner(*m.file, options.shard, options.runner, options.collective));
    const size_t weight_bytes = m.runner->weight_bytes();
    const std::string layout = m.runner->layout().ToString();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spdlog::info("loaded {} ({}) in {:.2f} s: {}; {}; {} weights {:.1f} MiB on {}", path,
                 ModelFormatName(m.file->format()), secs, m.file->spec().ToString(), layout,
                 WeightFormatName(options.runner.weight_format),
                 static_cast<double>(weight_bytes) / (1024.0 * 1024.0),
                 m.runner->backend().Describe());
    return m;
}

}  // namespace kvshard
