// Accelerator: what the simulator knows of one kind of GPU (datasheet peaks, links) and the
// calibration factors that turn peaks into achievable rates. A built-in catalog holds the
// datasheet numbers of A100 80GB SXM, H100 SXM, H200 SXM and B200 (sources in accelerator.cc and
// docs/simulate.md); a YAML file may override any field of a built-in or add new kinds.
//
// Units are SI throughout: bytes, bytes per second, FLOP per second, seconds.
// The calibration factors are defaults taken from published measurements, the same for every
// benchmark case; a user who measured their own machine overrides them in the catalog file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard::sim {

struct Accelerator {
    std::string name;                 // canonical, e.g. "H200-SXM"
    int64_t memory_bytes = 0;         // device memory (datasheet capacity)
    double memory_bandwidth = 0;      // peak HBM bandwidth, B/s
    double bf16_flops = 0;            // dense (no sparsity) BF16 tensor-core peak, FLOP/s
    double fp8_flops = 0;             // dense FP8 peak, FLOP/s; 0: no FP8 tensor cores
    double intra_node_bandwidth = 0;  // NVLink, B/s per direction per GPU
    double intra_node_latency_s = 0;  // per ring hop of a collective within a node
    double network_bandwidth = 0;     // between nodes, B/s per direction per GPU (one NIC each)
    double network_latency_s = 0;     // per ring hop between nodes
    int64_t gpus_per_node = 8;
    // Calibration: achieved / peak, in (0, 1]; and a fixed host-side cost per step.
    double bandwidth_efficiency = 0.85;
    double flops_efficiency = 0.7;
    double allreduce_efficiency = 0.7;  // also applies to KV transfers over the same links
    double step_overhead_s = 0;
    // true: no roofline numbers; a CostModel for it needs a measured CpuProfile (the "cpu" kind).
    bool needs_profile = false;
    std::string source;  // where the numbers come from, one line
};

// The built-in catalog: A100-80GB-SXM, H100-SXM, H200-SXM, B200, cpu.
const std::vector<Accelerator>& BuiltinAccelerators();

// Looks `name` up case-insensitively, ignoring '-', '_' and spaces, among canonical names and
// aliases ("h200", "H200-SXM", "h200_sxm", "a100", "A100-SXM4-80GB", ...). NotFound listing the
// known names otherwise.
Result<Accelerator> FindAccelerator(std::string_view name);
Result<Accelerator> FindAccelerator(std::string_view name, const std::vector<Accelerator>& catalog);

// Reads a catalog file: the built-ins, with the file's entries applied. Either form:
//   accelerators:                      accelerators:
//     h200:                              - name: h200
//       bandwidth_efficiency: 0.9            bandwidth_efficiency: 0.9
//     my-gpu:                            - name: my-gpu
//       base: h100                           memory_bytes: 96e9   # a new kind: every field
//       memory_bytes: 96000000000            ...
// An entry whose name matches a built-in (aliases included) overrides the fields it gives; `base:`
// starts a new kind from a built-in; otherwise a new kind must give memory, bandwidth, BF16
// FLOP/s and both link bandwidths (the rest keep the built-ins' defaults). Errors: NotFound for a
// missing file, InvalidArgument in one line "<file>: accelerators.<name>.<field>: <problem>"
// (unknown field, not a number, must be positive, must be in (0, 1], missing).
Result<std::vector<Accelerator>> LoadAcceleratorCatalog(const std::string& yaml_path);
// The same from YAML text; `path` is used in messages only.
Result<std::vector<Accelerator>> ParseAcceleratorCatalog(std::string_view yaml_text,
                                                         const std::string& path);

// Every field in range (see LoadAcceleratorCatalog); `where` prefixes messages.
Status ValidateAccelerator(const Accelerator& a, const std::string& where);

}  // namespace kvshard::sim
