// What `kvshard simulate` prints beside bench's report: the simulation's own figures (KV usage,
// preemptions, handoffs, pool utilization) as text or JSON (docs/simulate.md). The per-request
// file of --per-request-out is loadgen/trace_file.h's WritePerRequestFile.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "sim/cluster/simulator.h"

namespace kvshard::cli {

std::string SimulationText(const sim::SimulationResult& r);
nlohmann::json SimulationJson(const sim::SimulationResult& r);
// The fitted CPU profile read from `path`: its terms, and per kind of step its median factor
// (two lines, each starting "profile PATH: "; scripts/validate-simulate parses them).
std::string ProfileText(const std::string& path, const sim::CpuProfile& p);

}  // namespace kvshard::cli
