#include "sim/accelerator.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <sstream>

namespace kvshard::sim {
namespace {

// Calibration defaults, the same for every kind (docs/simulate.md "Calibration"):
//   bandwidth 0.85  achievable HBM bandwidth is 80-90% of peak in published STREAM-like and
//                   memcpy measurements on A100/H100 (e.g. ~2.9-3.0 TB/s of 3.35 TB/s on H100
//                   SXM, BabelStream / nvbandwidth runs); decode is bound by it.
//   flops 0.7       large BF16 GEMMs reach 60-75% of the dense datasheet peak in cuBLAS
//                   benchmarks (~650-750 of 989 TFLOP/s on H100 SXM; clocks drop under
//                   sustained tensor-core load).
//   allreduce 0.7   NCCL all_reduce_perf bus bandwidth on 8-GPU NVSwitch nodes is ~70-80% of the
//                   per-direction NVLink figure for large messages.
//   overhead 2 ms   CPU-side scheduling, input preparation and output processing per step in
//                   vLLM-like servers: vLLM's v0.6.0 performance post (Sept 2024) measured the GPU
//                   idle ~38% of the time on Llama 3 8B / H100 before its fixes; a few ms per
//                   step remains typical without CUDA graphs and multi-step scheduling.
constexpr double kBandwidthEfficiency = 0.85;
constexpr double kFlopsEfficiency = 0.7;
constexpr double kAllreduceEfficiency = 0.7;
constexpr double kStepOverheadS = 2e-3;
// Per hop of a ring collective: chosen so that a small-message all-reduce over 8 GPUs (14 hops)
// takes ~10 us within a node, the order of nccl-tests all_reduce_perf at small sizes on DGX
// H100/A100, and ~5 us per hop across InfiniBand (switch + NIC + software).
constexpr double kNvlinkHopS = 0.75e-6;
constexpr double kNetworkHopS = 5e-6;

constexpr double kTB = 1e12;
constexpr double kGB = 1e9;
constexpr double kTFlops = 1e12;

Accelerator Gpu(std::string name, double memory_gb, double bandwidth_tb_s, double bf16_tflops,
                double fp8_tflops, double nvlink_gb_s_per_direction, double network_gbit_s,
                std::string source) {
    Accelerator a;
    a.name = std::move(name);
    a.memory_bytes = static_cast<int64_t>(memory_gb * kGB);
    a.memory_bandwidth = bandwidth_tb_s * kTB;
    a.bf16_flops = bf16_tflops * kTFlops;
    a.fp8_flops = fp8_tflops * kTFlops;
    a.intra_node_bandwidth = nvlink_gb_s_per_direction * kGB;
    a.intra_node_latency_s = kNvlinkHopS;
    a.network_bandwidth = network_gbit_s * kGB / 8;
    a.network_latency_s = kNetworkHopS;
    a.gpus_per_node = 8;
    a.bandwidth_efficiency = kBandwidthEfficiency;
    a.flops_efficiency = kFlopsEfficiency;
    a.allreduce_efficiency = kAllreduceEfficiency;
    a.step_overhead_s = kStepOverheadS;
    a.source = std::move(source);
    return a;
}

std::vector<Accelerator> MakeBuiltins() {
    std::vector<Accelerator> v;
    // NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOP/s
    // dense (624 with sparsity), no FP8; NVLink 3 600 GB/s total = 300 GB/s per direction; DGX
    // A100: 8 GPUs, one 200 Gb/s HDR InfiniBand NIC per GPU.
    v.push_back(Gpu("A100-80GB-SXM", 80, 2.039, 312, 0, 300, 200,
                    "NVIDIA A100 datasheet (80GB SXM); DGX A100 (8x HDR 200 Gb/s)"));
    // NVIDIA H100 datasheet (SXM): 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOP/s dense (1,979 sparse),
    // FP8 1,979 dense (3,958 sparse); NVLink 4 900 GB/s total = 450 per direction; DGX H100: one
    // 400 Gb/s NDR InfiniBand NIC (ConnectX-7) per GPU.
    v.push_back(Gpu("H100-SXM", 80, 3.35, 989, 1979, 450, 400,
                    "NVIDIA H100 datasheet (SXM); DGX H100 (8x NDR 400 Gb/s)"));
    // NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, the H100's tensor cores (989 / 1,979
    // TFLOP/s dense), NVLink 900 GB/s; HGX H200 networking as DGX H100.
    v.push_back(Gpu("H200-SXM", 141, 4.8, 989, 1979, 450, 400,
                    "NVIDIA H200 datasheet (SXM); HGX H200 (8x NDR 400 Gb/s)"));
    // NVIDIA DGX B200 / HGX B200 datasheets: 1,440 GB over 8 GPUs = 180 GB HBM3e each, 8 TB/s,
    // FP8 72 PFLOP/s training per 8 GPUs = 9 PF sparse = 4.5 PF dense, BF16 half of that
    // (2.25 PF dense); NVLink 5 1.8 TB/s total = 900 GB/s per direction; 8x 400 Gb/s ConnectX-7.
    v.push_back(Gpu("B200", 180, 8.0, 2250, 4500, 900, 400,
                    "NVIDIA DGX/HGX B200 datasheets (180 GB per GPU, 8x 400 Gb/s)"));
    // kvshard's own CPU engine: no roofline; step times come from a measured CpuProfile
    // (cost_model.h). Memory is a placeholder the catalog file should set to the KV pool the
    // machine can give (it sizes NumKvBlocks only).
    Accelerator cpu;
    cpu.name = "cpu";
    cpu.memory_bytes = 16 * (int64_t{1} << 30);
    cpu.gpus_per_node = 1;
    cpu.step_overhead_s = 0;  // the profile's intercept holds it
    cpu.needs_profile = true;
    cpu.source = "measured: a CpuProfile fitted to kvshard bench-engine figures";
    v.push_back(cpu);
    return v;
}

std::string Normalize(std::string_view name) {
    std::string out;
    for (char c : name) {
        if (c == '-' || c == '_' || c == ' ') continue;
        out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    return out;
}

// Normalized aliases of the built-ins, by canonical name.
const std::vector<std::pair<std::string, std::vector<std::string>>>& Aliases() {
    static const auto* aliases = new std::vector<std::pair<std::string, std::vector<std::string>>>{
        {"A100-80GB-SXM",
         {"a100", "a10080gb", "a100sxm", "a100sxm4", "a100sxm80gb", "a100sxm480gb", "a10080gbsxm"}},
        {"H100-SXM", {"h100", "h100sxm", "h100sxm5", "h10080gb", "h100sxm80gb", "h100sxm580gb"}},
        {"H200-SXM", {"h200", "h200sxm", "h200141gb", "h200sxm141gb"}},
        {"B200", {"b200", "b200sxm", "hgxb200", "dgxb200"}},
        {"cpu", {"cpu"}},
    };
    return *aliases;
}

bool Matches(const Accelerator& a, const std::string& normalized) {
    if (Normalize(a.name) == normalized) return true;
    for (const auto& [canonical, names] : Aliases()) {
        if (canonical != a.name) continue;
        if (std::find(names.begin(), names.end(), normalized) != names.end()) return true;
    }
    return false;
}

Accelerator* FindIn(std::vector<Accelerator>& catalog, std::string_view name) {
    const std::string n = Normalize(name);
    for (Accelerator& a : catalog) {
        if (Matches(a, n)) return &a;
    }
    return nullptr;
}

std::string Fmt(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
}

struct Field {
    const char* key;
    double Accelerator::*real = nullptr;
    int64_t Accelerator::*integer = nullptr;
};

const std::vector<Field>& Fields() {
    static const auto* fields = new std::vector<Field>{
        {"memory_bytes", nullptr, &Accelerator::memory_bytes},
        {"memory_bandwidth", &Accelerator::memory_bandwidth},
        {"bf16_flops", &Accelerator::bf16_flops},
        {"fp8_flops", &Accelerator::fp8_flops},
        {"intra_node_bandwidth", &Accelerator::intra_node_bandwidth},
        {"intra_node_latency_s", &Accelerator::intra_node_latency_s},
        {"network_bandwidth", &Accelerator::network_bandwidth},
        {"network_latency_s", &Accelerator::network_latency_s},
        {"gpus_per_node", nullptr, &Accelerator::gpus_per_node},
        {"bandwidth_efficiency", &Accelerator::bandwidth_efficiency},
        {"flops_efficiency", &Accelerator::flops_efficiency},
        {"allreduce_efficiency", &Accelerator::allreduce_efficiency},
        {"step_overhead_s", &Accelerator::step_overhead_s},
    };
    return *fields;
}

// Fields a new kind (no built-in, no base) must give; the calibration factors have defaults.
bool RequiredForNewKind(std::string_view key) {
    return key == "memory_bytes" || key == "memory_bandwidth" || key == "bf16_flops" ||
           key == "intra_node_bandwidth" || key == "network_bandwidth";
}

Result<double> Number(const YAML::Node& node, const std::string& where) {
    if (!node.IsScalar()) return InvalidArgument(where + ": expected a number");
    const std::string& text = node.Scalar();
    try {
        size_t used = 0;
        const double v = std::stod(text, &used);
        if (used == text.size() && std::isfinite(v)) return v;
    } catch (const std::exception&) {
    }
    return InvalidArgument(where + ": '" + text + "' is not a number");
}

Status ApplyEntry(const YAML::Node& body, const std::string& name, const std::string& where,
                  std::vector<Accelerator>& catalog) {
    if (!body.IsMap()) return InvalidArgument(where + ": expected a map of fields");
    Accelerator* existing = FindIn(catalog, name);
    Accelerator a;
    bool is_new = existing == nullptr;
    if (existing != nullptr) {
        a = *existing;
    } else {
        a = Gpu(name, 0, 0, 0, 0, 0, 0, "");
        a.memory_bytes = 0;
        if (const YAML::Node base = body["base"]; base) {
            if (!base.IsScalar()) return InvalidArgument(where + ".base: expected a name");
            const Accelerator* b = FindIn(catalog, base.Scalar());
            if (b == nullptr) {
                return InvalidArgument(where + ".base: unknown accelerator '" + base.Scalar() +
                                       "'");
            }
            a = *b;
            is_new = false;
        }
        a.name = name;
        a.source = "catalog file";
    }
    for (const auto& kv : body) {
        const std::string key = kv.first.as<std::string>();
        const std::string at = where + "." + key;
        if (key == "name" || key == "base") continue;
        if (key == "source") {
            if (!kv.second.IsScalar()) return InvalidArgument(at + ": expected a string");
            a.source = kv.second.Scalar();
            continue;
        }
        if (key == "needs_profile") {
            if (!kv.second.IsScalar() ||
                (kv.second.Scalar() != "true" && kv.second.Scalar() != "false")) {
                return InvalidArgument(at + ": expected true or false");
            }
            a.needs_profile = kv.second.Scalar() == "true";
            continue;
        }
        const auto f = std::find_if(Fields().begin(), Fields().end(),
                                    [&](const Field& x) { return key == x.key; });
        if (f == Fields().end()) return InvalidArgument(at + ": unknown field");
        KV_ASSIGN_OR_RETURN(const double v, Number(kv.second, at));
        if (f->real != nullptr) {
            a.*(f->real) = v;
        } else {
            if (v != std::floor(v) || std::fabs(v) > 9e18) {
                return InvalidArgument(at + ": " + Fmt(v) + " is not an integer");
            }
            a.*(f->integer) = static_cast<int64_t>(v);
        }
    }
    if (is_new && !a.needs_profile) {
        for (const Field& f : Fields()) {
            if (RequiredForNewKind(f.key) && !body[f.key]) {
                return InvalidArgument(where + "." + f.key +
                                       ": missing (a new kind without base: gives every number)");
            }
        }
    }
    KV_RETURN_IF_ERROR(ValidateAccelerator(a, where));
    if (existing != nullptr) {
        *existing = a;
    } else {
        catalog.push_back(a);
    }
    return Status::Ok();
}

// REQUIRES: called inside a try block (yaml-cpp throws on conversions of malformed nodes).
Status ApplyCatalog(const YAML::Node& root, const std::string& path,
                    std::vector<Accelerator>& catalog) {
    if (root.IsNull()) return Status::Ok();
    if (!root.IsMap()) return InvalidArgument(path + ": expected a map with key 'accelerators'");
    for (const auto& kv : root) {
        const std::string key = kv.first.as<std::string>();
        if (key != "accelerators") return InvalidArgument(path + ": " + key + ": unknown key");
    }
    const YAML::Node list = root["accelerators"];
    if (!list || list.IsNull()) return Status::Ok();
    if (list.IsMap()) {
        for (const auto& kv : list) {
            const std::string name = kv.first.as<std::string>();
            KV_RETURN_IF_ERROR(
                ApplyEntry(kv.second, name, path + ": accelerators." + name, catalog));
        }
        return Status::Ok();
    }
    if (!list.IsSequence()) {
        return InvalidArgument(path + ": accelerators: expected a map or a list");
    }
    for (size_t i = 0; i < list.size(); ++i) {
        const YAML::Node e = list[i];
        const std::string at = path + ": accelerators[" + std::to_string(i) + "]";
        if (!e.IsMap() || !e["name"] || !e["name"].IsScalar()) {
            return InvalidArgument(at + ".name: missing");
        }
        const std::string name = e["name"].Scalar();
        KV_RETURN_IF_ERROR(ApplyEntry(e, name, path + ": accelerators." + name, catalog));
    }
    return Status::Ok();
}

}  // namespace

const std::vector<Accelerator>& BuiltinAccelerators() {
    static const auto* builtins = new std::vector<Accelerator>(MakeBuiltins());
    return *builtins;
}

Result<Accelerator> FindAccelerator(std::string_view name) {
    return FindAccelerator(name, BuiltinAccelerators());
}

Result<Accelerator> FindAccelerator(std::string_view name,
                                    const std::vector<Accelerator>& catalog) {
    const std::string n = Normalize(name);
    std::string known;
    for (const Accelerator& a : catalog) {
        if (Matches(a, n)) return a;
        known += (known.empty() ? "" : ", ") + a.name;
    }
    return NotFound("unknown accelerator '" + std::string(name) + "' (known: " + known + ")");
}

Status ValidateAccelerator(const Accelerator& a, const std::string& where) {
    auto positive = [&](const char* key, double v) -> Status {
        if (v > 0 && std::isfinite(v)) return Status::Ok();
        return InvalidArgument(where + "." + key + ": must be positive, got " + Fmt(v));
    };
    auto non_negative = [&](const char* key, double v) -> Status {
        if (v >= 0 && std::isfinite(v)) return Status::Ok();
        return InvalidArgument(where + "." + key + ": must be >= 0, got " + Fmt(v));
    };
    auto fraction = [&](const char* key, double v) -> Status {
        if (v > 0 && v <= 1) return Status::Ok();
        return InvalidArgument(where + "." + key + ": must be in (0, 1], got " + Fmt(v));
    };
    KV_RETURN_IF_ERROR(positive("memory_bytes", static_cast<double>(a.memory_bytes)));
    KV_RETURN_IF_ERROR(positive("gpus_per_node", static_cast<double>(a.gpus_per_node)));
    KV_RETURN_IF_ERROR(non_negative("step_overhead_s", a.step_overhead_s));
    KV_RETURN_IF_ERROR(non_negative("fp8_flops", a.fp8_flops));
    KV_RETURN_IF_ERROR(non_negative("intra_node_latency_s", a.intra_node_latency_s));
    KV_RETURN_IF_ERROR(non_negative("network_latency_s", a.network_latency_s));
    if (a.needs_profile) return Status::Ok();
    KV_RETURN_IF_ERROR(positive("memory_bandwidth", a.memory_bandwidth));
    KV_RETURN_IF_ERROR(positive("bf16_flops", a.bf16_flops));
    KV_RETURN_IF_ERROR(positive("intra_node_bandwidth", a.intra_node_bandwidth));
    KV_RETURN_IF_ERROR(positive("network_bandwidth", a.network_bandwidth));
    KV_RETURN_IF_ERROR(fraction("bandwidth_efficiency", a.bandwidth_efficiency));
    KV_RETURN_IF_ERROR(fraction("flops_efficiency", a.flops_efficiency));
    KV_RETURN_IF_ERROR(fraction("allreduce_efficiency", a.allreduce_efficiency));
    return Status::Ok();
}

Result<std::vector<Accelerator>> ParseAcceleratorCatalog(std::string_view yaml_text,
                                                         const std::string& path) {
    std::vector<Accelerator> catalog = BuiltinAccelerators();
    try {
        const YAML::Node root = YAML::Load(std::string(yaml_text));
        KV_RETURN_IF_ERROR(ApplyCatalog(root, path, catalog));
    } catch (const YAML::Exception& e) {
        return InvalidArgument(path + ": line " + std::to_string(e.mark.line + 1) + ": " + e.msg);
    }
    return catalog;
}

Result<std::vector<Accelerator>> LoadAcceleratorCatalog(const std::string& yaml_path) {
    std::ifstream in(yaml_path);
    if (!in) return NotFound(yaml_path + ": cannot open the accelerator catalog");
    std::stringstream text;
    text << in.rdbuf();
    return ParseAcceleratorCatalog(text.str(), yaml_path);
}

}  // namespace kvshard::sim
