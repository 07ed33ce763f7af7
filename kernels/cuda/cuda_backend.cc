// CudaBackend (kernels/cuda/cuda_backend.h): memory, copies, graphs, the weight copies and the
// cuBLASLt plans on the host side, and the attention launches; the ops that queue one kernel each
// are in cuda_backend_ops.cc, the kernels in kernels/cuda/backend_kernels.cu.
#include "kernels/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/backend_kernels.h"
#include "kernels/cuda/cublas_library.h"
#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/weight_pack.h"
#include "kernels/cuda_ops.h"

namespace kvshard::cuda {
namespace {

Status CudaStatus(cudaError_t err, const std::string& what) {
    return Unavailable("cuda backend: " + what + ": CUDA error " + std::to_string(int(err)) + " (" +
                       cudaGetErrorName(err) + "): " + cudaGetErrorString(err));
}

Status CublasStatus(cublasStatus_t st, const std::string& what) {
    return Unavailable("cuda backend: " + what + ": cuBLAS error " + std::to_string(int(st)) +
                       " (" + Cublas().cublasGetStatusName(st) + ")");
}

// The largest power of two (at most 256) dividing the address: what cuBLASLt may assume.
int Alignment(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    int align = 256;
    while (align > 1 && a % static_cast<uintptr_t>(align) != 0) align /= 2;
    return align;
}

// A matrix product's cuBLASLt descriptors and chosen algorithm.
struct LtPlan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool ok = false;
    std::string error;
};

}  // namespace

struct CudaBackend::Impl {
    cublasLtHandle_t lt = nullptr;
    std::unique_ptr<CublasHandle> cublas;  // pedantic fp32 products of F32 weights
    void* lt_workspace = nullptr;
    float* partials = nullptr;
    void* activations = nullptr;  // bf16 copy of a product's x
    size_t activation_bytes = 0;
    // Outgrown activation copies, kept until the backend goes: captured graphs still use them.
    std::vector<void*> retired_activations;
    GemmAlgoCache<LtPlan> plans;
    // Device copies of weights, keyed by the stored data pointer and the use.
    struct Copy {
        void* data = nullptr;
        DType stored = DType::kF32;
        int64_t rows = 0, cols = 0;
    };
    std::map<std::pair<const void*, bool>, Copy> copies;
    std::vector<cudaGraphExec_t> graphs;
    bool capturing = false;
};

