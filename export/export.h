// Exporting a qcal checkpoint into formats other programs load (`qcal export`):
//
//   gptq   the standard GPTQ layout ("checkpoint_format": "gptq", a.k.a. v1) that Hugging Face
//          transformers' GPTQ integration, AutoGPTQ / GPTQModel and vLLM load: Hugging Face
//          tensor names, qweight / qzeros / scales / g_idx per linear (ScalarQuantLinear's
//          GptqTensors), the unquantized tensors (embedding, norms, head) in the model's
//          torch_dtype, config.json with quantization_config {"quant_method": "gptq", "bits",
//          "group_size", "desc_act", "sym", "checkpoint_format": "gptq"} and quantize_config.json,
//          the tokenizer files, shards split by size with an index. Only checkpoints whose every
//          linear is on a scalar integer grid with fp16-exact scales (rtn, gptq; QuaRot weights
//          without online transforms) and whose function a plain Llama forward computes (the
//          method's ServedForward has no online step) can be expressed; anything else is refused
//          with the reason (lattice codes, online rotations, activation or KV-cache
//          quantization).
//   compressed-tensors
//          the format llm-compressor writes and vLLM and transformers load ("quant_method":
//          "compressed-tensors", "format": "pack-quantized"): per linear weight_packed (codes
//          packed 32/bits to an int32 along the input dimension), weight_scale (the model's dtype),
//          weight_zero_point (asymmetric grids, packed along the output dimension), weight_g_idx
//          (activation order), weight_shape; one config group ("channel" or "group" strategy,
//          symmetric or not, "actorder": "group" when any g_idx reorders), lm_head ignored. The
//          same checkpoints as gptq can be expressed (2 to 8 bits; scales exact in the model's
//          dtype; no zero-point restriction), and also those whose online steps are all on
//          linear inputs (ServedForward: int8 input quantizers, W8A8 as "int-quantized" with
//          int8 weights in `weight` and input_activations dynamic per token or static per tensor
//          with an input_scale per linear; block Hadamards as transform_config); the rest is
//          refused with the reason.
//   dense  a float checkpoint whose linears are the quantized checkpoint's dequantized weights
//          (float32), for any method whose function a plain forward computes: what an engine
//          without quantized kernels, or an independent check, runs.
//
// Each format decides from data alone, in its own file (gptq_format.cc,
// compressed_tensors_format.cc, dense_format.cc: export/format.h) over a shared tensor planner
// (export/tensor_plan.h): the method's ServedForward (methods/parts.h) and the grids the linears
// are stored on.
// docs/formats.md ("GPTQ export") documents the layout. The output directory is written as
// "<out>.partial" and renamed when complete; nothing is left behind on failure. Tensors stream
// into their shards (one block in memory at a time, tables converted in row chunks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace qcal::exporter {

struct ExportOptions {
  std::string format;   // "gptq" | "compressed-tensors" | "dense"
  std::string in_dir;   // a finished qcal checkpoint
  std::string out_dir;  // must not exist, or be an empty directory
  // Shards hold at most this many bytes of tensor data, except a single larger tensor, which
  // gets a shard of its own (Hugging Face's rule). One shard: model.safetensors, no index.
  int64_t max_shard_bytes = int64_t{5} << 30;
};

struct ExportResult {
  std::string out_dir;
  std::vector<std::string> shards;
  int64_t tensors = 0;
  uint64_t tensor_bytes = 0;
  nlohmann::json quantization_config;  // null for dense
};

StatusOr<ExportResult> ExportCheckpoint(const ExportOptions& options);

}  // namespace qcal::exporter
