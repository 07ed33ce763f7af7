// OpLogBackend: a backend that runs every op on an inner backend (the CPU's) and counts the ops
// the ModelRunner queues by name, with the max_query_rows of each attention call: how tests see
// which ops a step chose without a device. OpLogBackend itself offers no fused op (the runner
// then takes Rope, Rope, KvWrite); FusedOpLogBackend also offers the inner backend's
// RopeKvWriter, as the CPU and CUDA backends do.
// Thread-safety: one thread, as every backend.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "kernels/backend.h"

namespace kvshard::testing {

class OpLogBackend : public Backend {
  public:
    explicit OpLogBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
    ~OpLogBackend() override { buffers_.clear(); }

    // Calls per op name since construction.
    std::map<std::string, int64_t> calls;
    // PagedAttentionBatch::max_query_rows of every PagedAttention call, in order.
    std::vector<int64_t> attention_max_query_rows;

    int64_t count(const std::string& op) const {
        auto it = calls.find(op);
        return it == calls.end() ? 0 : it->second;
    }

    BackendKind kind() const override { return inner_->kind(); }
    std::string Describe() const override { return "op log " + inner_->Describe(); }
    Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
        return inner_->CopyToDevice(dst, src, bytes);
    }
    Status CopyToHost(void* dst, const void* src, size_t bytes) override {
        return inner_->CopyToHost(dst, src, bytes);
    }
    Status Synchronize() override { return inner_->Synchronize(); }

    void Embedding(const WeightView& table, int64_t row_offset, const int32_t* ids, int64_t n,
                   float* out) override {
        ++calls["Embedding"];
        inner_->Embedding(table, row_offset, ids, n, out);
    }
    void MatMul(const float* x, int64_t m, const WeightView& w, float* y) override {
        ++calls["MatMul"];
        inner_->MatMul(x, m, w, y);
    }
    void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                 float eps) override {
        ++calls["RmsNorm"];
        inner_->RmsNorm(x, weight, out, rows, dim, eps);
    }
    void AddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                    int64_t rows, int64_t dim, float eps) override {
        ++calls["AddRmsNorm"];
        inner_->AddRmsNorm(residual, delta, weight, out, rows, dim, eps);
    }
    void Add(float* x, const float* y, int64_t n) override {
        ++calls["Add"];
        inner_->Add(x, y, n);
    }
    void Rope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
              int64_t num_heads, int64_t head_dim, const float* inv_freq) override {
        ++calls["Rope"];
        inner_->Rope(x, row_stride, positions, rows, num_heads, head_dim, inv_freq);
    }
    void SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) override {
        ++calls["SiluMul"];
        inner_->SiluMul(gate_up, rows, dim, out);
    }
    void GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out) override {
        ++calls["GeluTanhMul"];
        inner_->GeluTanhMul(gate_up, rows, dim, out);
    }
    void AddBias(float* x, const float* bias, int64_t rows, int64_t dim) override {
        ++calls["AddBias"];
        inner_->AddBias(x, bias, rows, dim);
    }
    void HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                     int64_t head_dim, const float* weight, float eps) override {
        ++calls["HeadRmsNorm"];
        inner_->HeadRmsNorm(x, row_stride, rows, num_heads, head_dim, weight, eps);
    }
    void Scale(float* x, float s, int64_t n) override {
        ++calls["Scale"];
        inner_->Scale(x, s, n);
    }
    bool SupportsSlidingWindow() const override { return inner_->SupportsSlidingWindow(); }
    void KvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                 const int64_t* slots, int64_t n) override {
        ++calls["KvWrite"];
        inner_->KvWrite(kv, k, v, row_stride, slots, n);
    }
    void PagedAttention(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                        const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                        const int32_t* kv_head_of_q) override {
        ++calls["PagedAttention"];
        attention_max_query_rows.push_back(batch.max_query_rows);
        inner_->PagedAttention(q, q_stride, kv, batch, out, num_heads, kv_head_of_q);
    }
    void CopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                    int64_t num_pairs) override {
        ++calls["CopyBlocks"];
        inner_->CopyBlocks(pool, bytes_per_block, src_dst, num_pairs);
    }
    void GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                    float* out) override {
        ++calls["GatherRows"];
        inner_->GatherRows(x, dim, rows, n, out);
    }

  protected:
    Result<void*> AllocateRaw(size_t bytes) override {
        KV_ASSIGN_OR_RETURN(BackendBuffer b, inner_->Allocate(bytes));
        void* p = b.data();
        buffers_.emplace(p, std::move(b));
        return p;
    }
    void FreeRaw(void* data, size_t) override { buffers_.erase(data); }

    Backend& inner() { return *inner_; }

  private:
    std::unique_ptr<Backend> inner_;
    std::map<void*, BackendBuffer> buffers_;
};

class FusedOpLogBackend final : public OpLogBackend, public RopeKvWriter {
  public:
    // REQUIRES: `inner` implements RopeKvWriter.
    explicit FusedOpLogBackend(std::unique_ptr<Backend> inner) : OpLogBackend(std::move(inner)) {
        KV_CHECK(dynamic_cast<RopeKvWriter*>(&this->inner()) != nullptr)
            << "the inner backend has no fused RoPE + KV write";
    }
    void RopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                     const int32_t* positions, const int64_t* slots, int64_t rows,
                     int64_t num_heads, const float* inv_freq, const PagedKvLayer& kv) override {
        ++calls["RopeKvWrite"];
        dynamic_cast<RopeKvWriter&>(inner()).RopeKvWrite(q, k, v, row_stride, positions, slots,
                                                         rows, num_heads, inv_freq, kv);
    }
};

}  // namespace kvshard::testing