Result<std::unique_ptr<CudaBackend>> CudaBackend::Create(const BackendConfig& config) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        return InvalidArgument(
            "backend: cuda: no CUDA device on this machine (" +
            std::string(err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") +
            "); use backend cpu");
    }
    if (config.device < 0 || config.device >= count) {
        return InvalidArgument("backend: cuda: device " + std::to_string(config.device) +
                               " does not exist (this machine has " + std::to_string(count) +
                               " CUDA device" + (count == 1 ? "" : "s") + ")");
    }
    cudaDeviceProp prop{};
    if (const cudaError_t e = cudaGetDeviceProperties(&prop, config.device); e != cudaSuccess) {
        return CudaStatus(e, "cudaGetDeviceProperties");
    }
    if (prop.major < 8) {
        return InvalidArgument("backend: cuda: device " + std::to_string(config.device) + " (" +
                               prop.name + ") has compute capability " +
                               std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                               "; kvshard's CUDA kernels need 8.0 or newer");
    }
    if (const cudaError_t e = cudaSetDevice(config.device); e != cudaSuccess) {
        return CudaStatus(e, "cudaSetDevice");
    }
    std::unique_ptr<CudaBackend> b(new CudaBackend(config.device));
    KV_ASSIGN_OR_RETURN(b->prefill_, PrefillKernelFromEnvironment());
    b->sm_count_ = prop.multiProcessorCount;
    b->name_ = prop.name;
    b->cc_major_ = prop.major;
    b->cc_minor_ = prop.minor;
    cudaStream_t stream = nullptr;
    if (const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
        return CudaStatus(e, "cudaStreamCreate");
    }
    b->stream_ = stream;
    Impl& im = *b->impl_;
    // cuBLAS is opened here, by the first backend of the process, not at program start.
    if (Result<const CublasLibrary*> cublas = LoadCublas(); !cublas.ok()) {
        return cublas.status().WithContext("cuda backend");
    }
    if (const cublasStatus_t st = Cublas().cublasLtCreate(&im.lt); st != CUBLAS_STATUS_SUCCESS) {
        return CublasStatus(st, "cublasLtCreate");
    }
    im.cublas = std::make_unique<CublasHandle>();
    im.cublas->SetStream(b->stream_);
    if (const cudaError_t e = cudaMalloc(&im.lt_workspace, kLtWorkspaceBytes); e != cudaSuccess) {
        return CudaStatus(e, "cudaMalloc of the cuBLASLt workspace");
    }
    // cuBLAS shares it (one stream orders their use): an explicit workspace also keeps cuBLAS
    // from allocating inside a graph capture.
    if (const cublasStatus_t st = Cublas().cublasSetWorkspace(
            static_cast<cublasHandle_t>(im.cublas->get()), im.lt_workspace, kLtWorkspaceBytes);
        st != CUBLAS_STATUS_SUCCESS) {
        return CublasStatus(st, "cublasSetWorkspace");
    }
    if (const cudaError_t e =
            cudaMalloc(reinterpret_cast<void**>(&im.partials), kPartialFloats * sizeof(float));
        e != cudaSuccess) {
        return CudaStatus(e, "cudaMalloc of the attention partials");
    }
    if (const cudaError_t e = cudaMalloc(&im.activations, kInitialActivationBytes);
        e != cudaSuccess) {
        return CudaStatus(e, "cudaMalloc of the activation copy");
    }
    im.activation_bytes = kInitialActivationBytes;
    return b;
}

CudaBackend::CudaBackend(int device) : device_(device), impl_(std::make_unique<Impl>()) {}

CudaBackend::~CudaBackend() {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    Impl& im = *impl_;
    im.plans.ForEach([](const GemmKey&, LtPlan& p) {
        if (p.op != nullptr) Cublas().cublasLtMatmulDescDestroy(p.op);
        for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c}) {
            if (l != nullptr) Cublas().cublasLtMatrixLayoutDestroy(l);
        }
    });
    for (auto& [key, copy] : im.copies) cudaFree(copy.data);
    for (cudaGraphExec_t g : im.graphs) {
        if (g != nullptr) cudaGraphExecDestroy(g);
    }
    cudaFree(im.activations);
    for (void* p : im.retired_activations) cudaFree(p);
    cudaFree(im.partials);
    cudaFree(im.lt_workspace);
    im.cublas.reset();
    if (im.lt != nullptr) Cublas().cublasLtDestroy(im.lt);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

std::string CudaBackend::Describe() const {
    return "cuda (device " + std::to_string(device_) + ": " + name_ + ", sm_" +
           std::to_string(cc_major_) + std::to_string(cc_minor_) + ", " +
           std::to_string(sm_count_) + " SMs)";
}

size_t CudaBackend::gemm_plans() const { return impl_->plans.size(); }

void CudaBackend::Fail(Status status) {
    if (first_error_.ok()) {
        spdlog::error("{}", status.ToString());
        first_error_ = std::move(status);
    }
}

void CudaBackend::Check(int cuda_error, const char* what) {
    if (cuda_error != 0) {
        Fail(CudaStatus(static_cast<cudaError_t>(cuda_error), std::string("launch of ") + what));
    }
}

Result<void*> CudaBackend::AllocateRaw(size_t bytes) {
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();  // an out-of-memory error is not sticky: clear it
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        return Status(StatusCode::kResourceExhausted,
                      "cuda backend: cannot allocate " + std::to_string(bytes) +
                          " bytes on device " + std::to_string(device_) + " (" +
                          std::to_string(free_b) + " of " + std::to_string(total_b) +
                          " bytes free): " + cudaGetErrorString(err));
    }
    return p;
}

