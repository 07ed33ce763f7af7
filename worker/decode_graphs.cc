#include "worker/decode_graphs.h"

#include <spdlog/spdlog.h>

#include <iterator>

#include "common/check.h"

namespace kvshard {

DecodeGraphs::DecodeGraphs(GraphCapture* capture) : capture_(capture) {
    KV_CHECK(capture_ != nullptr);
}

DecodeGraphs::~DecodeGraphs() { ReleaseAll(); }

void DecodeGraphs::ReleaseAll() {
    for (auto& [bucket, e] : buckets_) {
        if (e.graph >= 0) {
            capture_->ReleaseGraph(e.graph);
            ++stats_.releases;
        }
    }
    // A failed capture stays failed across generations: the op that refused it still does.
    for (auto it = buckets_.begin(); it != buckets_.end();) {
        it = it->second.failed ? std::next(it) : buckets_.erase(it);
    }
}

DecodeGraphs::Plan DecodeGraphs::Next(int64_t bucket, int64_t generation) {
    if (generation != generation_) {
        if (generation_ >= 0) ReleaseAll();
        generation_ = generation;
    }
    Entry& e = buckets_[bucket];
    if (e.failed) return {};
    if (e.graph >= 0)
        return {.mode = Mode::kReplay, .graph = e.graph, .collectives = e.collectives};
    if (!e.warmed) {
        e.warmed = true;
        return {};
    }
    return {.mode = Mode::kCapture};
}

void DecodeGraphs::Captured(int64_t bucket, const Result<int>& graph,
                            const CapturedCollectives& collectives) {
    Entry& e = buckets_[bucket];
    if (graph.ok()) {
        e.graph = *graph;
        e.collectives = collectives;
        ++stats_.captures;
        return;
    }
    e.failed = true;
    ++stats_.failed_captures;
    spdlog::warn(
        "model runner: the graph capture of decode bucket {} failed; its steps run "
        "eagerly: {}",
        bucket, graph.status().ToString());
}

int DecodeGraphs::graph_of(int64_t bucket) const {
    const auto it = buckets_.find(bucket);
    return it == buckets_.end() ? -1 : it->second.graph;
}

}  // namespace kvshard
