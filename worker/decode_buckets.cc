#include "worker/decode_buckets.h"

#include <algorithm>

#include "common/check.h"

namespace kvshard {

std::vector<int64_t> DecodeBuckets(int64_t max_num_seqs) {
    KV_CHECK_GE(max_num_seqs, 1);
    std::vector<int64_t> buckets;
    for (int64_t b : {1, 2, 4}) {
        if (b < max_num_seqs) buckets.push_back(b);
    }
    for (int64_t b = 8; b < max_num_seqs; b += 8) buckets.push_back(b);
    buckets.push_back(max_num_seqs);
    return buckets;
}

int64_t BucketFor(const std::vector<int64_t>& buckets, int64_t num_seqs) {
    KV_CHECK_GE(num_seqs, 1);
    const auto it = std::lower_bound(buckets.begin(), buckets.end(), num_seqs);
    return it == buckets.end() ? 0 : *it;
}

void PadStepInputs(const StepInputsView& in, int64_t rows, int64_t num_seqs, int64_t padded_rows,
                   int64_t padded_seqs) {
    KV_CHECK(rows >= 0 && num_seqs >= 0 && padded_rows >= rows && padded_seqs >= num_seqs)
        << "rows " << rows << " -> " << padded_rows << ", sequences " << num_seqs << " -> "
        << padded_seqs;
    KV_CHECK(padded_seqs == num_seqs || padded_rows > rows)
        << "padded sequences need a padded row to classify";
    for (int64_t r = rows; r < padded_rows; ++r) {
        in.ids[r] = 0;
        in.positions[r] = 0;
        for (int64_t g = 0; g < in.num_groups; ++g) in.slots[g * in.slots_stride + r] = kPadSlot;
    }
    // The padded sequences own no rows: the real rows end at query_starts[num_seqs] == rows, and
    // the padded rows after them belong to no sequence, so attention never reads or writes them.
    for (int64_t s = num_seqs; s < padded_seqs; ++s) {
        in.query_starts[s + 1] = static_cast<int32_t>(rows);
        in.context_lens[s] = 0;
        in.last_rows[s] = static_cast<int32_t>(std::min(rows + (s - num_seqs), padded_rows - 1));
        for (int64_t g = 0; g < in.num_groups; ++g) {
            int32_t* starts = in.table_starts + g * in.table_starts_stride;
            starts[s + 1] = starts[num_seqs];
        }
    }
}

}  // namespace kvshard
