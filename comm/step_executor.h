// StepExecutor: runs one StepPlan on every rank of an instance and returns rank 0's StepResult.
// The coordinator's engine loop holds one per instance; implementations are the embedded worker
// group (worker/, threads of this process) and the remote one (worker processes over TCP).
#pragma once

#include "comm/step_plan.h"
#include "common/status.h"

namespace kvshard {

class StepExecutor {
public:
    virtual ~StepExecutor() = default;
    // Blocks until the step is done. A non-OK status means the instance could not run the step
    // (a worker died, a transport failed); the plan's sequences must be failed or rescheduled.
    virtual Result<StepResult> Execute(const StepPlan& plan) = 0;
};

}  // namespace kvshard
