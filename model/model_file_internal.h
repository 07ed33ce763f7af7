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
// True when `path` reads as a llama2.c checkpoint whatever its name: export.py's versioned magic,
// or a header that passes the opener's checks and implies exactly the file's size. OpenModel
// takes a file whose name does not end in .bin for llama2.c only then; any other file is not a
// model file.
bool LooksLikeLlama2c(const std::string& path);

// `status` with "<path>: " in front unless its message already names `path` (errors of readers
// written elsewhere, e.g. the tokenizer readers).
Status NameFile(Status status, const std::string& path);

// "[49152, 576]".
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace kvshard::internal
