// LocalModel: a model file opened, its tokenizer built and its weights (the whole model, or one
// tensor-parallel rank's slices) loaded into a ModelRunner on this process — everything
// `kvshard generate` and the benchmarks need for one worker.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "worker/model_runner.h"

namespace kvshard {

struct LocalModelOptions {
    OpenModelOptions open;
    RunnerOptions runner;
    // The rank whose slices to load, and the communicator of its instance (not owned; outlives
    // the model; nullptr at tp 1). See worker/shard.h.
    ShardSpec shard;
    Collective* collective = nullptr;
};

struct LocalModel {
    std::unique_ptr<ModelFile> file;
    std::unique_ptr<Tokenizer> tokenizer;
    std::unique_ptr<ModelRunner> runner;

    // Prompt ids as the model's own tokenizer settings say (BOS when the model adds one).
    std::vector<int32_t> EncodePrompt(const std::string& text) const;
    // Tokens that end generation: EOS, and BOS for llama2.c checkpoints (as llama2.c's run.c
    // stops when it samples BOS).
    std::vector<int32_t> StopTokenIds() const;
};

Result<LocalModel> LoadLocalModel(const std::string& path, const LocalModelOptions& options = {});

}  // namespace kvshard
