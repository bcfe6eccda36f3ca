// Streamed access to a model, one decoder block at a time: what calibration, evaluation and the
// block tasks read a model through, so a process never holds more of it than the block it is
// working on (plus, for the one task that needs them, the embedding table and the head).
//
//   FloatCheckpointSource (OpenFloatCheckpoint): a Hugging Face checkpoint directory
//     (model.safetensors or sharded with model.safetensors.index.json). Blocks are read from the
//     shards when asked for, converted from the stored dtype (F32, F16, BF16) to float32 tensor by
//     tensor, and the shards' pages are released after each read (SafetensorsFile::ReleasePages),
//     so resident memory stays at one block whatever the depth of the model. Embed() reads only
//     the embedding rows of the ids asked for; the head is set up on the first Logits(): a
//     float32 head is loaded, a 16-bit one (a bf16 128k-vocabulary table) stays as stored and
//     is converted in row chunks as each Logits() call multiplies by it.
//   Quantized checkpoints: methods/method_factory.h OpenModel (the method reads its blocks and
//     installs what inference computes with).
//
// Thread-compatible: one user at a time (a source caches the head after first use).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine/model/block_select.h"
#include "engine/model/llama.h"

namespace qcal::model {

class ModelSource {
 public:
  virtual ~ModelSource() = default;
  virtual const LlamaConfig& config() const = 0;
  virtual const Rope& rope() const = 0;
  // ids (any shape, int64) -> [..., hidden] float32, reading only the rows it needs.
  virtual StatusOr<at::Tensor> Embed(const at::Tensor& ids) = 0;
  // Block `layer`'s weights as the checkpoint stores them (float32 dense for a float
  // checkpoint; the method's layers for a quantized one), nothing installed.
  virtual StatusOr<BlockWeights> LoadBlockWeights(int64_t layer) = 0;
  // Block `layer` ready to run (a quantized checkpoint's online transforms and activation / KV
  // quantizers installed). The caller owns it; the source keeps nothing of it.
  virtual StatusOr<std::unique_ptr<DecoderBlock>> LoadBlock(int64_t layer) = 0;
  // Block `layer` with only the routed experts `select` names (block_select.h; select.dense must
  // be set): the other experts' slots are null, so the block runs only with a
  // BlockHooks::run_experts that does not need them (expert-parallel calibration). A float
  // checkpoint reads only the selected experts; the default loads the block and drops the rest.
  virtual StatusOr<std::unique_ptr<DecoderBlock>> LoadBlockPart(int64_t layer,
                                                                const BlockSelection& select);
  // Final RMSNorm + head: [..., hidden] -> logits [..., vocab] float32. The head is loaded on the
  // first call and kept.
  virtual StatusOr<at::Tensor> Logits(const at::Tensor& hidden) = 0;
  // What Logits computes with, loaded now if not yet and kept until ReleaseHead: logits =
  // head->Forward(RmsNorm(hidden, final_norm, rms_norm_eps)). For a caller that multiplies by
  // them many times with nothing left to fail (end-to-end fine-tuning's teacher).
  struct LoadedHead {
    at::Tensor final_norm;         // [hidden] float32
    const Linear* head = nullptr;  // hidden -> vocab; owned by the source
  };
  virtual StatusOr<LoadedHead> Head() = 0;
  // Embedding table, final norm and head, whole.
  virtual StatusOr<NonBlockWeights> LoadNonBlock() = 0;
  // Frees the head loaded by Logits().
  virtual void ReleaseHead() = 0;

  // The non-block weights in pieces, for writers that stream them (a 128k-row table is never
  // whole in memory): rows [begin, begin + count) of the head ([count, hidden] float32; the
  // embedding's rows when the head is tied); the final norm's weights [hidden] float32; whether
  // the head is the embedding table.
  virtual StatusOr<at::Tensor> HeadRows(int64_t begin, int64_t count) = 0;
  virtual StatusOr<at::Tensor> FinalNorm() = 0;
  virtual bool HeadTied() const = 0;
  // Adds the source's tensor `name` to `writer` exactly as stored (dtype and bytes), streamed
  // while the writer writes (the source must outlive that).
  virtual Status AddStoredTensor(SafetensorsWriter* writer, const std::string& name) = 0;
};

// Rows per chunk when a [rows, cols] table is streamed (a 16-bit head multiplied per Logits()
// call, a transformed table written in pieces): TableChunkElements() / cols, at least 1. The
// default, 2^24 elements, is 64 MB of float32 per chunk. Process-wide; tests lower it to run
// the chunking on small models.
int64_t TableChunkRows(int64_t cols);
int64_t TableChunkElements();
void SetTableChunkElements(int64_t elements);

// A float checkpoint directory. Errors name the directory and the problem (config.json,
// missing tensors, shapes that do not match the config).
StatusOr<std::unique_ptr<ModelSource>> OpenFloatCheckpoint(const std::string& dir);

// The shared parts of a checkpoint-backed source: config, rope, the reader, embedding rows,
// final norm and head from the checkpoint's non-block tensors (model.embed_tokens.weight,
// model.norm.weight, lm_head.weight when present or untied). Subclasses say how blocks load.
class CheckpointSource : public ModelSource {
 public:
  CheckpointSource(LlamaConfig config, std::unique_ptr<CheckpointReader> ckpt);
  const LlamaConfig& config() const override { return config_; }
  const Rope& rope() const override { return rope_; }
  StatusOr<at::Tensor> Embed(const at::Tensor& ids) override;
  StatusOr<std::unique_ptr<DecoderBlock>> LoadBlock(int64_t layer) override;
  StatusOr<at::Tensor> Logits(const at::Tensor& hidden) override;
  StatusOr<LoadedHead> Head() override;
  StatusOr<NonBlockWeights> LoadNonBlock() override;
  void ReleaseHead() override;
  StatusOr<at::Tensor> HeadRows(int64_t begin, int64_t count) override;
  StatusOr<at::Tensor> FinalNorm() override;
  bool HeadTied() const override;
  Status AddStoredTensor(SafetensorsWriter* writer, const std::string& name) override;
  CheckpointReader& reader() { return *ckpt_; }

 protected:
  // What LoadBlock adds to the loaded weights (nothing by default).
  virtual Status InstallOnBlock(DecoderBlock* block, int64_t layer) { return Status(); }
  // The head's table (lm_head, or the embedding when tied), checked against the config.
  StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> HeadTable();

 private:
  LlamaConfig config_;
  std::unique_ptr<CheckpointReader> ckpt_;
  Rope rope_;
  at::Tensor final_norm_;
  std::unique_ptr<Linear> head_;
};

}  // namespace qcal::model
