// One export format (export/export.h lists them): what it can express of a checkpoint, how each
// decoder linear becomes its tensors, and its quantization_config. The formats share the tensor
// planner (export/tensor_plan.h) and decide from data alone: the method's ServedForward and the
// grids linears are stored on.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/model/llama.h"
#include "export/tensor_plan.h"

namespace qcal::exporter {

class Format {
 public:
  virtual ~Format() = default;
  // The dtype the float tensors (embedding, norms, head) are written in; nullopt: tables as
  // stored, vectors in float32.
  virtual std::optional<DType> FloatDType() const = 0;
  // Refuses, before anything is planned, what the format cannot express (FailedPrecondition
  // naming the checkpoint and the reason).
  virtual Status Check() = 0;
  // Plans linear `k` of block `layer` into the TensorPlan the format was made with.
  virtual Status PlanLinear(int64_t layer, model::LinearKind k) = 0;
  // Every tensor is planned (warnings about the plan go here).
  virtual void PlanDone() {}
  // Every tensor is written into `dir`: sets config.json's quantization_config and torch_dtype in
  // `config` and writes the format's own files beside it. The quantization_config (null: none).
  virtual StatusOr<nlohmann::json> Finish(const std::string& dir, nlohmann::json* config) = 0;
};

std::unique_ptr<Format> MakeGptqFormat(const Source& source, TensorPlan* plan);
std::unique_ptr<Format> MakeCompressedTensorsFormat(const Source& source, TensorPlan* plan);
std::unique_ptr<Format> MakeDenseFormat(const Source& source, TensorPlan* plan);

}  // namespace qcal::exporter
