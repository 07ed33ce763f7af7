// The whole prefill step of a Llama-shaped model with random bf16 weights (kernels/cuda/
// synthetic_prefill.h) on a backend: one sequence's prompt of --tokens positions from position 0
// through every layer and the classifier (last row). Per prompt length and prefill attention
// kernel (on cuda: fp32 and tc, kernels/cuda/prefill_select.h, both timed, interleaved step by
// step; the line of the kernel KVSHARD_CUDA_PREFILL selects is marked): ms/step (median of
// --steps), tokens/s, and the step's weight products as % of the bf16 MatMul ceiling (their FLOPs
// over the step's time, against cuBLASLt's best of 4096³ and the 8B gate|up product at the
// longest prompt, as kvshard_cuda_prefill_bench measures it): how far the whole step is from
// issue 13's 60%. Fails (exit 1) on a non-finite logit; prints the tc step's logits' relative L2
// distance to the fp32 step's (information: 32 layers of bf16 P·V rounding, no bound).
// Prints one line per figure, a `note` line (scripts/gpu-check's prefill8b step) and, with
// --json, one JSON object.
//   kvshard_cuda_prefill_step_bench [--backend cuda|cpu] [--shape 8b|tiny]
//                                   [--tokens 512,2048] [--steps 5] [--json]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bench/cuda_bench_flags.h"
#include "kernels/bench/cuda_bench_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/prefill_select.h"
#include "kernels/cuda/synthetic_prefill.h"

