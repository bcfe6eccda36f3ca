// One export format (export/export.h lists them): what it can express of a checkpoint, how each
// decoder linear becomes its tensors, and its quantization_config. The formats share the tensor
// planner (export/tensor_plan.h) and decide from data alone: the method's ServedForward and the
// grids linears are stored on.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

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
  // Plans linear `ref` into the TensorPlan the format was made with.
  virtual Status PlanLinear(const LinearRef& ref) = 0;
  // Plans the routed experts' linears of one MoE block (every expert's gate, up and down, in
  // order): each by PlanLinear, unless the format stores them otherwise (the dense export fuses
  // Llama 4's experts into the float checkpoint's 3-D tensors).
  virtual Status PlanExperts(const std::vector<LinearRef>& experts) {
    for (const LinearRef& ref : experts) QCAL_RETURN_IF_ERROR(PlanLinear(ref));
    return absl::OkStatus();
  }
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
