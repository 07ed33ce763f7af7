#include "worker/model_runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "kernels/cpu_ops.h"
#include "worker/decode_buckets.h"

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

constexpr size_t kAlign = 64;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

cpu::RopeScalingParams RopeParams(const RopeScaling& rs) {
    cpu::RopeScalingParams params;
    switch (rs.type) {
        case RopeScalingType::kNone:
            params.type = cpu::RopeScalingParams::kNone;
            break;
        case RopeScalingType::kLinear:
            params.type = cpu::RopeScalingParams::kLinear;
            break;
        case RopeScalingType::kLlama3:
            params.type = cpu::RopeScalingParams::kLlama3;
            break;
    }
    params.factor = rs.factor;
    params.low_freq_factor = rs.low_freq_factor;
    params.high_freq_factor = rs.high_freq_factor;
    params.original_max_position = rs.original_max_position;
    return params;
}

kv::KvCacheGroups GroupsOf(const ModelSpec& spec) {
    Result<kv::KvCacheGroups> groups = kv::MakeKvCacheGroups(kv::LayerWindows(spec));
    KV_CHECK(groups.ok()) << groups.status().ToString();
    KV_CHECK_LE(groups->num_groups(), kv::kMaxKvCacheGroups);
    return std::move(*groups);
}

}  // namespace

