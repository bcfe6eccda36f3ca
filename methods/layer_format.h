// Layer formats: how one linear of a quantized checkpoint is stored and read back, by name.
//
// A stored layer writes itself (model::Linear::AppendTensors) and names its format
// (model::Linear::layer_format(): "dense", "scalar", "quip"); a checkpoint records the format of
// its quantized linears in quantization_config "format", and a loader looks that name up here.
// A method's set of formats is "dense" (a linear left in float: "<prefix>.weight") and
// "scalar" (engine/quant/scalar_linear.h), plus any format of its own it adds (QuIP#'s
// codebook layers: methods/quip/quip_method.cc). docs/formats.md describes each.
//
// Thread-safety: immutable after construction; shared by concurrent block tasks.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"
#include "engine/model/llama.h"

namespace qcal::methods {

class LayerFormat {
 public:
  virtual ~LayerFormat() = default;
  // The name layers of this format report (model::Linear::layer_format()).
  virtual const char* name() const = 0;
  // The layer stored under `prefix`. NotFound / InvalidArgument naming the checkpoint and tensor.
  virtual StatusOr<std::unique_ptr<model::Linear>> Load(CheckpointReader& ckpt,
                                                        const std::string& prefix) const = 0;
};

class LayerFormats {
 public:
  LayerFormats();  // "dense" and "scalar"
  // Adds a method's own format (replacing one of the same name).
  void Add(std::shared_ptr<const LayerFormat> format);
  // nullptr for a name not in the set.
  const LayerFormat* Find(std::string_view name) const;

  // Writes linear.stored() under `prefix` in its format. InvalidArgument when that format is not
  // in the set (a method's checkpoint holds only layers it can read back).
  Status Append(const model::Linear& linear, const std::string& prefix,
                SafetensorsWriter* writer) const;
  // Reads "<prefix>" back: dense when "<prefix>.weight" exists (a linear left in float), else
  // in format `quantized` (the checkpoint's quantization_config "format").
  StatusOr<std::unique_ptr<model::Linear>> Load(CheckpointReader& ckpt, const std::string& prefix,
                                                const std::string& quantized) const;

 private:
  std::vector<std::shared_ptr<const LayerFormat>> formats_;
};

}  // namespace qcal::methods
