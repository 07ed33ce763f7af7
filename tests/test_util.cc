#include "tests/test_util.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/build_config.h"

namespace fs = std::filesystem;

namespace kvshard::testing {

std::string SharedModel(const std::string& relative) {
    const char* env = std::getenv("KVSHARD_SHARED_MODELS");
    fs::path base = env != nullptr ? fs::path(env) : fs::path(KVSHARD_SOURCE_DIR) / ".." / "shared" / "models";
    fs::path p = base / relative;
    return fs::exists(p) ? fs::canonical(p).string() : "";
}

std::string DefaultModel() {
    const char* env = std::getenv("KVSHARD_DEFAULT_MODEL");
    fs::path p = env != nullptr ? fs::path(env)
                                : fs::path(KVSHARD_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
    return fs::exists(p) ? p.string() : "";
}

TempDir::TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvshard-test-XXXXXX").string();
    char* made = ::mkdtemp(tmpl.data());
    path_ = made != nullptr ? made : "";
    if (path_.empty()) ADD_FAILURE() << "mkdtemp failed";
}

TempDir::~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
}

void WriteFile(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

}  // namespace kvshard::testing
