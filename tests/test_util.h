// Helpers shared by the test suites: locating the shared test models, temporary files.
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace kvshard::testing {

// Path of a file under the shared models folder: $KVSHARD_SHARED_MODELS, else
// <source>/../shared/models. Returns "" when the file does not exist.
std::string SharedModel(const std::string& relative);

// Path of the default model (models/ in the source tree, fetched by scripts/fetch-model, or
// $KVSHARD_DEFAULT_MODEL); "" when absent.
std::string DefaultModel();

// A fresh directory under the build tree's temp folder, removed when the object dies.
class TempDir {
public:
    TempDir();
    ~TempDir();
    const std::string& path() const { return path_; }
    std::string File(const std::string& name) const { return path_ + "/" + name; }

private:
    std::string path_;
};

void WriteFile(const std::string& path, const std::string& bytes);
std::string ReadFile(const std::string& path);

}  // namespace kvshard::testing

// Skips the current test when `path` is empty (the fixture is not on this machine).
#define KV_REQUIRE_FIXTURE(path, what)                                              \
    do {                                                                            \
        if ((path).empty()) GTEST_SKIP() << "fixture not found: " << (what);        \
    } while (0)