ModelRunner::ModelRunner(const ModelSpec& spec, std::unique_ptr<Backend> backend,
                         ModelWeights weights, const RunnerOptions& options, Collective* collective)
    : spec_(spec),
      kv_groups_(GroupsOf(spec)),
      backend_(std::move(backend)),
      weights_(std::move(weights)),
      collective_(collective),
      rank_collective_(dynamic_cast<RankCollective*>(collective)),
      max_context_(options.max_context > 0 ? options.max_context
                   : spec.max_position > 0 ? spec.max_position
                                           : 4096),
      q_dim_(weights_.layout.num_q_heads() * spec.head_dim),
      kv_dim_(weights_.layout.num_kv_heads() * spec.head_dim),
      qkv_dim_(q_dim_ + 2 * kv_dim_),
      ffn_dim_(weights_.layout.ffn.size()),
      options_(options) {
    KV_CHECK(backend_ != nullptr);
    const ShardSpec& shard = weights_.layout.shard;
    KV_CHECK(shard.tp == 1 || collective_ != nullptr)
        << "tp " << shard.tp << " without a collective";
    if (collective_ != nullptr) {
        KV_CHECK(collective_->size() == shard.tp && collective_->rank() == shard.rank)
            << "collective rank " << collective_->rank() << "/" << collective_->size()
            << " for the weights of rank " << shard.rank << "/" << shard.tp;
    }
    if (options.fuse_rope_kv_write) rope_kv_writer_ = dynamic_cast<RopeKvWriter*>(backend_.get());
    if (auto* packer = dynamic_cast<DecodeWeightPacker*>(backend_.get());
        packer != nullptr && options.pack_decode_weights) {
        // The products' weights and the classifier, tied to the embedding or not (the gather
        // reads the embedding's stored rows, never the copy).
        std::vector<WeightView*> products;
        for (LayerWeights& w : weights_.layers) {
            products.insert(products.end(), {&w.qkv, &w.wo, &w.gate_up, &w.down});
        }
        products.push_back(weights_.output.data != nullptr ? &weights_.output
                                                           : &weights_.embedding);
        for (WeightView* w : products) {
            Result<BackendBuffer> copy = packer->PackForDecode(w);
            KV_CHECK(copy.ok()) << copy.status().ToString();
            if (copy->data() != nullptr) decode_copies_.push_back(std::move(*copy));
        }
    }
    // Constants: the RoPE frequencies (computed once on the host, as the model defines them; the
    // windowed layers' own when they have a base of their own) and the KV head of each query
    // head, copied to the backend once.
    const int64_t half = spec.head_dim / 2;
    std::vector<float> inv_freq(static_cast<size_t>(2 * half));
    cpu::RopeInvFreq(spec.head_dim, spec.rope_theta, RopeParams(spec.rope_scaling),
                     inv_freq.data());
    if (spec.rope_theta_local > 0) {
        cpu::RopeInvFreq(spec.head_dim, spec.rope_theta_local, RopeParams(RopeScaling{}),
                         inv_freq.data() + half);
    } else {
        std::copy(inv_freq.begin(), inv_freq.begin() + half, inv_freq.begin() + half);
    }
    const std::vector<int32_t>& map = weights_.layout.kv_head_of_q;
    const size_t freq_bytes = Aligned(inv_freq.size() * sizeof(float));
    Result<BackendBuffer> constants =
        backend_->Allocate(freq_bytes + Aligned(map.size() * sizeof(int32_t)));
    KV_CHECK(constants.ok()) << constants.status().ToString();
    constants_ = std::move(*constants);
    auto* base = constants_.As<uint8_t>();
    KV_CHECK(backend_->CopyToDevice(base, inv_freq.data(), inv_freq.size() * sizeof(float)).ok());
    KV_CHECK(
        backend_->CopyToDevice(base + freq_bytes, map.data(), map.size() * sizeof(int32_t)).ok());
    KV_CHECK(backend_->Synchronize().ok());
    inv_freq_ = reinterpret_cast<const float*>(base);
    inv_freq_local_ = inv_freq_ + half;
    kv_head_of_q_ = reinterpret_cast<const int32_t*>(base + freq_bytes);

    const int64_t groups = kv_groups_.num_groups();
    const int64_t num_blocks =
        options.num_kv_blocks == RunnerOptions::kOneSequence
            ? groups * ((max_context_ + options.block_size - 1) / options.block_size)
            : options.num_kv_blocks;
    KvPoolConfig pc{.num_blocks = num_blocks,
                    .block_size = options.block_size,
                    .num_layers = spec.num_layers,
                    .layers_per_group = kv_groups_.layers_per_group,
                    .slot_of_layer = kv_groups_.slot_of_layer,
                    .num_kv_heads = weights_.layout.num_kv_heads(),
                    .head_dim = spec.head_dim,
                    .storage = options.kv_storage};
    Result<std::unique_ptr<KvPool>> pool = KvPool::Create(pc, *backend_);
    KV_CHECK(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    const int64_t tables =
        groups * options.max_step_seqs * ((max_context_ + pc.block_size - 1) / pc.block_size);
    KV_CHECK(EnsureWorkspace(std::max<int64_t>(1, options.max_step_tokens),
                             std::max<int64_t>(1, options.max_step_seqs), tables)
                 .ok());
    buckets_ = DecodeBuckets(std::max<int64_t>(1, options.max_step_seqs));
    auto* capture = dynamic_cast<GraphCapture*>(backend_.get());
    const Status graphs_ok =
        CheckCudaGraphs(options, backend_->kind(), capture != nullptr, shard.tp);
    KV_CHECK(graphs_ok.ok()) << graphs_ok.ToString();
    if (capture != nullptr && options.cuda_graphs.value_or(false)) {
        capture_ = capture;
        graphs_ = std::make_unique<DecodeGraphs>(capture_);
    }
}

Status ModelRunner::CopyBlocks(std::span<const std::pair<int32_t, int32_t>> src_dst) {
    if (src_dst.empty()) return Status::Ok();
    std::vector<int32_t> pairs;
    pairs.reserve(2 * src_dst.size());
    for (const auto& [src, dst] : src_dst) {
        if (!pool_->ValidBlock(src) || !pool_->ValidBlock(dst)) {
            return InvalidArgument("block copy " + std::to_string(src) + " -> " +
                                   std::to_string(dst) + " outside the KV pool");
        }
        pairs.push_back(src);
        pairs.push_back(dst);
    }
    KV_ASSIGN_OR_RETURN(BackendBuffer device_pairs,
                        backend_->Allocate(pairs.size() * sizeof(int32_t)));
    KV_RETURN_IF_ERROR(
        backend_->CopyToDevice(device_pairs.data(), pairs.data(), pairs.size() * sizeof(int32_t)));
    backend_->CopyBlocks(pool_->data(), pool_->bytes_per_block(), device_pairs.As<int32_t>(),
                         static_cast<int64_t>(src_dst.size()));
    return backend_->Synchronize();
}

Status ModelRunner::RowParallel(const float* in, const WeightView& w, int64_t rows,
                                const float* next_norm, const WeightView& post_norm) {
    const int64_t hidden = spec_.hidden_size;
    const int64_t n = rows * hidden;
    if (w.cols == 0) {
        // A rank without MLP columns adds nothing of its own.
        std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
        KV_RETURN_IF_ERROR(backend_->CopyToDevice(partial_, zeros.data(), zeros.size() * 4));
        KV_RETURN_IF_ERROR(backend_->Synchronize());
    } else {
        backend_->MatMul(in, rows, w, partial_);
    }
    if (collective_ != nullptr) {
        ScopedTimer timer(&comm_stats_.seconds);
        KV_RETURN_IF_ERROR(collective_->AllReduceSum(partial_, n));
        comm_stats_.layer_all_reduce_bytes += n * int64_t(sizeof(float));
    }
    if (post_norm.data != nullptr) {
        // Gemma: the block's output is normed before it joins the residual.
        backend_->RmsNorm(partial_, static_cast<const float*>(post_norm.data), partial_, rows,
                          hidden, spec_.norm_eps);
    }
    if (next_norm != nullptr) {
        backend_->AddRmsNorm(x_, partial_, next_norm, xn_, rows, hidden, spec_.norm_eps);
    } else {
        backend_->Add(x_, partial_, n);
    }
    return Status::Ok();
}

Status ModelRunner::Classify(int64_t num_out, std::vector<float>* logits) {
    const int64_t vocab = spec_.vocab_size;
    logits->resize(static_cast<size_t>(num_out * vocab));
    if (collective_ == nullptr && backend_->kind() == BackendKind::kCpu &&
        weights_.classifier().rows == vocab) {
        // The CPU backend's memory is the host's: the product goes straight into the caller's
        // vector, without the 196 KB copy a SmolLM2 token's logits would take (~15 µs).
        backend_->MatMul(xn_, num_out, weights_.classifier(), logits->data());
        return backend_->Synchronize();
    }
    if (collective_ == nullptr) {
        backend_->MatMul(xn_, num_out, weights_.classifier(), logits_);
        KV_RETURN_IF_ERROR(
            backend_->CopyToHost(logits->data(), logits_, logits->size() * sizeof(float)));
        return backend_->Synchronize();
    }
    // Each rank computes its slice densely (num_out × local) at the start of a buffer of
    // num_out × pad floats, the same count on every rank, and AllGather hands every rank all of
    // them; the slices are then put in place.
    const ShardLayout& sl = weights_.layout;
    const int64_t pad = sl.vocab_padded;
    const int tp = sl.shard.tp;
    backend_->MatMul(xn_, num_out, weights_.classifier(), logits_);
    {
        ScopedTimer timer(&comm_stats_.seconds);
        KV_RETURN_IF_ERROR(collective_->AllGather(logits_, num_out * pad, gathered_));
    }
    comm_stats_.logits_all_gather_bytes += tp * num_out * pad * int64_t(sizeof(float));
    host_logits_.resize(static_cast<size_t>(tp * num_out * pad));
    KV_RETURN_IF_ERROR(
        backend_->CopyToHost(host_logits_.data(), gathered_, host_logits_.size() * sizeof(float)));
    KV_RETURN_IF_ERROR(backend_->Synchronize());
    for (int q = 0; q < tp; ++q) {
        const IndexRange range = VocabRange(vocab, q, tp);
        const float* dense = &host_logits_[static_cast<size_t>(q * num_out * pad)];
        for (int64_t b = 0; b < num_out; ++b) {
            std::memcpy(logits->data() + b * vocab + range.begin, dense + b * range.size(),
                        static_cast<size_t>(range.size()) * sizeof(float));
        }
    }
    return Status::Ok();
}

Status ModelRunner::ClassifyAllRows(std::span<const SequenceChunk> batch,
                                    const RowLogitsFn& on_rows) {
    const int64_t hidden = spec_.hidden_size;
    int64_t chunk_row0 = 0;  // the chunk's first row in the step
    for (size_t c = 0; c < batch.size(); ++c) {
        const auto n = static_cast<int64_t>(batch[c].tokens.size());
        for (int64_t first = 0; batch[c].all_logits && first < n; first += ws_seqs_) {
            const int64_t m = std::min(ws_seqs_, n - first);
            slice_rows_.resize(static_cast<size_t>(m));
            for (int64_t i = 0; i < m; ++i)
                slice_rows_[static_cast<size_t>(i)] = static_cast<int32_t>(chunk_row0 + first + i);
            // last_rows_ holds ws_seqs_ indices; the step's own were used by now.
            KV_RETURN_IF_ERROR(backend_->CopyToDevice(last_rows_, slice_rows_.data(),
                                                      slice_rows_.size() * sizeof(int32_t)));
            backend_->GatherRows(x_, hidden, last_rows_, m, xn_);
            backend_->RmsNorm(xn_, static_cast<const float*>(weights_.output_norm.data), xn_, m,
                              hidden, spec_.norm_eps);
            KV_RETURN_IF_ERROR(Classify(m, &slice_logits_));
            if (on_rows) on_rows(c, first, m, slice_logits_.data());
        }
        chunk_row0 += n;
    }
    return Status::Ok();
}

Status ModelRunner::Forward(std::span<const SequenceChunk> batch, std::vector<float>* logits,
                            const std::function<void(int64_t layer)>& after_layer_kv,
                            const RowLogitsFn& on_rows) {
    KV_RETURN_IF_ERROR(Validate(batch));
    int64_t rows = 0;
    for (const SequenceChunk& c : batch) rows += static_cast<int64_t>(c.tokens.size());
    const auto num_seqs = static_cast<int64_t>(batch.size());
    // A pure-decode step runs padded to its bucket, as its graph when it has one.
    const int64_t bucket = PaddedBucket(batch, static_cast<bool>(after_layer_kv));
    const int64_t step_seqs = bucket > 0 ? bucket : num_seqs;
    const int64_t step_rows = rows + (step_seqs - num_seqs);
    KV_RETURN_IF_ERROR(PackInputs(batch, rows, step_rows, step_seqs));
    const DecodeGraphs::Plan plan = graphs_ != nullptr && bucket > 0
                                        ? graphs_->Next(bucket, buffers_generation_)
                                        : DecodeGraphs::Plan{};
    switch (plan.mode) {
        case DecodeGraphs::Mode::kEager:
            KV_RETURN_IF_ERROR(QueueStep(step_rows, step_seqs, after_layer_kv));
            break;
        case DecodeGraphs::Mode::kCapture:
            KV_RETURN_IF_ERROR(CaptureStep(bucket, step_rows, step_seqs));
            break;
        case DecodeGraphs::Mode::kReplay:
            KV_RETURN_IF_ERROR(capture_->Replay(plan.graph));
            graphs_->Replayed();
            CountReplayedCollectives(plan.collectives);
            break;
    }
    // The real sequences' last rows come first in xn_: the padded ones are never classified.
    KV_RETURN_IF_ERROR(Classify(num_seqs, logits));
    KV_RETURN_IF_ERROR(ClassifyAllRows(batch, on_rows));
    tokens_processed_ += rows;
    return Status::Ok();
}

Status ModelRunner::QueueStep(int64_t rows, int64_t num_seqs,
                              const std::function<void(int64_t layer)>& after_layer_kv) {
    const int64_t hidden = spec_.hidden_size;
    const int64_t hd = spec_.head_dim;
    const int64_t num_q_heads = weights_.layout.num_q_heads();
    const int64_t num_kv_heads = weights_.layout.num_kv_heads();
    const float eps = spec_.norm_eps;
    PagedAttentionBatch attention{.num_seqs = num_seqs,
                                  .query_starts = query_starts_,
                                  .context_lens = context_lens_,
                                  .block_table_starts = table_starts_,
                                  .block_tables = tables_,
                                  .max_query_rows = step_max_query_rows_};

    backend_->Embedding(weights_.embedding, weights_.layout.vocab.begin, ids_, rows, x_);
    if (collective_ != nullptr) {
        // One rank holds each row; the others add zeros, so the sum is that row exactly.
        ScopedTimer timer(&comm_stats_.seconds);
        KV_RETURN_IF_ERROR(collective_->AllReduceSum(x_, rows * hidden));
        comm_stats_.embedding_all_reduce_bytes += rows * hidden * int64_t(sizeof(float));
    }
    if (spec_.embedding_scale != 1.0f) backend_->Scale(x_, spec_.embedding_scale, rows * hidden);
    const auto& layers = weights_.layers;
    backend_->RmsNorm(x_, static_cast<const float*>(layers[0].attn_norm.data), xn_, rows, hidden,
                      eps);
    for (int64_t l = 0; l < spec_.num_layers; ++l) {
        const LayerWeights& w = layers[static_cast<size_t>(l)];
        const bool windowed = spec_.IsWindowed(l);
        const float* inv_freq = windowed ? inv_freq_local_ : inv_freq_;
        attention.window = windowed ? spec_.sliding_window : 0;
        // The layer's KV cache group: its blocks and the new tokens' slots in them.
        const int64_t group = kv_groups_.group_of_layer[static_cast<size_t>(l)];
        attention.block_table_starts = table_starts_ + group * (ws_seqs_ + 1);
        const int64_t* slots = slots_ + group * ws_rows_;
        backend_->MatMul(xn_, rows, w.qkv, qkv_);
        if (w.qkv_bias.data != nullptr) {
            backend_->AddBias(qkv_, static_cast<const float*>(w.qkv_bias.data), rows, qkv_dim_);
        }
        if (w.q_norm.data != nullptr) {
            backend_->HeadRmsNorm(qkv_, qkv_dim_, rows, num_q_heads, hd,
                                  static_cast<const float*>(w.q_norm.data), eps);
            backend_->HeadRmsNorm(qkv_ + q_dim_, qkv_dim_, rows, num_kv_heads, hd,
                                  static_cast<const float*>(w.k_norm.data), eps);
        }
        // Every chunk of the step writes before any reads, so chunks may share blocks (a fork
        // and its parent).
        const PagedKvLayer kv = pool_->Layer(l);
        if (rope_kv_writer_ != nullptr) {
            rope_kv_writer_->RopeKvWrite(qkv_, qkv_ + q_dim_, qkv_ + q_dim_ + kv_dim_, qkv_dim_,
                                         positions_, slots, rows, num_q_heads, inv_freq, kv);
        } else {
            // The K heads follow the Q heads in a QKV row: one call rotates both, computing
            // each row's cos/sin once for the two.
            backend_->Rope(qkv_, qkv_dim_, positions_, rows, num_q_heads + num_kv_heads, hd,
                           inv_freq);
            backend_->KvWrite(kv, qkv_ + q_dim_, qkv_ + q_dim_ + kv_dim_, qkv_dim_, slots, rows);
        }
        if (after_layer_kv) {
            KV_RETURN_IF_ERROR(backend_->Synchronize());
            after_layer_kv(l);
        }
        backend_->PagedAttention(qkv_, qkv_dim_, kv, attention, att_, num_q_heads, kv_head_of_q_);
        KV_RETURN_IF_ERROR(RowParallel(att_, w.wo, rows, static_cast<const float*>(w.ffn_norm.data),
                                       w.post_attn_norm));

        backend_->MatMul(xn_, rows, w.gate_up, gate_up_);
        if (spec_.activation == Activation::kGeluTanh) {
            backend_->GeluTanhMul(gate_up_, rows, ffn_dim_, act_);
        } else {
            backend_->SiluMul(gate_up_, rows, ffn_dim_, act_);
        }
        const float* next_norm =
            l + 1 < spec_.num_layers
                ? static_cast<const float*>(layers[static_cast<size_t>(l + 1)].attn_norm.data)
                : nullptr;
        KV_RETURN_IF_ERROR(RowParallel(act_, w.down, rows, next_norm, w.post_ffn_norm));
    }

    // Final norm on the last row of each chunk only (the classifier follows in Forward).
    backend_->GatherRows(x_, hidden, last_rows_, num_seqs, xn_);
    backend_->RmsNorm(xn_, static_cast<const float*>(weights_.output_norm.data), xn_, num_seqs,
                      hidden, eps);
    return Status::Ok();
}

Result<std::unique_ptr<ModelRunner>> MakeModelRunner(const ModelFile& model, const ShardSpec& shard,
                                                     const RunnerOptions& options,
                                                     Collective* collective) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeBackend(options.backend));
    KV_ASSIGN_OR_RETURN(const kv::KvCacheGroups groups,
                        kv::MakeKvCacheGroups(kv::LayerWindows(model.spec())));
    if (groups.num_groups() > kv::kMaxKvCacheGroups) {
        return Unimplemented(model.path() + ": " + std::to_string(groups.num_groups()) +
                             " KV cache groups (layers by attention window), at most " +
                             std::to_string(kv::kMaxKvCacheGroups));
    }
    if (model.spec().sliding_window > 0 && !backend->SupportsSlidingWindow()) {
        return Unimplemented(model.path() + ": " + model.spec().architecture +
                             " sliding window of " + std::to_string(model.spec().sliding_window) +
                             ": the " + std::string(BackendKindName(backend->kind())) +
                             " backend does not implement sliding-window attention");
    }
    KV_RETURN_IF_ERROR(CheckCudaGraphs(
        options, backend->kind(), dynamic_cast<GraphCapture*>(backend.get()) != nullptr, shard.tp));
    KV_ASSIGN_OR_RETURN(ModelWeights weights,
                        LoadWeights(model, *backend,
                                    {.shard = shard,
                                     .format = options.weight_format,
                                     .on_bytes_loaded = options.on_weight_bytes_loaded}));
    return std::make_unique<ModelRunner>(model.spec(), std::move(backend), std::move(weights),
                                         options, collective);
}

}  // namespace kvshard
