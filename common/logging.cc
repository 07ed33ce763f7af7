#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace kvshard {

void InitLogging(const std::string& role, const std::string& level) {
    auto logger = spdlog::stderr_color_mt("kvshard:" + role);
    logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] [" + role + "] %v");
    spdlog::level::level_enum lvl = spdlog::level::from_str(level);
    if (level != "off" && lvl == spdlog::level::off) lvl = spdlog::level::info;
    logger->set_level(lvl);
    spdlog::set_default_logger(logger);
}

}  // namespace kvshard
