// Decode buckets, the padding of a step's packed inputs, and the graph cache's states.
#include "worker/decode_buckets.h"

#include <gtest/gtest.h>

#include <vector>

#include "worker/decode_graphs.h"

namespace kvshard {
namespace {

TEST(DecodeBuckets, FollowVllmSizesUpToMaxNumSeqs) {
    using V = std::vector<int64_t>;
    EXPECT_EQ(DecodeBuckets(1), V({1}));
    EXPECT_EQ(DecodeBuckets(2), V({1, 2}));
    EXPECT_EQ(DecodeBuckets(3), V({1, 2, 3}));
    EXPECT_EQ(DecodeBuckets(4), V({1, 2, 4}));
    EXPECT_EQ(DecodeBuckets(8), V({1, 2, 4, 8}));
    EXPECT_EQ(DecodeBuckets(20), V({1, 2, 4, 8, 16, 20}));
    const V b64 = DecodeBuckets(64);
    EXPECT_EQ(b64, V({1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64}));
    EXPECT_EQ(DecodeBuckets(256).size(), 35u);
}

TEST(DecodeBuckets, BucketForIsTheSmallestThatHolds) {
    const std::vector<int64_t> b = DecodeBuckets(20);
    const int64_t expected[] = {0,  1,  2,  4,  4,  8,  8,  8,  8,  16, 16,
                                16, 16, 16, 16, 16, 16, 20, 20, 20, 20};
    for (int64_t n = 1; n <= 20; ++n) EXPECT_EQ(BucketFor(b, n), expected[n]) << n;
    EXPECT_EQ(BucketFor(b, 21), 0);  // above the last bucket: not padded
}

// Three decode rows of three sequences in two KV cache groups, padded to a bucket of 8.
TEST(PadStepInputs, PaddedRowsWriteNoKvAndBelongToNoSequence) {
    constexpr int64_t kRows = 8, kSeqs = 8, kGroups = 2;
    std::vector<int32_t> ids(kRows, 7), positions(kRows, 9);
    std::vector<int64_t> slots(kGroups * kRows, 5);
    std::vector<int32_t> query_starts = {0, 1, 2, 3, 99, 99, 99, 99, 99};
    std::vector<int32_t> context_lens(kSeqs, 99), last_rows(kSeqs, 99);
    std::vector<int32_t> table_starts(kGroups * (kSeqs + 1), 99);
    // Group 0: tables of 2, 1, 3 blocks; group 1: 1, 1, 1.
    const int32_t g0[] = {0, 2, 3, 6}, g1[] = {6, 7, 8, 9};
    for (int i = 0; i < 4; ++i) {
        table_starts[i] = g0[i];
        table_starts[kSeqs + 1 + i] = g1[i];
    }
    const StepInputsView view{.ids = ids.data(),
                              .positions = positions.data(),
                              .slots = slots.data(),
                              .slots_stride = kRows,
                              .query_starts = query_starts.data(),
                              .context_lens = context_lens.data(),
                              .table_starts = table_starts.data(),
                              .table_starts_stride = kSeqs + 1,
                              .last_rows = last_rows.data(),
                              .num_groups = kGroups};
    PadStepInputs(view, 3, 3, kRows, kSeqs);
    for (int64_t r = 0; r < kRows; ++r) {
        EXPECT_EQ(ids[r], r < 3 ? 7 : 0) << r;
        EXPECT_EQ(positions[r], r < 3 ? 9 : 0) << r;
        for (int64_t g = 0; g < kGroups; ++g) EXPECT_EQ(slots[g * kRows + r], r < 3 ? 5 : kPadSlot);
    }
    for (int64_t s = 3; s < kSeqs; ++s) {
        EXPECT_EQ(query_starts[s + 1], 3) << s;  // no rows
        EXPECT_EQ(context_lens[s], 0) << s;
        EXPECT_EQ(last_rows[s], s) << s;  // padded row 3 + (s - 3)
        EXPECT_EQ(table_starts[s + 1], 6) << s;
        EXPECT_EQ(table_starts[kSeqs + 1 + s + 1], 9) << s;
    }
    // The real part is untouched.
    EXPECT_EQ(query_starts[3], 3);
    EXPECT_EQ(context_lens[2], 99);
    EXPECT_EQ(table_starts[3], 6);
    // Fewer padded rows than padded sequences: the extra ones classify the last padded row.
    PadStepInputs(view, 6, 3, 7, 5);
    EXPECT_EQ(last_rows[3], 6);
    EXPECT_EQ(last_rows[4], 6);
    EXPECT_EQ(query_starts[5], 6);
}

// Counts what the cache asks of the backend.
class FakeCapture : public GraphCapture {
  public:
    Status BeginCapture() override { return Status::Ok(); }
    Result<int> EndCapture() override { return next_++; }
    Status Replay(int) override { return Status::Ok(); }
    void ReleaseGraph(int graph) override { released.push_back(graph); }
    std::vector<int> released;

