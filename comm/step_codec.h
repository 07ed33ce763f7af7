// The codec of StepPlan and StepResult (comm/step_plan.h), the frames every step sends: the
// payload encoding under comm/plan_codec.h's frames. Internal to comm/.
#pragma once

#include "comm/step_plan.h"
#include "comm/wire_fields.h"

namespace kvshard {

void EncodeStepPlan(wire::Writer& w, const StepPlan& plan);
void EncodeStepResult(wire::Writer& w, const StepResult& result);
// Decode what Encode wrote; a malformed payload leaves its error in r.status().
StepPlan DecodeStepPlan(wire::Reader& r);
StepResult DecodeStepResult(wire::Reader& r);

}  // namespace kvshard
