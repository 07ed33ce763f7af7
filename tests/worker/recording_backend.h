// RecordingBackend: the CPU backend with graph capture (GraphCapture, kernels/backend.h) as a
// CUDA stream has it, for testing the ModelRunner's graph path without a GPU. Between
// BeginCapture and EndCapture every op is recorded with its arguments (pointers and shapes) and
// not run; Replay runs the recorded ops again on the data the pointers then hold. As inside a
// CUDA capture, an allocation, a copy to or from the host or a Synchronize during a capture
// fails the capture (EndCapture returns the error and nothing ran), and so does an op named in
// `refuse_in_capture` (a stand-in for an op a device cannot capture).
// Thread-safety: one thread, as every backend.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace kvshard::testing {

class RecordingBackend final : public Backend, public GraphCapture {
  public:
    explicit RecordingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
    ~RecordingBackend() override { buffers_.clear(); }

    // An op whose name is here fails any capture it is queued in.
    std::string refuse_in_capture;
    // Ops run since construction: eagerly, and by replays.
    int64_t eager_ops = 0;
    int64_t replayed_ops = 0;
    int live_graphs() const {
        int n = 0;
        for (const auto& g : graphs_) n += g.has_value ? 1 : 0;
        return n;
    }

    // Whether a capture is open.
    bool capturing() const { return capturing_; }
    // Queues `op` on the stream as the backend's own ops are: recorded inside a capture, run at
    // once outside one. How a test collective stands in for NCCL, which queues its operations on
    // the backend's CUDA stream, where a capture records them.
    void QueueOp(const std::string& name, std::function<void()> op) { Queue(name, std::move(op)); }

    BackendKind kind() const override { return inner_->kind(); }
    std::string Describe() const override { return "recording " + inner_->Describe(); }

    Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
        if (capturing_) return Refuse("CopyToDevice");
        return inner_->CopyToDevice(dst, src, bytes);
    }
    Status CopyToHost(void* dst, const void* src, size_t bytes) override {
        if (capturing_) return Refuse("CopyToHost");
        return inner_->CopyToHost(dst, src, bytes);
    }
    Status Synchronize() override {
        if (capturing_) return Refuse("Synchronize");
        return inner_->Synchronize();
    }

    Status BeginCapture() override {
        if (capturing_) return InvalidArgument("recording backend: a capture is already open");
        capturing_ = true;
        recorded_.clear();
        capture_error_ = Status::Ok();
        return Status::Ok();
    }
    Result<int> EndCapture() override {
        if (!capturing_) return InvalidArgument("recording backend: EndCapture without Begin");
        capturing_ = false;
        if (!capture_error_.ok()) return std::exchange(capture_error_, Status::Ok());
        graphs_.push_back({true, std::move(recorded_)});
        recorded_.clear();
        return static_cast<int>(graphs_.size() - 1);
    }
    Status Replay(int graph) override {
        if (graph < 0 || graph >= static_cast<int>(graphs_.size()) ||
            !graphs_[static_cast<size_t>(graph)].has_value) {
            return InvalidArgument("recording backend: no graph " + std::to_string(graph));
        }
        for (const auto& op : graphs_[static_cast<size_t>(graph)].ops) {
            op();
            ++replayed_ops;
        }
        return Status::Ok();
    }
    void ReleaseGraph(int graph) override {
        if (graph < 0 || graph >= static_cast<int>(graphs_.size())) return;
        graphs_[static_cast<size_t>(graph)] = {};
    }

    void Embedding(const WeightView& table, int64_t row_offset, const int32_t* ids, int64_t n,
                   float* out) override {
        Queue("Embedding", [=, this] { inner_->Embedding(table, row_offset, ids, n, out); });
    }
    void MatMul(const float* x, int64_t m, const WeightView& w, float* y) override {
        Queue("MatMul", [=, this] { inner_->MatMul(x, m, w, y); });
    }
    void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                 float eps) override {
        Queue("RmsNorm", [=, this] { inner_->RmsNorm(x, weight, out, rows, dim, eps); });
    }
    void AddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                    int64_t rows, int64_t dim, float eps) override {
        Queue("AddRmsNorm",
              [=, this] { inner_->AddRmsNorm(residual, delta, weight, out, rows, dim, eps); });
    }
    void Add(float* x, const float* y, int64_t n) override {
        Queue("Add", [=, this] { inner_->Add(x, y, n); });
    }
    void Rope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
              int64_t num_heads, int64_t head_dim, const float* inv_freq) override {
        Queue("Rope", [=, this] {
            inner_->Rope(x, row_stride, positions, rows, num_heads, head_dim, inv_freq);
        });
    }
    void SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) override {
        Queue("SiluMul", [=, this] { inner_->SiluMul(gate_up, rows, dim, out); });
    }
    void GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out) override {
        Queue("GeluTanhMul", [=, this] { inner_->GeluTanhMul(gate_up, rows, dim, out); });
    }
    void AddBias(float* x, const float* bias, int64_t rows, int64_t dim) override {
        Queue("AddBias", [=, this] { inner_->AddBias(x, bias, rows, dim); });
    }
    void HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                     int64_t head_dim, const float* weight, float eps) override {
        Queue("HeadRmsNorm", [=, this] {
            inner_->HeadRmsNorm(x, row_stride, rows, num_heads, head_dim, weight, eps);
        });
    }
    void Scale(float* x, float s, int64_t n) override {
        Queue("Scale", [=, this] { inner_->Scale(x, s, n); });
    }
    bool SupportsSlidingWindow() const override { return inner_->SupportsSlidingWindow(); }
    void KvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                 const int64_t* slots, int64_t n) override {
        Queue("KvWrite", [=, this] { inner_->KvWrite(kv, k, v, row_stride, slots, n); });
    }
    void PagedAttention(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                        const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                        const int32_t* kv_head_of_q) override {
        Queue("PagedAttention", [=, this] {
            inner_->PagedAttention(q, q_stride, kv, batch, out, num_heads, kv_head_of_q);
        });
    }
    void CopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                    int64_t num_pairs) override {
        Queue("CopyBlocks",
              [=, this] { inner_->CopyBlocks(pool, bytes_per_block, src_dst, num_pairs); });
    }
    void GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                    float* out) override {
        Queue("GatherRows", [=, this] { inner_->GatherRows(x, dim, rows, n, out); });
    }

  protected:
    Result<void*> AllocateRaw(size_t bytes) override {
        if (capturing_) return Refuse("Allocate");
        KV_ASSIGN_OR_RETURN(BackendBuffer b, inner_->Allocate(bytes));
        void* p = b.data();
        buffers_.emplace(p, std::move(b));
        return p;
    }
    void FreeRaw(void* data, size_t) override { buffers_.erase(data); }

  private:
    struct Graph {
        bool has_value = false;
        std::vector<std::function<void()>> ops;
    };
    Status Refuse(const std::string& what) {
        Status st = Unavailable("recording backend: " + what + " inside a graph capture");
        if (capture_error_.ok()) capture_error_ = st;
        return st;
    }
    void Queue(const std::string& name, std::function<void()> op) {
        if (!capturing_) {
            op();
            ++eager_ops;
            return;
        }
        if (name == refuse_in_capture) {
            static_cast<void>(Refuse(name));  // fails the capture
            return;
        }
        recorded_.push_back(std::move(op));
    }

    std::unique_ptr<Backend> inner_;
    std::map<void*, BackendBuffer> buffers_;
    bool capturing_ = false;
    Status capture_error_;
    std::vector<std::function<void()>> recorded_;
    std::vector<Graph> graphs_;
};

}  // namespace kvshard::testing
