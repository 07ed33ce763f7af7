#include "worker/shard.h"

#include <sstream>

#include "kv/kv_geometry.h"

namespace kvshard {
namespace {

// floor(r·n/tp): the even split of n items, earlier ranks rounding down.
int64_t SplitPoint(int64_t n, int rank, int tp) { return n * rank / tp; }

}  // namespace

IndexRange FfnRange(int64_t ffn_size, int rank, int tp) {
    auto point = [&](int r) {
        if (r >= tp) return ffn_size;
        const int64_t p = SplitPoint(ffn_size, r, tp);
        return p - p % ShardLayout::kColumnAlign;
    };
    return {point(rank), point(rank + 1)};
}

IndexRange VocabRange(int64_t vocab_size, int rank, int tp) {
    return {SplitPoint(vocab_size, rank, tp), SplitPoint(vocab_size, rank + 1, tp)};
}

Result<ShardLayout> MakeShardLayout(const ModelSpec& spec, const ShardSpec& shard) {
    if (shard.tp < 1)
        return InvalidArgument("tp must be at least 1, got " + std::to_string(shard.tp));
    if (shard.rank < 0 || shard.rank >= shard.tp) {
        return InvalidArgument("rank " + std::to_string(shard.rank) + " outside [0, " +
                               std::to_string(shard.tp) + ")");
    }
    // Query and KV heads by kv/'s one rule (kv/kv_geometry.h), which names the numbers when tp
    // exceeds the query heads.
    KV_ASSIGN_OR_RETURN(
        kv::HeadRange kv_heads,
        kv::LocalKvHeadRange(spec.num_heads, spec.num_kv_heads, shard.tp, shard.rank));
    ShardLayout l;
    l.shard = shard;
    const kv::HeadRange q_heads = kv::QueryHeadRange(spec.num_heads, shard.tp, shard.rank);
    l.q_heads = {q_heads.begin, q_heads.end};
    l.kv_heads = {kv_heads.begin, kv_heads.end};
    const int64_t group = spec.num_heads / spec.num_kv_heads;
    l.ffn = FfnRange(spec.ffn_size, shard.rank, shard.tp);
    l.vocab = VocabRange(spec.vocab_size, shard.rank, shard.tp);
    l.vocab_padded = (spec.vocab_size + shard.tp - 1) / shard.tp;
    for (int64_t h = l.q_heads.begin; h < l.q_heads.end; ++h) {
        l.kv_head_of_q.push_back(static_cast<int32_t>(h / group - l.kv_heads.begin));
    }
    return l;
}

std::string ShardLayout::ToString() const {
    std::ostringstream s;
    s << "rank " << shard.rank << "/" << shard.tp << ": query heads [" << q_heads.begin << ", "
      << q_heads.end << "), KV heads [" << kv_heads.begin << ", " << kv_heads.end
      << "), MLP columns [" << ffn.begin << ", " << ffn.end << "), vocabulary [" << vocab.begin
      << ", " << vocab.end << ")";
    return s.str();
}

}  // namespace kvshard
