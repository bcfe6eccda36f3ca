// Job states as people and JSON read them ("QUEUED", "RUNNING", ...): one definition for the
// coordinator's messages and the CLI's output.
#pragma once

#include "proto/qcal.pb.h"

namespace qcal::rpc {

// "QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED" ("UNSPECIFIED" otherwise).
const char* JobStateName(v1::JobState state);
// SUCCEEDED, FAILED or CANCELLED: the job will not change any more.
bool IsFinalState(v1::JobState state);

}  // namespace qcal::rpc
