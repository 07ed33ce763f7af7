// Writes the synthetic model of every architecture (model/synthetic_gguf.h, SyntheticArchGguf) to
// <folder>/<architecture>.gguf: the files tests/golden/make_arch_llamacpp.py runs llama.cpp on.
// tests/worker/arch_model_test.cc rebuilds the same files (same seed) in the test itself.
//
//   kvshard_write_arch_models <folder>
#include <cstdio>
#include <string>

#include "model/synthetic_gguf.h"

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s <folder>\n", argv[0]);
        return 2;
    }
    for (const char* arch : {"llama", "mistral", "qwen2", "qwen3", "gemma3"}) {
        const std::string path = std::string(argv[1]) + "/" + arch + ".gguf";
        const kvshard::Status st = kvshard::SyntheticArchGguf(arch).WriteFile(path);
        if (!st.ok()) {
            std::fprintf(stderr, "%s\n", st.ToString().c_str());
            return 1;
        }
        std::printf("%s\n", path.c_str());
    }
    return 0;
}