namespace {

using kvshard::Backend;
using kvshard::bench::Median;
using kvshard::bench::TimeOnce;
using kvshard::cuda::PrefillKernel;
using kvshard::cuda::SyntheticPrefill;

constexpr double kTargetPct = 60.0;  // issue 13

int Fail(const std::string& message) {
    std::fprintf(stderr, "kvshard_cuda_prefill_step_bench: %s\n", message.c_str());
    return 2;
}

const char* KernelName(PrefillKernel k) {
    return k == PrefillKernel::kTensorCore ? "tc" : k == PrefillKernel::kFp32 ? "fp32" : "auto";
}

double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
    }
    return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Prefill ms/step of a Llama-shaped model with random bf16 weights",
                 "kvshard_cuda_prefill_step_bench"};
    kvshard::bench::CudaBenchFlags flags;
    std::vector<int64_t> token_list = {512, 2048};
    int64_t steps = 5;
    kvshard::bench::AddCudaBenchFlags(app, &flags, /*batches=*/false);
    app.add_option("--tokens", token_list, "Prompt lengths, comma-separated")
        ->delimiter(',')
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 17))
        ->capture_default_str();
    app.add_option("--steps", steps, "Timed steps per prompt length and kernel (median printed)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    if (const int code = kvshard::bench::ParseCudaBenchFlags(app, argc, argv); code >= 0) {
        return code;
    }
    if (token_list.empty()) return Fail("--tokens: at least one prompt length");
    const kvshard::cuda::DecodeShape shape = kvshard::bench::ShapeOf(flags);
    // The setting is checked before any device is touched: a bad value is one line naming it.
    auto setting = kvshard::cuda::PrefillKernelFromEnvironment();
    if (!setting.ok()) return Fail(setting.status().message());
    auto made = kvshard::MakeBackend({.kind = kvshard::bench::BackendOf(flags)});
    if (!made.ok()) return Fail(made.status().message());
    Backend& b = **made;
    auto* cuda = dynamic_cast<kvshard::cuda::CudaBackend*>(&b);
    const int64_t max_tokens = *std::max_element(token_list.begin(), token_list.end());

    const int64_t n_ceiling = cuda != nullptr ? 4096 : 256;
    const double ceiling =
        std::max(kvshard::bench::Bf16MatMulTflops(b, n_ceiling, n_ceiling, n_ceiling),
                 kvshard::bench::Bf16MatMulTflops(b, max_tokens, 2 * shape.ffn, shape.hidden));
    if (ceiling <= 0) return Fail("the bf16 MatMul failed");
    std::printf("ceiling %.2f TFLOP/s (bf16 MatMul: best of %lld^3 and %lldx%lldx%lld)\n", ceiling,
                static_cast<long long>(n_ceiling), static_cast<long long>(max_tokens),
                static_cast<long long>(2 * shape.ffn), static_cast<long long>(shape.hidden));

    auto made_step = SyntheticPrefill::Create(b, shape, max_tokens, 1);
    if (!made_step.ok()) return Fail(made_step.status().message());
    SyntheticPrefill& p = *made_step;

    // The kernels to time: on cuda the fp32 one and, where it reads the pool, the tc one; the
    // one KVSHARD_CUDA_PREFILL selects is marked. The CPU has one attention.
    std::vector<PrefillKernel> kernels;
    PrefillKernel selected = PrefillKernel::kFp32;
    if (cuda != nullptr) {
        kernels.push_back(PrefillKernel::kFp32);
        if (kvshard::cuda::TcPrefillSupports(shape.kv_dtype, shape.head_dim)) {
            kernels.push_back(PrefillKernel::kTensorCore);
        }
        auto chosen = kvshard::cuda::ChoosePrefillKernel(*setting, shape.kv_dtype, shape.head_dim);
        if (!chosen.ok()) return Fail(chosen.status().message());
        selected = *chosen;
    } else {
        kernels.push_back(PrefillKernel::kFp32);  // the CPU's attention; printed as "cpu"
    }
    const PrefillKernel restore = cuda != nullptr ? cuda->prefill_kernel() : PrefillKernel::kFp32;
    auto use = [&](PrefillKernel k) {
        if (cuda != nullptr) cuda->set_prefill_kernel(k);
    };

    std::string rows, note;
    for (int64_t tokens : token_list) {
        if (auto st = p.SetTokens(tokens); !st.ok()) return Fail(st.message());
        std::vector<std::vector<double>> sec(kernels.size());
        std::vector<std::vector<float>> logits(kernels.size());
        for (int64_t i = 0; i <= steps; ++i) {  // step 0 of each: warm-up (plans, module load)
            for (size_t k = 0; k < kernels.size(); ++k) {
                use(kernels[k]);
                const double s = TimeOnce(b, [&] { p.Step(); });
                if (s <= 0) return Fail(std::string("the prefill step failed (") + KernelName(kernels[k]) + ")");
                if (i > 0) sec[k].push_back(s);
                if (i == steps) {
                    auto l = p.Logits();
                    if (!l.ok()) return Fail(l.status().message());
                    for (float x : *l) {
                        if (!std::isfinite(x)) {
                            std::fprintf(stderr, "kvshard_cuda_prefill_step_bench: a logit is not finite "
                                         "(%s, %lld tokens)\n", KernelName(kernels[k]),
                                         static_cast<long long>(tokens));
                            return 1;
                        }
                    }
                    logits[k] = std::move(*l);
                }
            }
        }
        const double gemm_flops = SyntheticPrefill::GemmFlops(shape, tokens);
        const double attn_flops = SyntheticPrefill::AttentionFlops(shape, tokens);
        std::string krow;
        for (size_t k = 0; k < kernels.size(); ++k) {
            const double s = Median(sec[k]);
            const double gemm_tflops = gemm_flops / s / 1e12;
            const double pct = 100.0 * gemm_tflops / ceiling;
            const char* name = cuda != nullptr ? KernelName(kernels[k]) : "cpu";
            const bool marked = cuda != nullptr && kernels[k] == selected;
            std::printf("prefill %-4s tokens %5lld  %9.3f ms/step  %10.1f tok/s  GEMMs %.1f TFLOP/s ="
                        " %5.1f%% of ceiling  all %.1f TFLOP/s%s\n",
                        name, static_cast<long long>(tokens), s * 1e3, double(tokens) / s,
                        gemm_tflops, pct, (gemm_flops + attn_flops) / s / 1e12,
                        marked ? "  (KVSHARD_CUDA_PREFILL selects it)" : "");
            char item[256];
            std::snprintf(item, sizeof(item),
                          "%s\"%s\":{\"ms_per_step\":%.4f,\"tok_per_s\":%.2f,\"gemm_tflops\":%.3f,"
                          "\"gemm_pct_of_ceiling\":%.2f,\"selected\":%s}",
                          krow.empty() ? "" : ",", name, s * 1e3, double(tokens) / s, gemm_tflops,
                          pct, marked ? "true" : "false");
            krow += item;
            if (tokens == max_tokens) {
                char part[160];
                std::snprintf(part, sizeof(part), "%s%s %.1f ms (%.0f tok/s, GEMMs %.1f%%)",
                              note.empty() ? "" : ", ", name, s * 1e3, double(tokens) / s, pct);
                note += part;
            }
        }
        double rel = -1.0;
        if (kernels.size() == 2) {
            rel = RelL2(logits[1], logits[0]);
            std::printf("tokens %lld: tc step's logits vs fp32's: relative L2 %.2e\n",
                        static_cast<long long>(tokens), rel);
        }
        char row[160];
        std::snprintf(row, sizeof(row), "%s{\"tokens\":%lld,\"gemm_flops\":%.4e,\"attention_flops\":%.4e,"
                      "\"logits_rel_l2_tc_fp32\":%.3e,\"kernels\":{",
                      rows.empty() ? "" : ",", static_cast<long long>(tokens), gemm_flops, attn_flops,
                      rel);
        rows += row + krow + "}}";
    }
    use(restore);
    std::printf("note %lld tokens: %s; GEMMs as %% of %.1f TFLOP/s (target %.0f%%)\n",
                static_cast<long long>(max_tokens), note.c_str(), ceiling, kTargetPct);
    if (flags.json) {
        std::printf("{\"backend\":\"%s\",\"shape\":\"%s\",\"ceiling_tflops\":%.3f,"
                    "\"selected\":\"%s\",\"steps\":[%s]}\n",
                    flags.backend.c_str(), flags.shape.c_str(), ceiling,
                    cuda != nullptr ? KernelName(selected) : "cpu", rows.c_str());
    }
    return 0;
}