void CudaBackend::FreeRaw(void* data, size_t bytes) {
    cudaSetDevice(device_);
    // Work queued on the stream may still read it.
    cudaStreamSynchronize(stream_);
    // Device copies of weights stored in this allocation go with it: a later allocation at the
    // same address holds other data.
    auto& copies = impl_->copies;
    const auto* begin = static_cast<const uint8_t*>(data);
    for (auto it = copies.lower_bound({data, false});
         it != copies.end() && static_cast<const uint8_t*>(it->first.first) < begin + bytes;) {
        cudaFree(it->second.data);
        it = copies.erase(it);
    }
    cudaFree(data);
}

Status CudaBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return Status::Ok();
    cudaSetDevice(device_);
    const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_);
    if (err != cudaSuccess)
        return CudaStatus(err, "copy of " + std::to_string(bytes) + " bytes to the device");
    return Status::Ok();
}

Status CudaBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return Status::Ok();
    cudaSetDevice(device_);
    const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_);
    if (err != cudaSuccess)
        return CudaStatus(err, "copy of " + std::to_string(bytes) + " bytes to the host");
    return Status::Ok();
}

Status CudaBackend::Synchronize() {
    cudaSetDevice(device_);
    const cudaError_t err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) Fail(CudaStatus(err, "the stream"));
    return first_error_;
}

Status CudaBackend::BeginCapture() {
    Impl& im = *impl_;
    if (im.capturing)
        return InvalidArgument("cuda backend: BeginCapture: a capture is already open");
    if (!first_error_.ok()) return first_error_;
    cudaSetDevice(device_);
    const cudaError_t err = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) return CudaStatus(err, "cudaStreamBeginCapture");
    im.capturing = true;
    return Status::Ok();
}

