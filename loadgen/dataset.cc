#include "loadgen/dataset.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvshard::loadgen {

const std::vector<std::string_view>& BenchWords() {
    static const std::vector<std::string_view> kWords = {
        "the",       "of",      "and",    "to",     "in",        "is",        "you",     "that",
        "it",        "he",      "was",    "for",    "on",        "are",       "as",      "with",
        "his",       "they",    "at",     "be",     "this",      "have",      "from",    "or",
        "one",       "had",     "by",     "word",   "but",       "not",       "what",    "all",
        "were",      "we",      "when",   "your",   "can",       "said",      "there",   "use",
        "an",        "each",    "which",  "she",    "do",        "how",       "their",   "if",
        "will",      "up",      "other",  "about",  "out",       "many",      "then",    "them",
        "these",     "so",      "some",   "her",    "would",     "make",      "like",    "him",
        "into",      "time",    "has",    "look",   "two",       "more",      "write",   "go",
        "see",       "number",  "no",     "way",    "could",     "people",    "my",      "than",
        "first",     "water",   "been",   "call",   "who",       "oil",       "its",     "now",
        "find",      "long",    "down",   "day",    "did",       "get",       "come",    "made",
        "may",       "part",    "over",   "new",    "sound",     "take",      "only",    "little",
        "work",      "know",    "place",  "year",   "live",      "me",        "back",    "give",
        "most",      "very",    "after",  "thing",  "our",       "just",      "name",    "good",
        "man",       "think",   "say",    "great",  "where",     "help",      "through", "much",
        "before",    "line",    "right",  "too",    "mean",      "old",       "any",     "same",
        "tell",      "boy",     "follow", "came",   "want",      "show",      "also",    "around",
        "form",      "three",   "small",  "set",    "put",       "end",       "does",    "another",
        "well",      "large",   "must",   "big",    "even",      "such",      "because", "turn",
        "here",      "why",     "ask",    "went",   "men",       "read",      "need",    "land",
        "different", "home",    "us",     "move",   "try",       "kind",      "hand",    "picture",
        "again",     "change",  "off",    "play",   "spell",     "air",       "away",    "animal",
        "house",     "point",   "page",   "letter", "mother",    "answer",    "found",   "study",
        "still",     "learn",   "should", "world",  "high",      "every",     "near",    "add",
        "food",      "between", "own",    "below",  "country",   "plant",     "last",    "school",
        "father",    "keep",    "tree",   "never",  "start",     "city",      "earth",   "eye",
        "light",     "thought", "head",   "under",  "story",     "saw",       "left",    "few",
        "while",     "along",   "might",  "close",  "something", "seem",      "next",    "hard",
        "open",      "example", "begin",  "life",   "always",    "those",     "both",    "paper",
        "together",  "got",     "group",  "often",  "run",       "important", "until",   "children",
        "side",      "feet",    "car",    "mile",   "night",     "walk",      "white",   "sea",
        "began",     "grow",    "took",   "river",  "four",
    };
    return kWords;
}

Result<DatasetKind> ParseDatasetKind(std::string_view name) {
    if (name == "random") return DatasetKind::kRandom;
    if (name == "shared-prefix") return DatasetKind::kSharedPrefix;
    if (name == "chat") return DatasetKind::kChat;
    if (name == "sharegpt") return DatasetKind::kShareGpt;
    return InvalidArgument("--dataset: unknown dataset '" + std::string(name) +
                           "' (random, shared-prefix, chat, sharegpt)");
}

namespace {

std::string Words(int64_t n, std::mt19937_64& rng) {
    const auto& words = BenchWords();
    std::uniform_int_distribution<size_t> pick(0, words.size() - 1);
    std::string out;
    for (int64_t i = 0; i < n; ++i) {
        if (i > 0) out += ' ';
        out += words[pick(rng)];
    }
    return out;
}

int64_t UniformAround(int64_t center, double ratio, std::mt19937_64& rng) {
    const auto lo = static_cast<int64_t>(std::floor(static_cast<double>(center) * (1.0 - ratio)));
    const auto hi = static_cast<int64_t>(std::ceil(static_cast<double>(center) * (1.0 + ratio)));
    return std::uniform_int_distribution<int64_t>(std::max<int64_t>(lo, 1),
                                                  std::max<int64_t>(hi, 1))(rng);
}

int64_t LogNormal(int64_t median, double sigma, int64_t min, std::mt19937_64& rng) {
    std::lognormal_distribution<double> dist(std::log(static_cast<double>(median)), sigma);
    const auto v = static_cast<int64_t>(std::llround(dist(rng)));
    return std::clamp<int64_t>(v, min, std::max<int64_t>(min, 8 * median));
}

Status Positive(const char* flag, int64_t v) {
    if (v >= 1) return Status::Ok();
    return InvalidArgument(std::string(flag) + " must be >= 1, got " + std::to_string(v));
}

}  // namespace

Result<std::vector<BenchPrompt>> MakeDataset(const DatasetOptions& o) {
    if (o.kind == DatasetKind::kShareGpt) {
        return InvalidArgument("--dataset sharegpt is read from --dataset-path, not generated");
    }
    KV_RETURN_IF_ERROR(Positive("--num-requests", o.num_requests));
    KV_RETURN_IF_ERROR(Positive("--output-len", o.output_len));
    if (o.kind == DatasetKind::kSharedPrefix) {
        KV_RETURN_IF_ERROR(Positive("--num-groups", o.num_groups));
        KV_RETURN_IF_ERROR(Positive("--prefix-len", o.prefix_len));
        KV_RETURN_IF_ERROR(Positive("--suffix-len", o.suffix_len));
    } else {
        KV_RETURN_IF_ERROR(Positive("--input-len", o.input_len));
    }
    if (!(o.range_ratio >= 0.0 && o.range_ratio < 1.0)) {
        return InvalidArgument("--range-ratio must be in [0, 1), got " +
                               std::to_string(o.range_ratio));
    }
    std::mt19937_64 rng(o.seed);
    std::vector<BenchPrompt> prompts;
    std::vector<std::string> prefixes;
    if (o.kind == DatasetKind::kSharedPrefix) {
        for (int64_t g = 0; g < o.num_groups; ++g) prefixes.push_back(Words(o.prefix_len, rng));
    }
    for (int64_t i = 0; i < o.num_requests; ++i) {
        BenchPrompt p;
        switch (o.kind) {
            case DatasetKind::kRandom:
                p.num_words = UniformAround(o.input_len, o.range_ratio, rng);
                p.output_len = UniformAround(o.output_len, o.range_ratio, rng);
                p.text = Words(p.num_words, rng);
                break;
            case DatasetKind::kSharedPrefix:
                p.prefix = prefixes[static_cast<size_t>(i % o.num_groups)];
                p.text = Words(o.suffix_len, rng);
                p.num_words = o.prefix_len + o.suffix_len;
                p.output_len = o.output_len;
                break;
            case DatasetKind::kChat:
                p.num_words = LogNormal(o.input_len, 0.8, 4, rng);
                p.output_len = LogNormal(o.output_len, 0.6, 1, rng);
                p.text = Words(p.num_words, rng);
                break;
            case DatasetKind::kShareGpt:  // refused above
                break;
        }
        prompts.push_back(std::move(p));
    }
    return prompts;
}

}  // namespace kvshard::loadgen
