// Logging goes to stderr through spdlog so stdout stays the product's output (completion text,
// JSON). Each process sets its role prefix once ("generate", "coordinator", "worker r1").
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace kvshard {

// Level names: trace, debug, info, warn, error, off. Unknown names keep "info".
void InitLogging(const std::string& role, const std::string& level = "info");

}  // namespace kvshard
