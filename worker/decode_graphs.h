// DecodeGraphs: a ModelRunner's captured decode steps, one graph per decode bucket
// (worker/decode_buckets.h), on a backend that captures graphs (kernels/backend.h GraphCapture:
// CUDA graphs). A bucket's first step runs eagerly (the warm-up: weight copies, GEMM plans and
// activation buffers are made at an op's first use, which a capture may not do), its second is
// captured and then replayed, and every later one replays. A capture that fails (an op refused
// inside it: EndCapture's error) leaves that bucket eager for good, logged once.
//
// A graph holds the pointers of the buffers it was captured with, so graphs belong to one
// generation of the runner's buffers (its workspace, step inputs and KV pool): a step of a newer
// generation releases every graph first and the buckets warm up again.
//
// Ownership: the GraphCapture (the runner's backend) is not owned and outlives this object,
// whose destructor releases the graphs it holds. Thread-safety: one owner thread (the runner's).
#pragma once

#include <cstdint>
#include <map>

#include "common/status.h"
#include "kernels/backend.h"

namespace kvshard {

// Counts since construction.
struct DecodeGraphStats {
    int64_t captures = 0;         // graphs captured
    int64_t replays = 0;          // steps run by replaying a graph
    int64_t failed_captures = 0;  // buckets left eager by a failed capture
    int64_t releases = 0;         // graphs released (buffers re-created)
};

// The all-reduces a decode step's capture queued (payload bytes, as CommStats counts them): a
// replay launches them from the graph, never through the collective's calls, so the runner counts
// them again, from these sizes, at each replay.
struct CapturedCollectives {
    int64_t layer_all_reduce_bytes = 0;
    int64_t embedding_all_reduce_bytes = 0;
    int64_t all_reduce_bytes() const { return layer_all_reduce_bytes + embedding_all_reduce_bytes; }
};

class DecodeGraphs {
  public:
    explicit DecodeGraphs(GraphCapture* capture);
    ~DecodeGraphs();
    DecodeGraphs(const DecodeGraphs&) = delete;
    DecodeGraphs& operator=(const DecodeGraphs&) = delete;

    enum class Mode { kEager, kCapture, kReplay };
    struct Plan {
        Mode mode = Mode::kEager;
        int graph = -1;                        // kReplay: the graph to replay
        CapturedCollectives collectives = {};  // kReplay: what its capture queued
    };
    // What a decode step of `bucket` does with buffers of `generation` (see above). A generation
    // other than the last one seen releases every graph first.
    Plan Next(int64_t bucket, int64_t generation);
    // The outcome of the capture Next asked for: the graph and the collectives its capture
    // queued, or why it failed (the bucket then stays eager; logged once per bucket).
    void Captured(int64_t bucket, const Result<int>& graph,
                  const CapturedCollectives& collectives = {});
    // A replay counted in stats().
    void Replayed() { ++stats_.replays; }
    // Releases every graph; the buckets warm up again.
    void ReleaseAll();

    const DecodeGraphStats& stats() const { return stats_; }
    // The graph of `bucket`, -1 when it has none (tests).
    int graph_of(int64_t bucket) const;

  private:
    struct Entry {
        bool warmed = false;  // one eager step ran with these buffers
        bool failed = false;  // its capture failed: eager for good
        int graph = -1;
        CapturedCollectives collectives;
    };
    GraphCapture* capture_;
    int64_t generation_ = -1;
    std::map<int64_t, Entry> buckets_;
    DecodeGraphStats stats_;
};

}  // namespace kvshard
