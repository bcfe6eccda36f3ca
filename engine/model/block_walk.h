// The streamed walk calibration (engine/calib/calibration.cc), evaluation
// (engine/eval/perplexity.cc) and end-to-end fine-tuning's teacher (runner/job_steps.cc) share:
// chunks of token ids embedded into an ActivationStore (in memory up to a budget, else spilled
// to a file), then carried through the model one decoder block at a time, the block's forward
// over every chunk. The caller loads each block (a method's, a float one, with hooks installed)
// and decides what else happens between blocks; the walk holds no more than the store.
//
//   auto walk = BlockWalk::Embed(source, chunks, budget, spill);   // chunk i: ids [b_i, s]
//   for each layer l: block = source.LoadBlock(l); walk->Forward(*block, source.rope());
//                     (or walk->Map(step): the caller's forward of each chunk)
//   walk->store().Get(i)                                          // block outputs, chunk i
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/status.h"
#include "engine/model/activation_store.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"

namespace qcal::model {

class BlockWalk {
 public:
  // Chunk i of the store: source.Embed(ids[i]) ([b_i, s] int64 -> [b_i, s, hidden] float32).
  // `spill_path`'s directory must exist. Errors name the chunk or the file.
  static StatusOr<std::unique_ptr<BlockWalk>> Embed(ModelSource& source,
                                                    const std::vector<at::Tensor>& ids,
                                                    int64_t budget_bytes,
                                                    const std::string& spill_path);

  // Every chunk through `block`: on the CPU, or moved to `device` for the forward and back.
  Status Forward(const DecoderBlock& block, const Rope& rope,
                 const at::Device& device = at::Device(at::kCPU));

  // A block's step over a chunk: its activations in, the next ones out (calibration's forward,
  // which also collects Hessians or captures the linears' inputs). Errors return as Status.
  using ChunkStep = std::function<StatusOr<at::Tensor>(const at::Tensor& x)>;
  // Every chunk through `step`, in order.
  Status Map(const ChunkStep& step);
  // Chunk i through `step` (a caller that steps in lockstep with other ranks walks the chunks
  // itself).
  Status MapChunk(int64_t i, const ChunkStep& step);

  ActivationStore& store() { return *store_; }
  int64_t chunks() const { return store_->chunks(); }

 private:
  explicit BlockWalk(std::unique_ptr<ActivationStore> store) : store_(std::move(store)) {}
  std::unique_ptr<ActivationStore> store_;
};

}  // namespace qcal::model