Result<int> CudaBackend::EndCapture() {
    Impl& im = *impl_;
    if (!im.capturing) return InvalidArgument("cuda backend: EndCapture without BeginCapture");
    im.capturing = false;
    cudaSetDevice(device_);
    cudaGraph_t graph = nullptr;
    const cudaError_t err = cudaStreamEndCapture(stream_, &graph);
    // BeginCapture found no error: one recorded since failed the capture only (nothing ran), so
    // the backend stays usable eagerly.
    Status failed = std::exchange(first_error_, Status::Ok());
    if (err != cudaSuccess) {
        cudaGetLastError();
        if (graph != nullptr) cudaGraphDestroy(graph);
        if (!failed.ok()) return failed;
        return CudaStatus(err, "cudaStreamEndCapture (did an op allocate or synchronize?)");
    }
    if (!failed.ok()) {
        cudaGraphDestroy(graph);
        return failed;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (inst != cudaSuccess) return CudaStatus(inst, "cudaGraphInstantiate");
    im.graphs.push_back(exec);
    return static_cast<int>(im.graphs.size() - 1);
}

Status CudaBackend::Replay(int graph) {
    Impl& im = *impl_;
    if (graph < 0 || graph >= static_cast<int>(im.graphs.size()) ||
        im.graphs[static_cast<size_t>(graph)] == nullptr) {
        return InvalidArgument("cuda backend: Replay: no graph " + std::to_string(graph) + " (" +
                               std::to_string(im.graphs.size()) +
                               " captured, released ones included)");
    }
    cudaSetDevice(device_);
    const cudaError_t err = cudaGraphLaunch(im.graphs[static_cast<size_t>(graph)], stream_);
    if (err != cudaSuccess) return CudaStatus(err, "cudaGraphLaunch");
    return Status::Ok();
}

void CudaBackend::ReleaseGraph(int graph) {
    Impl& im = *impl_;
    if (graph < 0 || graph >= static_cast<int>(im.graphs.size())) return;
    cudaGraphExec_t& exec = im.graphs[static_cast<size_t>(graph)];
    if (exec == nullptr) return;
    cudaSetDevice(device_);
    // A launch still queued holds the executable: destroy it only once the stream is done.
    cudaStreamSynchronize(stream_);
    cudaGraphExecDestroy(exec);
    exec = nullptr;
}

size_t CudaBackend::live_graphs() const {
    size_t n = 0;
    for (cudaGraphExec_t g : impl_->graphs) n += g != nullptr ? 1 : 0;
    return n;
}

Status CudaBackend::PrepareWeight(const WeightView& w, bool for_embedding) {
    Converted(w, for_embedding);
    return first_error_;
}

const void* CudaBackend::Converted(const WeightView& w, bool for_embedding) {
    Impl& im = *impl_;
    const auto key = std::make_pair(w.data, for_embedding);
    if (auto it = im.copies.find(key); it != im.copies.end()) {
        const Impl::Copy& c = it->second;
        KV_CHECK(c.stored == w.dtype && c.rows == w.rows && c.cols == w.cols)
            << "the weight at " << w.data << " changed shape or format after its device copy";
        return c.data;
    }
    if (im.capturing) {
        Fail(InvalidArgument("cuda backend: a " + std::string(DTypeName(w.dtype)) +
                             " weight has no device copy yet inside a graph capture: run the "
                             "step once eagerly before capturing it"));
        return nullptr;
    }
    cudaSetDevice(device_);
    const size_t stored_bytes = RowBytes(w.dtype, w.cols) * static_cast<size_t>(w.rows);
    std::vector<uint8_t> stored(stored_bytes);
    if (Status st = CopyToHost(stored.data(), w.data, stored_bytes); !st.ok()) {
        Fail(std::move(st));
        return nullptr;
    }
    if (Status st = Synchronize(); !st.ok()) return nullptr;
    std::vector<float> f32;
    std::vector<uint16_t> bf16;
    const void* host = nullptr;
    size_t bytes = 0;
    if (for_embedding) {
        f32 = DequantizeRowsToF32(w.dtype, stored.data(), w.rows, w.cols);
        host = f32.data();
        bytes = f32.size() * sizeof(float);
    } else {
        bf16 = DequantizeRowsToBf16(w.dtype, stored.data(), w.rows, w.cols);
        host = bf16.data();
        bytes = bf16.size() * sizeof(uint16_t);
    }
    Result<void*> dev = AllocateRaw(bytes);
    if (!dev.ok()) {
        Fail(dev.status());
        return nullptr;
    }
    const cudaError_t err = cudaMemcpyAsync(*dev, host, bytes, cudaMemcpyHostToDevice, stream_);
    if (err != cudaSuccess) {
        cudaFree(*dev);
        Fail(CudaStatus(err, "upload of a weight copy"));
        return nullptr;
    }
    if (Status st = Synchronize(); !st.ok()) {
        cudaFree(*dev);
        return nullptr;
    }
    spdlog::info("cuda backend: {} weight {}×{} ({}) copied to the device as {} ({} bytes)",
                 for_embedding ? "embedding" : "matrix", w.rows, w.cols, DTypeName(w.dtype),
                 for_embedding ? "F32" : "BF16", bytes);
    im.copies[key] = {.data = *dev, .stored = w.dtype, .rows = w.rows, .cols = w.cols};
    return *dev;
}

void CudaBackend::Embedding(const WeightView& table, int64_t row_offset, const int32_t* ids,
                            int64_t n, float* out) {
    cudaSetDevice(device_);
    if (table.dtype == DType::kBF16) {
        Check(LaunchEmbeddingBf16(static_cast<const uint16_t*>(table.data), table.rows, table.cols,
                                  row_offset, ids, n, out, stream_),
              "Embedding");
        return;
    }
    const void* f32 = table.dtype == DType::kF32 ? table.data : Converted(table, true);
    if (f32 == nullptr) return;
    Check(LaunchEmbeddingF32(static_cast<const float*>(f32), table.rows, table.cols, row_offset,
                             ids, n, out, stream_),
          "Embedding");
}

void CudaBackend::MatMul(const float* x, int64_t m, const WeightView& w, float* y) {
    if (m == 0 || w.rows == 0) return;
    cudaSetDevice(device_);
    Impl& im = *impl_;
    if (w.dtype == DType::kF32) {
        // Pedantic fp32 SGEMM, the column-major view of the row-major product (as MatMulWT).
        KV_CHECK(m <= INT32_MAX && w.rows <= INT32_MAX && w.cols <= INT32_MAX)
            << "m=" << m << " n=" << w.rows << " k=" << w.cols;
        const int mi = int(m), ni = int(w.rows), ki = int(w.cols);
        const float alpha = 1.0f, beta = 0.0f;
        const cublasStatus_t st = Cublas().cublasSgemm(
            static_cast<cublasHandle_t>(im.cublas->get()), CUBLAS_OP_T, CUBLAS_OP_N, ni, mi, ki,
            &alpha, static_cast<const float*>(w.data), ki, x, ki, &beta, y, ni);
        if (st != CUBLAS_STATUS_SUCCESS) Fail(CublasStatus(st, "cublasSgemm"));
        return;
    }
    const void* wb = w.dtype == DType::kBF16 ? w.data : Converted(w, false);
    if (wb == nullptr) return;
    const size_t x_bytes = static_cast<size_t>(m * w.cols) * sizeof(uint16_t);
    if (x_bytes > im.activation_bytes) {
        if (im.capturing) {
            Fail(InvalidArgument("cuda backend: a product of " + std::to_string(m) +
                                 " rows needs a larger activation copy inside a graph capture: "
                                 "run the step once eagerly before capturing it"));
            return;
        }
        spdlog::info("cuda backend: the activation copy grows to {} bytes (a product of {} rows)",
                     x_bytes, m);
        cudaStreamSynchronize(stream_);
        im.retired_activations.push_back(im.activations);
        im.activations = nullptr;
        im.activation_bytes = 0;
        Result<void*> p = AllocateRaw(x_bytes);
        if (!p.ok()) {
            Fail(p.status());
            return;
        }
        im.activations = *p;
        im.activation_bytes = x_bytes;
    }
    auto* xb = static_cast<uint16_t*>(im.activations);
    Check(LaunchF32ToBf16(x, m * w.cols, xb, stream_), "MatMul (activations to bf16)");
    const GemmKey key{.m = m,
                      .n = w.rows,
                      .k = w.cols,
                      .a_type = DType::kBF16,
                      .b_type = DType::kBF16,
                      .accumulate = false,
                      .w_align = Alignment(wb),
                      .y_align = Alignment(y)};
    const LtPlan& plan = im.plans.Get(key, [&](const GemmKey& k) {
        LtPlan p;
        // Column-major view of the row-major product: yᵀ[n, m] = op_T(wᵀ[k, n]) · xᵀ[k, m].
        cublasStatus_t st =
            Cublas().cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans,
                                                         sizeof(trans));
        }
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB,
                                                         &no_trans, sizeof(no_trans));
        }
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, uint64_t(k.k),
                                                     uint64_t(k.n), k.k);
        }
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, uint64_t(k.k),
                                                     uint64_t(k.m), k.k);
        }
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, uint64_t(k.n), uint64_t(k.m),
                                                     k.n);
        }
        cublasLtMatmulPreference_t pref = nullptr;
        if (st == CUBLAS_STATUS_SUCCESS) st = Cublas().cublasLtMatmulPreferenceCreate(&pref);
        const uint64_t ws = kLtWorkspaceBytes;
        const uint32_t a_align = uint32_t(k.w_align), c_align = uint32_t(k.y_align);
        const uint32_t b_align = 256;  // the activation copy is its own allocation
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatmulPreferenceSetAttribute(
                pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
        }
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatmulPreferenceSetAttribute(
                pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a_align, sizeof(a_align));
        }
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatmulPreferenceSetAttribute(
                pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b_align, sizeof(b_align));
        }
        for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
            if (st == CUBLAS_STATUS_SUCCESS) {
                st = Cublas().cublasLtMatmulPreferenceSetAttribute(pref, attr, &c_align,
                                                                   sizeof(c_align));
            }
        }
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        if (st == CUBLAS_STATUS_SUCCESS) {
            st = Cublas().cublasLtMatmulAlgoGetHeuristic(im.lt, p.op, p.a, p.b, p.c, p.c, pref, 1,
                                                         &result, &found);
        }
        if (pref != nullptr) Cublas().cublasLtMatmulPreferenceDestroy(pref);
        if (st != CUBLAS_STATUS_SUCCESS) {
            p.error = CublasStatus(st, "cuBLASLt plan").message();
        } else if (found == 0) {
            p.error = "cuda backend: cuBLASLt has no bf16 algorithm for m=" + std::to_string(k.m) +
                      " n=" + std::to_string(k.n) + " k=" + std::to_string(k.k);
        } else {
            p.algo = result.algo;
            p.ok = true;
        }
        return p;
    });
    if (!plan.ok) {
        Fail(Unavailable(plan.error));
        return;
    }
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t st =
        Cublas().cublasLtMatmul(im.lt, plan.op, &alpha, wb, plan.a, xb, plan.b, &beta, y, plan.c, y,
                                plan.c, &plan.algo, im.lt_workspace, kLtWorkspaceBytes, stream_);
    if (st != CUBLAS_STATUS_SUCCESS) Fail(CublasStatus(st, "cublasLtMatmul"));
}

