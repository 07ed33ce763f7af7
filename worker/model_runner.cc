#include "worker/model_runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_set>

#include "kernels/cpu_ops.h"

namespace kvshard {
namespace {

// Adds the wall time of its scope to `*seconds`.
class ScopedTimer {
  public:
    explicit ScopedTimer(double* seconds)
        : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
    ~ScopedTimer() {
        *seconds_ +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }

  private:
    double* seconds_;
    std::chrono::steady_clock::time_point start_;
};

}  // namespace

ModelRunner::ModelRunner(const ModelSpec& spec, ModelWeights weights, const RunnerOptions& options,
                         Collective* collective)
    : spec_(spec),
      weights_(std::move(weights)),
      collective_(collective),
      max_context_(options.max_context > 0 ? options.max_context
                   : spec.max_position > 0 ? spec.max_position
                                           : 4096),
      q_dim_(weights_.layout.num_q_heads() * spec.head_dim),
      kv_dim_(weights_.layout.num_kv_heads() * spec.head_dim),
      ffn_dim_(weights_.layout.ffn.size()),
      weight_bytes_(weights_.NumBytes()) {
    const ShardSpec& shard = weights_.layout.shard;
    KV_CHECK(shard.tp == 1 || collective_ != nullptr)
        << "tp " << shard.tp << " without a collective";
    if (collective_ != nullptr) {
        KV_CHECK(collective_->size() == shard.tp && collective_->rank() == shard.rank)
            << "collective rank " << collective_->rank() << "/" << collective_->size()
            << " for the weights of rank " << shard.rank << "/" << shard.tp;
    }
    const RopeScaling& rs = spec.rope_scaling;
    cpu::RopeScalingParams params;
    switch (rs.type) {
        case RopeScalingType::kNone:
            params.type = 0;
            break;
        case RopeScalingType::kLinear:
            params.type = 1;
            break;
        case RopeScalingType::kLlama3:
            params.type = 2;
            break;
    }
    params.factor = rs.factor;
    params.low_freq_factor = rs.low_freq_factor;
    params.high_freq_factor = rs.high_freq_factor;
    params.original_max_position = rs.original_max_position;
    inv_freq_.resize(static_cast<size_t>(spec.head_dim / 2));
    cpu::RopeInvFreq(spec.head_dim, spec.rope_theta, params, inv_freq_.data());
    const int64_t num_blocks = options.num_kv_blocks == RunnerOptions::kOneSequence
                                   ? (max_context_ + options.block_size - 1) / options.block_size
                                   : options.num_kv_blocks;
    if (num_blocks > 0) {
        KvPoolConfig pc{.num_blocks = num_blocks,
                        .block_size = options.block_size,
                        .num_layers = spec.num_layers,
                        .num_kv_heads = weights_.layout.num_kv_heads(),
                        .head_dim = spec.head_dim,
                        .storage = options.kv_storage};
        Result<std::unique_ptr<KvPool>> pool = KvPool::Create(pc);
        KV_CHECK(pool.ok()) << pool.status().ToString();
        pool_ = std::move(*pool);
    }
}

Status ModelRunner::ValidatePaged(const SequenceChunk& c) const {
    const std::string seq = "sequence " + std::to_string(c.seq_id);
    if (pool_ == nullptr)
        return InvalidArgument(seq + ": a block table but this runner has no KV pool");
    const int64_t bs = pool_->config().block_size;
    const auto n = static_cast<int64_t>(c.tokens.size());
    if (static_cast<int64_t>(c.slot_mapping.size()) != n) {
        return InvalidArgument(seq + ": " + std::to_string(c.slot_mapping.size()) + " slots for " +
                               std::to_string(n) + " tokens");
    }
    const int64_t end = c.start_pos + n;
    if (static_cast<int64_t>(c.block_table.size()) * bs < end) {
        return InvalidArgument(seq + ": block table of " + std::to_string(c.block_table.size()) +
                               " blocks cannot hold " + std::to_string(end) + " positions");
    }
    for (int32_t b : c.block_table) {
        if (!pool_->ValidBlock(b))
            return InvalidArgument(seq + ": block " + std::to_string(b) + " outside the pool");
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = c.start_pos + i;
        const int64_t expected = int64_t(c.block_table[pos / bs]) * bs + pos % bs;
        if (c.slot_mapping[i] != expected) {
            return InvalidArgument(seq + ": slot " + std::to_string(c.slot_mapping[i]) +
                                   " for position " + std::to_string(pos) + " is not in its block");
        }
    }
    return Status::Ok();
}

Status ModelRunner::CopyBlocks(std::span<const std::pair<int32_t, int32_t>> src_dst) {
    for (const auto& [src, dst] : src_dst) {
        if (pool_ == nullptr || !pool_->ValidBlock(src) || !pool_->ValidBlock(dst)) {
            return InvalidArgument("block copy " + std::to_string(src) + " -> " +
                                   std::to_string(dst) + " outside the KV pool");
        }
    }
    for (const auto& [src, dst] : src_dst) pool_->CopyBlock(src, dst);
    return Status::Ok();
}

Status ModelRunner::Validate(std::span<const SequenceChunk> batch) const {
    std::unordered_set<int64_t> seen;
    for (const SequenceChunk& c : batch) {
        const std::string seq = "sequence " + std::to_string(c.seq_id);
        if (c.tokens.empty()) return InvalidArgument(seq + ": empty chunk");
        if (!seen.insert(c.seq_id).second) return InvalidArgument(seq + ": twice in one batch");
        if (!c.block_table.empty()) {
            KV_RETURN_IF_ERROR(ValidatePaged(c));
        } else if (const int64_t cached = CachedLength(c.seq_id); c.start_pos != cached) {
            return InvalidArgument(seq + ": start_pos " + std::to_string(c.start_pos) + " but " +
                                   std::to_string(cached) + " positions are cached");
        }
        const int64_t end = c.start_pos + static_cast<int64_t>(c.tokens.size());
        if (end > max_context_) {
            return OutOfRange(seq + ": " + std::to_string(end) +
                              " positions exceed the context of " + std::to_string(max_context_));
        }
        for (int32_t t : c.tokens) {
            if (t < 0 || t >= spec_.vocab_size) {
                return InvalidArgument(seq + ": token id " + std::to_string(t) +
                                       " outside the vocabulary of " +
                                       std::to_string(spec_.vocab_size));
            }
        }
    }
    return Status::Ok();
}

Status ModelRunner::Embed(std::span<const SequenceChunk> batch) {
    const int64_t hidden = spec_.hidden_size;
    const IndexRange& vocab = weights_.layout.vocab;
    int64_t r = 0;
    for (const SequenceChunk& c : batch) {
        for (size_t i = 0; i < c.tokens.size(); ++i, ++r) {
            float* row = &x_[r * hidden];
            if (vocab.Contains(c.tokens[i])) {
                std::memcpy(row, &weights_.embedding[(c.tokens[i] - vocab.begin) * hidden],
                            static_cast<size_t>(hidden) * sizeof(float));
            } else {
                std::fill(row, row + hidden, 0.0f);
            }
            positions_[r] = static_cast<int32_t>(c.start_pos + static_cast<int64_t>(i));
        }
        if (c.block_table.empty()) {
            SequenceKv& kv = cache_[c.seq_id];
            if (kv.k.empty()) {
                kv.k.resize(static_cast<size_t>(spec_.num_layers));
                kv.v.resize(static_cast<size_t>(spec_.num_layers));
            }
        }
    }
    if (collective_ == nullptr) return Status::Ok();
    // One rank holds each row; the others add zeros, so the sum is that row exactly.
    ScopedTimer timer(&comm_stats_.seconds);
    KV_RETURN_IF_ERROR(collective_->AllReduceSum(x_.data(), r * hidden));
    comm_stats_.embedding_all_reduce_bytes += r * hidden * int64_t(sizeof(float));
    return Status::Ok();
}

void ModelRunner::Attend(std::span<const SequenceChunk> batch, int64_t l) {
    const int64_t hd = spec_.head_dim;
    const int64_t num_q_heads = weights_.layout.num_q_heads();
    const int64_t num_kv_heads = weights_.layout.num_kv_heads();
    const int32_t* kv_head_of_q = weights_.layout.kv_head_of_q.data();
    // Write K/V of the new tokens, then attend over everything cached. Every chunk of the step
    // writes before any reads, so chunks may share blocks (a fork and its parent).
    cpu::PagedKvLayer paged;
    if (pool_ != nullptr) paged = pool_->Layer(l);
    int64_t r = 0;
    for (const SequenceChunk& c : batch) {
        const auto n = static_cast<int64_t>(c.tokens.size());
        if (!c.block_table.empty()) {
            cpu::PagedKvWrite(paged, &k_[r * kv_dim_], &v_[r * kv_dim_], kv_dim_,
                              c.slot_mapping.data(), n);
        }
        r += n;
    }
    r = 0;
    for (const SequenceChunk& c : batch) {
        const auto n = static_cast<int64_t>(c.tokens.size());
        if (!c.block_table.empty()) {
            cpu::PagedAttention(&q_[r * q_dim_], paged, c.block_table.data(), &att_[r * q_dim_], n,
                                c.start_pos, num_q_heads, kv_head_of_q);
            r += n;
            continue;
        }
        SequenceKv& kv = cache_[c.seq_id];
        std::vector<float>& kc = kv.k[static_cast<size_t>(l)];
        std::vector<float>& vc = kv.v[static_cast<size_t>(l)];
        const int64_t total = c.start_pos + n;
        kc.resize(static_cast<size_t>(total * kv_dim_));
        vc.resize(static_cast<size_t>(total * kv_dim_));
        std::memcpy(&kc[c.start_pos * kv_dim_], &k_[r * kv_dim_],
                    static_cast<size_t>(n * kv_dim_) * sizeof(float));
        std::memcpy(&vc[c.start_pos * kv_dim_], &v_[r * kv_dim_],
                    static_cast<size_t>(n * kv_dim_) * sizeof(float));
        cpu::Attention(&q_[r * q_dim_], kc.data(), vc.data(), &att_[r * q_dim_], n, c.start_pos,
                       total, num_q_heads, num_kv_heads, hd, kv_dim_, kv_head_of_q);
        r += n;
    }
}

Status ModelRunner::AddRowParallel(const float* in, const std::vector<float>& w, int64_t rows,
                                   int64_t k) {
    const int64_t hidden = spec_.hidden_size;
    const int64_t n = rows * hidden;
    if (k == 0) {
        std::fill(partial_.begin(), partial_.begin() + n, 0.0f);  // a rank without MLP columns
    } else {
        cpu::MatMulWT(in, w.data(), partial_.data(), rows, hidden, k);
    }
    if (collective_ != nullptr) {
        ScopedTimer timer(&comm_stats_.seconds);
        KV_RETURN_IF_ERROR(collective_->AllReduceSum(partial_.data(), n));
        comm_stats_.layer_all_reduce_bytes += n * int64_t(sizeof(float));
    }
    cpu::Add(x_.data(), partial_.data(), x_.data(), n);
    return Status::Ok();
}

Status ModelRunner::Classify(int64_t num_out, std::vector<float>* logits) {
    const int64_t hidden = spec_.hidden_size;
    const int64_t vocab = spec_.vocab_size;
    logits->resize(static_cast<size_t>(num_out * vocab));
    if (collective_ == nullptr) {
        cpu::MatMulWT(xn_.data(), weights_.classifier(), logits->data(), num_out, vocab, hidden);
        return Status::Ok();
    }
    // Each rank's slice, padded to the same length for AllGather, then put in place.
    const ShardLayout& sl = weights_.layout;
    const int64_t local = sl.vocab.size();
    const int64_t pad = sl.vocab_padded;
    const int tp = sl.shard.tp;
    local_logits_.assign(static_cast<size_t>(num_out * pad), 0.0f);
    gathered_logits_.resize(static_cast<size_t>(tp * num_out * pad));
    // Computed densely into the gather buffer (free until the gather), then spaced out.
    float* dense = gathered_logits_.data();
    cpu::MatMulWT(xn_.data(), weights_.classifier(), dense, num_out, local, hidden);
    for (int64_t b = 0; b < num_out; ++b) {
        std::memcpy(&local_logits_[b * pad], dense + b * local,
                    static_cast<size_t>(local) * sizeof(float));
    }
    {
        ScopedTimer timer(&comm_stats_.seconds);
        KV_RETURN_IF_ERROR(
            collective_->AllGather(local_logits_.data(), num_out * pad, gathered_logits_.data()));
    }
    comm_stats_.logits_all_gather_bytes += tp * num_out * pad * int64_t(sizeof(float));
    for (int q = 0; q < tp; ++q) {
        const IndexRange range = VocabRange(vocab, q, tp);
        for (int64_t b = 0; b < num_out; ++b) {
            std::memcpy(logits->data() + b * vocab + range.begin,
                        &gathered_logits_[(q * num_out + b) * pad],
                        static_cast<size_t>(range.size()) * sizeof(float));
        }
    }
    return Status::Ok();
}

Status ModelRunner::Forward(std::span<const SequenceChunk> batch, std::vector<float>* logits,
                            const std::function<void(int64_t layer)>& after_layer_kv) {
    KV_RETURN_IF_ERROR(Validate(batch));
    const int64_t hidden = spec_.hidden_size;
    const int64_t hd = spec_.head_dim;
    const int64_t num_q_heads = weights_.layout.num_q_heads();
    const int64_t num_kv_heads = weights_.layout.num_kv_heads();
    int64_t rows = 0;
    for (const SequenceChunk& c : batch) rows += static_cast<int64_t>(c.tokens.size());
    auto fit = [](std::vector<float>& buf, int64_t n) { buf.resize(static_cast<size_t>(n)); };
    fit(x_, rows * hidden);
    fit(xn_, rows * hidden);
    fit(partial_, rows * hidden);
    fit(q_, rows * q_dim_);
    fit(k_, rows * kv_dim_);
    fit(v_, rows * kv_dim_);
    fit(att_, rows * q_dim_);
    fit(gate_, rows * ffn_dim_);
    fit(up_, rows * ffn_dim_);
    positions_.resize(static_cast<size_t>(rows));

    KV_RETURN_IF_ERROR(Embed(batch));
    for (int64_t l = 0; l < spec_.num_layers; ++l) {
        const LayerWeights& w = weights_.layers[static_cast<size_t>(l)];
        cpu::RmsNorm(x_.data(), w.attn_norm.data(), xn_.data(), rows, hidden, spec_.norm_eps);
        cpu::MatMulWT(xn_.data(), w.wq.data(), q_.data(), rows, q_dim_, hidden);
        cpu::MatMulWT(xn_.data(), w.wk.data(), k_.data(), rows, kv_dim_, hidden);
        cpu::MatMulWT(xn_.data(), w.wv.data(), v_.data(), rows, kv_dim_, hidden);
        cpu::Rope(q_.data(), positions_.data(), rows, num_q_heads, hd, inv_freq_.data());
        cpu::Rope(k_.data(), positions_.data(), rows, num_kv_heads, hd, inv_freq_.data());
        Attend(batch, l);
        if (after_layer_kv) after_layer_kv(l);
        KV_RETURN_IF_ERROR(AddRowParallel(att_.data(), w.wo, rows, q_dim_));

        cpu::RmsNorm(x_.data(), w.ffn_norm.data(), xn_.data(), rows, hidden, spec_.norm_eps);
        cpu::MatMulWT(xn_.data(), w.w_gate.data(), gate_.data(), rows, ffn_dim_, hidden);
        cpu::MatMulWT(xn_.data(), w.w_up.data(), up_.data(), rows, ffn_dim_, hidden);
        cpu::SiluMul(gate_.data(), up_.data(), gate_.data(), rows, ffn_dim_);
        KV_RETURN_IF_ERROR(AddRowParallel(gate_.data(), w.w_down, rows, ffn_dim_));
    }

    // Final norm and classifier on the last row of each chunk only.
    const auto num_out = static_cast<int64_t>(batch.size());
    int64_t r = 0;
    for (int64_t b = 0; b < num_out; ++b) {
        r += static_cast<int64_t>(batch[static_cast<size_t>(b)].tokens.size());
        std::memcpy(&xn_[b * hidden], &x_[(r - 1) * hidden],
                    static_cast<size_t>(hidden) * sizeof(float));
    }
    cpu::RmsNorm(xn_.data(), weights_.output_norm.data(), xn_.data(), num_out, hidden,
                 spec_.norm_eps);
    KV_RETURN_IF_ERROR(Classify(num_out, logits));

    for (const SequenceChunk& c : batch) {
        if (c.block_table.empty()) cache_[c.seq_id].length += static_cast<int64_t>(c.tokens.size());
    }
    tokens_processed_ += rows;
    return Status::Ok();
}

void ModelRunner::Release(int64_t seq_id) { cache_.erase(seq_id); }

int64_t ModelRunner::CachedLength(int64_t seq_id) const {
    auto it = cache_.find(seq_id);
    return it == cache_.end() ? 0 : it->second.length;
}

}  // namespace kvshard
