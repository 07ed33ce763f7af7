// kvshard_grammar_bench: the cost of the structured-output token mask per decode step.
//
//   kvshard_grammar_bench MODEL.gguf [MORE.gguf ...]
//
// The vocabulary is the tokens of every file given, in order (several files stand in for a larger
// vocabulary: SmolLM2 + GPT-2 + Llama 2 give 131k real tokens, about Llama 3's 128k). A JSON
// object valid for a small schema is tokenized with the first file's tokenizer and walked token by
// token, as a decode loop would: at each step the mask of the state is computed and the token
// must be in it. Four ways: the full trie walk (Vocabulary::ComputeMaskByWalk); the per-top
// precomputation (Vocabulary::ComputeMask) cold, as a first request with a new schema meets it,
// then warm, as later requests with that schema do; and Constraint's cache of whole masks.
// Prints microseconds of this thread's CPU time per step (the machine may be shared, so wall
// time would measure the neighbours).
#include <time.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "grammar/compilers.h"
#include "grammar/token_mask.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

using namespace kvshard;

namespace {
double CpuMicros() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) * 1e6 + double(t.tv_nsec) / 1e3;
}
}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [MORE.gguf ...]\n", argv[0]);
        return 2;
    }
    std::vector<std::string> bytes;
    std::vector<int32_t> ends;
    std::unique_ptr<Tokenizer> first;
    for (int i = 1; i < argc; ++i) {
        auto gguf = GgufFile::Open(argv[i]);
        if (!gguf.ok()) {
            std::fprintf(stderr, "%s\n", gguf.status().ToString().c_str());
            return 1;
        }
        auto data = TokenizerDataFromGguf(**gguf);
        if (!data.ok()) {
            std::fprintf(stderr, "%s\n", data.status().ToString().c_str());
            return 1;
        }
        auto tok = Tokenizer::Create(*data);
        if (!tok.ok()) {
            std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
            return 1;
        }
        for (int32_t id = 0; id < (*tok)->vocab_size(); ++id)
            bytes.push_back((*tok)->IsControl(id) ? std::string() : (*tok)->TokenBytes(id));
        if (i == 1) {
            ends.push_back((*tok)->eos_id());
            first = std::move(*tok);
        }
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto vocab = std::make_shared<grammar::Vocabulary>(bytes, ends);
    const double build_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const auto schema = nlohmann::json::parse(R"({"type":"object","properties":{
        "name":{"type":"string"},"age":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"}},
        "address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string"}},
                   "required":["city","zip"],"additionalProperties":false}},
        "required":["address","age","name","tags"],"additionalProperties":false})");
    auto grammar = grammar::CompileJsonSchema(schema, "schema");
    if (!grammar.ok()) {
        std::fprintf(stderr, "%s\n", grammar.status().ToString().c_str());
        return 1;
    }
    const std::string text =
        R"({"address": {"city": "San Francisco, California", "zip": "94107"}, "age": 42, )"
        R"("name": "Ada Lovelace, Countess of Lovelace", "tags": ["mathematics", "poetry", )"
        R"("analytical engine", "first programmer"]})";
    const std::vector<int32_t> ids = first->Encode(text, {});
    for (const int mode : {0, 1, 1, 2}) {
        static int pass = 0;
        ++pass;
        grammar::Constraint constraint(*grammar, vocab);
        grammar::TokenMask mask;
        double total_us = 0;
        for (int32_t id : ids) {
            const double s = CpuMicros();
            const grammar::TokenMask* m = &mask;
            if (mode == 2) {
                m = &constraint.Mask();
            } else if (mode == 1) {
                vocab->ComputeMask(constraint.state(), &mask);
            } else {
                vocab->ComputeMaskByWalk(constraint.state(), &mask);
            }
            total_us += CpuMicros() - s;
            if (!grammar::MaskHas(*m, id) || !constraint.Accept(id)) {
                std::fprintf(stderr, "token %d ('%s') refused\n", id, vocab->bytes(id).c_str());
                return 1;
            }
        }
        std::printf("vocab %lld tokens (%zu trie nodes, built in %.0f ms): %zu steps, %s mask "
                    "%.1f us/step (CPU)\n",
                    static_cast<long long>(vocab->size()), vocab->num_trie_nodes(), build_ms,
                    ids.size(),
                    mode == 0   ? "full trie walk"
                    : pass == 2 ? "per-top precomputed, cold"
                    : mode == 1 ? "per-top precomputed, warm"
                                : "whole masks cached",
                    total_us / double(ids.size()));
    }
    return 0;
}