void CudaBackend::PagedAttention(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                                 const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                                 const int32_t* kv_head_of_q) {
    KV_CHECK(kv.head_dim > 0 && kv.head_dim <= kAttnMaxHeadDim)
        << "cuda attention supports head_dim 1.." << kAttnMaxHeadDim << ", not " << kv.head_dim;
    KV_CHECK(num_heads <= kAttnMaxHeads)
        << "cuda attention supports up to " << kAttnMaxHeads << " query heads, not " << num_heads;
    KV_CHECK(kv.num_kv_heads > 0 && (kv_head_of_q != nullptr || num_heads % kv.num_kv_heads == 0))
        << "num_heads=" << num_heads << " num_kv_heads=" << kv.num_kv_heads;
    cudaSetDevice(device_);
    const int splits = ChooseNumSplits(batch.num_seqs, kv.num_kv_heads, num_heads, kv.head_dim,
                                       sm_count_, kPartialFloats);
    // Decode rows take the split-KV kernel; prefill chunks (more than one row) an FA2-style
    // kernel (prefill_select.h picks which), on a fixed grid: the rows are in device memory only.
    // A step the caller says has no chunk (a decode step) does not launch it.
    Check(LaunchPagedAttention(q, q_stride, kv, batch, out, num_heads, kv_head_of_q, splits,
                               impl_->partials, /*decode_only=*/true, stream_),
          "PagedAttention");
    if (!LaunchesPrefillAttention(batch.max_query_rows)) return;
    const Result<PrefillKernel> prefill = ChoosePrefillKernel(prefill_, kv.storage, kv.head_dim);
    if (!prefill.ok()) return Fail(prefill.status());
    const auto launch_prefill =
        *prefill == PrefillKernel::kTensorCore ? LaunchPrefillAttentionTc : LaunchPrefillAttention;
    Check(launch_prefill(q, q_stride, kv, batch, out, num_heads, kv_head_of_q,
                         PrefillGrid(sm_count_, kPrefillBlocksPerSm), stream_),
          "PagedAttention (prefill)");
}

}  // namespace kvshard::cuda

namespace kvshard {

Result<std::unique_ptr<Backend>> MakeCudaBackend(const BackendConfig& config) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaBackend> b, cuda::CudaBackend::Create(config));
    spdlog::info("backend: {}", b->Describe());
    return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace kvshard
