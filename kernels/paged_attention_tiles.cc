// Cutting a step's attention into tiles for the threads (kernels/paged_attention_tiles.h).
#include "kernels/paged_attention_tiles.h"

#include <algorithm>

namespace kvshard::cpu::paged_attention {

int64_t PlanTiles(const Problem& p, int threads, std::vector<Tile>& tiles) {
    const int64_t num_kv_heads = p.kv.num_kv_heads;
    const auto& b = p.batch;
    for (int64_t s = 0; s < b.num_seqs; ++s) {
        const int64_t rows = b.query_starts[s + 1] - b.query_starts[s];
        if (rows == 0) continue;
        const int64_t pos_offset = int64_t{b.context_lens[s]} - b.query_starts[s + 1];
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            const int64_t group = p.group_starts[g + 1] - p.group_starts[g];
            for (int64_t h0 = 0; h0 < group; h0 += kMaxLanes) {
                const int64_t heads = std::min(kMaxLanes, group - h0);
                // Rows per tile: as many as fill the lanes, spread evenly over the tiles.
                const int64_t max_rows = std::max<int64_t>(1, kMaxLanes / heads);
                const int64_t num_tiles = (rows + max_rows - 1) / max_rows;
                for (int64_t k = 0; k < num_tiles; ++k) {
                    Tile t;
                    t.seq = static_cast<int32_t>(s);
                    t.kv_head = static_cast<int32_t>(g);
                    t.head_begin = static_cast<int32_t>(h0);
                    t.head_end = static_cast<int32_t>(h0 + heads);
                    t.row_begin = static_cast<int32_t>(b.query_starts[s] + rows * k / num_tiles);
                    t.row_end =
                        static_cast<int32_t>(b.query_starts[s] + rows * (k + 1) / num_tiles);
                    // A window starts the walk at the chunk holding the first row's first
                    // visible position (positions before every row's window are not read).
                    const int64_t first_pos = pos_offset + t.row_begin;
                    t.kv_begin = b.window > 0 ? static_cast<int32_t>(
                                                    std::max<int64_t>(0, first_pos - b.window + 1) /
                                                    kChunk * kChunk)
                                              : 0;
                    t.kv_end = static_cast<int32_t>(pos_offset + t.row_end);
                    t.partial = -1;
                    t.num_splits = 1;
                    t.split = 0;
                    t.cost = (t.row_end - t.row_begin) * heads * (t.kv_end - t.kv_begin);
                    tiles.push_back(t);
                }
            }
        }
    }
    int64_t num_partials = 0;
    const int64_t target = 4 * int64_t{threads};
    if (threads > 1 && static_cast<int64_t>(tiles.size()) < target) {
        int64_t total = 0;
        for (const Tile& t : tiles) total += t.cost;
        const size_t unsplit = tiles.size();
        for (size_t i = 0; i < unsplit; ++i) {
            Tile t = tiles[i];  // a copy: push_back below may move the vector
            // A split starts at or before the tile's first position, so every lane sees one
            // position in each split (the merge then has finite maxima to work with).
            // (With a window, a lane whose window starts after a split sees nothing there; the
            // merge gives such a split no weight.)
            const int64_t first_pos = t.kv_end - (t.row_end - t.row_begin);
            const int64_t begin = t.kv_begin;
            const int64_t by_share = (target * t.cost + total - 1) / std::max<int64_t>(total, 1);
            const int64_t by_length = (first_pos - begin + 1) / kMinSplitPositions;
            const int64_t splits = std::clamp<int64_t>(std::min(by_share, by_length), 1, 64);
            if (splits == 1) continue;
            // Chunks starting <= first_pos.
            const int64_t chunks = (first_pos - begin + kChunk) / kChunk;
            const int32_t end = t.kv_end;
            t.partial = static_cast<int32_t>(num_partials);
            t.num_splits = static_cast<int32_t>(splits);
            for (int64_t k = 0; k < splits; ++k) {
                Tile piece = t;
                piece.partial = static_cast<int32_t>(num_partials++);
                piece.split = static_cast<int32_t>(k);
                piece.kv_begin = static_cast<int32_t>(begin + chunks * k / splits * kChunk);
                piece.kv_end = k + 1 < splits
                                   ? static_cast<int32_t>(begin + chunks * (k + 1) / splits * kChunk)
                                   : end;
                piece.cost = t.cost / splits;
                if (k == 0) {
                    tiles[i] = piece;
                } else {
                    tiles.push_back(piece);
                }
            }
        }
    }
    std::stable_sort(tiles.begin(), tiles.end(),
                     [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
    return num_partials;
}

}  // namespace kvshard::cpu::paged_attention
