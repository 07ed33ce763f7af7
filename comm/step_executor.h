// StepExecutor: runs one StepPlan on every rank of an instance and returns rank 0's StepResult.
// The coordinator's engine loop holds one per instance; implementations are the embedded worker
// group (worker/, threads of this process) and the remote one (worker processes over TCP).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/step_plan.h"
#include "common/status.h"

namespace kvshard {

class StepExecutor {
public:
    virtual ~StepExecutor() = default;
    // Blocks until the step is done. A non-OK status means the instance could not run the step
    // (a worker died, a transport failed); the plan's sequences must be failed or rescheduled.
    virtual Result<StepResult> Execute(const StepPlan& plan) = 0;

    // OK while the executor can run steps; otherwise why not. Turns non-OK as soon as the
    // executor knows a worker is gone (a heartbeat deadline, a closed connection), also while no
    // step runs, so GET /health and the router see a dead instance without a request finding out.
    // Any thread.
    virtual Status Health() const { return Status::Ok(); }

    // Counts the times the instance's workers were formed: it changes when a failed executor is
    // re-formed with new workers (whose KV pools are empty, so the engine must forget every
    // block it cached). Any thread.
    virtual uint64_t epoch() const { return 0; }

    // The KvTransport endpoint of each rank (disaggregated handoff), as of the current epoch.
    virtual std::vector<std::string> kv_endpoints() const { return {}; }
};

}  // namespace kvshard
