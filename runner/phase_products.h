// A method's global phases' products in the job directory (JobPaths::PhaseProducts): saved by
// CalibrateStep, loaded by the block tasks, which make the method again with them once.
// Internal to the job steps (runner/job_steps.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"
#include "methods/parts.h"
#include "proto/job.pb.h"
#include "runner/job_steps.h"

namespace qcal::job {

// A global phase's result: its products, every tensor F64 (exact for float32 values and whole
// numbers below 2^53), metadata calibration_key and phase, and the phase's training curve (when
// it trained) as metadata training_curve (its journal entry, runner/journal.h PhaseDoneEntry),
// with the cache checksum beside it (calib::CacheChecksumPath).
Status SavePhaseResult(const std::string& path, const methods::PhaseResult& result,
                       const std::string& phase, const std::string& key);
// NotFound when absent; FailedPrecondition for another calibration key or phase; DataLoss for a
// checksum mismatch or a malformed file (naming it).
StatusOr<methods::PhaseResult> LoadPhaseResult(const std::string& path, const std::string& phase,
                                               const std::string& key);

// The curve as the journal and the report read it (none when the phase trained nothing).
std::optional<v1::PhaseCurve> CurveOf(const std::string& phase,
                                      const methods::TrainingCurve& curve);

// Makes ctx->method again with the products of the recipe's global phases (its parts that depend
// on them, such as learned rotations or a prefix, get them at construction), once per job
// context. FailedPrecondition naming block `layer` when a phase has no usable products.
Status BindPhaseProducts(JobContext* ctx, int64_t layer);

}  // namespace qcal::job
