// What every export format (export/gptq_format, compressed_tensors_format, dense_format) builds
// on: the checkpoint being exported (Source), its output tensors planned in order with the bytes
// made only when their shard is written (TensorPlan: one block in memory at a time), and the
// integer grids linears are stored on, read as data.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/model/llama.h"
#include "engine/quant/scalar_linear.h"
#include "methods/method.h"

namespace qcal::exporter {

using Sink = SafetensorsWriter::ByteSink;

// The finished qcal checkpoint being exported, opened once.
struct Source {
  std::string dir;
  LlamaConfig config;
  DType model_dtype = DType::kF32;  // config.json torch_dtype; float32 when absent
  std::unique_ptr<methods::Method> method;
  methods::ServedForward served;    // what the method says inference computes
  std::unique_ptr<CheckpointReader> ckpt;
};

// One quantized linear of a block: a dense one (attention, the dense MLP, Llama 4's shared
// expert) or a routed expert's. `prefix` is where it is stored, in the qcal checkpoint and in
// every export (the model's own names behind its tensor prefix: engine/model/llama.h
// LinearTensorName / ExpertTensorName).
struct LinearRef {
  int64_t layer = 0;
  model::LinearKind kind = model::LinearKind::kQ;  // an expert linear's role (ExpertLinearKind)
  int64_t expert = -1;                             // -1: the block's dense linear
  model::ExpertLinear expert_linear = model::ExpertLinear::kGate;
  std::string prefix;
};
LinearRef DenseLinearRef(const LlamaConfig& config, int64_t layer, model::LinearKind k);
LinearRef ExpertLinearRef(const LlamaConfig& config, int64_t layer, int64_t expert,
                          model::ExpertLinear k);
// [out, in] of the linear.
std::vector<int64_t> LinearRefShape(const LlamaConfig& config, const LinearRef& ref);
// The block's attention linears (q, k, v, o), then its dense MLP or shared expert (when it has
// one), then each routed expert's gate, up and down: every linear a block quantizes.
std::vector<LinearRef> BlockLinears(const LlamaConfig& config, int64_t layer);
// Whether a packed export (gptq, compressed-tensors) writes `ref` as a float `weight` (in the
// model's dtype, listed as not quantized) instead of its codes: Llama 4's q_proj, k_proj and
// v_proj. vLLM's Llama 4 loader turns Hugging Face's interleaved RoPE pairs into its half-split
// layout by permuting the rows of q_proj and k_proj, and only of tensors named `weight`: packed
// codes would be loaded unpermuted and attend wrongly; v_proj shares their fused qkv_proj, which
// takes one quantization scheme. llm-compressor's Llama 4 checkpoints leave attention in float
// for the same reason (docs/formats.md "Mixture-of-experts exports").
bool FloatInPackedExport(const LlamaConfig& config, const LinearRef& ref);

// Hands float32 values to `sink` as `dtype`, in pieces.
Status SinkAs(DType dtype, const float* data, size_t n, const Sink& sink);

// Refuses what the format cannot express of `source.served`: any online step, or, with
// `linear_inputs_allowed`, any step not on linear inputs. FailedPrecondition naming the
// checkpoint, the format and every such step.
Status CheckServed(const Source& source, const std::string& format, bool linear_inputs_allowed,
                   bool kv_cache_allowed = false);

// The integer grid a linear is stored on (its qconfig): what a packed format's layout follows.
struct GridShape {
  int bits = 0;
  int64_t in = 0, out = 0, groups = 0, group_size = -1;
  bool symmetric = true;
};
// The grid of linear `prefix`; FailedPrecondition when it is stored in another layer format
// (lattice or trellis codes), naming the method and the dense export.
StatusOr<GridShape> ReadGridShape(const Source& source, const std::string& prefix);
// Its scales [out, groups] as stored (float32).
StatusOr<std::vector<float>> ReadGridScales(const Source& source, const std::string& prefix,
                                            const GridShape& g);

// One quantization_config describes every linear: the first linear's grid, and each next one
// checked against it.
class UniformGrid {
 public:
  Status Add(const Source& source, const std::string& format, const std::string& prefix,
             const GridShape& g);
  const GridShape& grid() const { return *grid_; }

 private:
  std::optional<GridShape> grid_;
};

// One block of the input, loaded when the first of its tensors is written (tensors are written in
// order, so each block is loaded once): through the checkpoint's method (norms, static input
// ranges, dense weights) and, for packed formats, each linear's stored grid as data.
struct LoadedBlock {
  model::BlockWeights weights;
  std::map<std::string, quant::ScalarLinearData> grids;  // by LinearRef::prefix
  const quant::ScalarLinearData& grid(const LinearRef& ref) const { return grids.at(ref.prefix); }
  // The loaded layer of `ref` (a routed expert's from weights.moe).
  const model::Linear& linear(const LinearRef& ref) const;
};

// One tensor of the output: its place, and how its bytes are made when its shard is written.
struct PlannedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  SafetensorsWriter::Producer produce;
};

class TensorPlan {
 public:
  // `read_grids`: blocks also carry their linears' stored grids (packed formats).
  TensorPlan(const Source* source, bool read_grids);
  ~TensorPlan();

  // A table (embedding, head) stored in the checkpoint, converted to `dtype` in row chunks.
  Status AddTable(const std::string& name, DType dtype);
  // A float tensor of the checkpoint read whole (the final norm), in `dtype`.
  Status AddSmall(const std::string& name, DType dtype);
  // Tensor `name` of the checkpoint exactly as stored (dtype, shape, bytes): the vision tower
  // and projector of a multimodal Llama 4.
  Status AddStored(const std::string& name);
  // Linear `ref`'s dequantized weight [out, in] as `weight`, in `dtype`.
  void AddDenseWeight(const LinearRef& ref, DType dtype);
  // Tensor `name` of block `layer`, made from the loaded block by `make`.
  void AddBlockTensor(std::string name, DType dtype, std::vector<int64_t> shape, int64_t layer,
                      std::function<Status(const LoadedBlock&, const Sink&)> make);

  const std::vector<PlannedTensor>& tensors() const { return tensors_; }

 private:
  class BlockCache;
  const Source* source_;
  std::unique_ptr<BlockCache> cache_;  // shared by the producers
  std::vector<PlannedTensor> tensors_;
};

}  // namespace qcal::exporter