  private:
    int next_ = 0;
};

TEST(DecodeGraphs, WarmUpThenCaptureThenReplayPerBucketAndGeneration) {
    FakeCapture capture;
    using M = DecodeGraphs::Mode;
    {
        DecodeGraphs graphs(&capture);
        EXPECT_EQ(graphs.Next(8, 1).mode, M::kEager);    // warm-up
        EXPECT_EQ(graphs.Next(8, 1).mode, M::kCapture);  // then captured
        graphs.Captured(8, capture.EndCapture());
        EXPECT_EQ(graphs.graph_of(8), 0);
        const DecodeGraphs::Plan p = graphs.Next(8, 1);
        EXPECT_EQ(p.mode, M::kReplay);
        EXPECT_EQ(p.graph, 0);
        EXPECT_EQ(graphs.Next(4, 1).mode, M::kEager);  // every bucket warms up on its own
        EXPECT_EQ(graphs.Next(4, 1).mode, M::kCapture);
        graphs.Captured(4, capture.EndCapture());
        // A failed capture leaves its bucket eager for good, across generations too.
        EXPECT_EQ(graphs.Next(2, 1).mode, M::kEager);
        EXPECT_EQ(graphs.Next(2, 1).mode, M::kCapture);
        graphs.Captured(2, Unavailable("an op refused inside the capture"));
        EXPECT_EQ(graphs.Next(2, 1).mode, M::kEager);
        EXPECT_EQ(graphs.stats().failed_captures, 1);
        // New buffers: every graph is released and the buckets warm up again.
        EXPECT_EQ(graphs.Next(8, 2).mode, M::kEager);
        EXPECT_EQ(capture.released, std::vector<int>({1, 0}));  // buckets 4 and 8
        EXPECT_EQ(graphs.graph_of(4), -1);
        EXPECT_EQ(graphs.Next(8, 2).mode, M::kCapture);
        graphs.Captured(8, capture.EndCapture());
        EXPECT_EQ(graphs.Next(2, 2).mode, M::kEager);
        EXPECT_EQ(graphs.Next(2, 2).mode, M::kEager);
        EXPECT_EQ(graphs.stats().captures, 3);
        EXPECT_EQ(graphs.stats().releases, 2);
    }
    // The destructor releases what is left (graph 2, bucket 8's second).
    EXPECT_EQ(capture.released.size(), 3u);
    EXPECT_EQ(capture.released.back(), 2);
}

// A replay carries the collectives its capture queued (what the runner counts per replay), and a
// recapture with new buffers replaces them.
TEST(DecodeGraphs, ReplaysCarryTheirCapturesCollectives) {
    FakeCapture capture;
    DecodeGraphs graphs(&capture);
    (void)graphs.Next(4, 1);
    (void)graphs.Next(4, 1);
    graphs.Captured(4, capture.EndCapture(),
                    {.layer_all_reduce_bytes = 400, .embedding_all_reduce_bytes = 40});
    DecodeGraphs::Plan p = graphs.Next(4, 1);
    ASSERT_EQ(p.mode, DecodeGraphs::Mode::kReplay);
    EXPECT_EQ(p.collectives.layer_all_reduce_bytes, 400);
    EXPECT_EQ(p.collectives.embedding_all_reduce_bytes, 40);
    EXPECT_EQ(p.collectives.all_reduce_bytes(), 440);
    (void)graphs.Next(4, 2);  // new buffers: warm up and capture again
    (void)graphs.Next(4, 2);
    graphs.Captured(4, capture.EndCapture(), {.layer_all_reduce_bytes = 8});
    p = graphs.Next(4, 2);
    ASSERT_EQ(p.mode, DecodeGraphs::Mode::kReplay);
    EXPECT_EQ(p.collectives.all_reduce_bytes(), 8);
    // Eager and capture plans carry none.
    EXPECT_EQ(graphs.Next(2, 2).collectives.all_reduce_bytes(), 0);
}

}  // namespace
}  // namespace kvshard
