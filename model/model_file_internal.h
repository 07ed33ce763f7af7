// Private to model/: the per-format openers behind OpenModel. Each fills a ModelFile (spec,
// tensors, tokenizer data); OpenModel then checks the result the same way for every format.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/model_file.h"

namespace kvshard::internal {

Result<std::unique_ptr<ModelFile>> OpenGgufModel(const std::string& path);
// `dir`: a Hugging Face model folder.
Result<std::unique_ptr<ModelFile>> OpenHfModel(const std::string& dir);
Result<std::unique_ptr<ModelFile>> OpenLlama2cModel(const std::string& path,
                                                    const OpenModelOptions& options);

// `status` with "<path>: " in front unless its message already names `path` (errors of readers
// written elsewhere, e.g. the tokenizer readers).
Status NameFile(Status status, const std::string& path);

// "[49152, 576]".
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace kvshard::internal
