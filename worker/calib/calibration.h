// Calibration data and per-block Hessians for a quantization job (QuIP# §F / GPTQ convention).
//
// Sequences: the recipe's text files are read (newlines normalised), concatenated with "\n\n",
// tokenized once, and num_sequences windows of seq_len − 1 tokens are taken at offsets drawn
// uniformly with std::mt19937_64(seed) (GPTQ's sampling); each sequence is BOS + its window.
// Hessians: the float model is walked block by block over all sequences; each block's four input
// Hessians are accumulated in fp64 (calib/hessian.h) and saved in the job directory as
// hessians/block_<l>.safetensors with the calibration key in the metadata, so that a later run
// with the same model, data and sampling reuses them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/recipe.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "worker/calib/hessian.h"
#include "worker/model/llama.h"

namespace qcal::calib {

// [num_sequences, seq_len] int64. Files are resolved against `data_root` when relative. Errors:
// missing file (named), too little text for one window.
StatusOr<at::Tensor> SampleCalibrationTokens(const Tokenizer& tokenizer,
                                             const CalibrationSpec& spec,
                                             const std::string& data_root, int64_t seq_len,
                                             int32_t bos_id);

// A stable key for cached calibration products: model directory identity (config + weight file
// sizes), the data files' sizes, and the sampling settings.
std::string CalibrationKey(const std::string& model_dir, const LlamaConfig& config,
                           const CalibrationSpec& spec, const std::string& data_root,
                           int64_t seq_len);

// Saves / loads one block's Hessians (F64 sums + token counts) under job_dir/hessians/.
Status SaveBlockHessians(const std::string& path, const BlockHessians& h, const std::string& key);
// NotFound when absent; FailedPrecondition when present with another key (stale cache).
StatusOr<BlockHessians> LoadBlockHessians(const std::string& path, const std::string& key);

struct CalibrationResult {
  std::vector<BlockHessians> hessians;  // one per block
  int64_t tokens = 0;                   // calibration tokens per Hessian
  bool from_cache = false;
  double seconds = 0;
};

// Computes (or loads from job_dir/hessians when the key matches) every block's Hessians by
// walking the float model over `tokens` in chunks of `batch` sequences. progress(block, blocks).
StatusOr<CalibrationResult> CollectModelHessians(model::LlamaModel& model,
                                                 const at::Tensor& tokens,
                                                 const std::string& job_dir,
                                                 const std::string& key, int64_t batch,
                                                 const std::function<void(int64_t, int64_t)>&
                                                     progress = nullptr);

}  // namespace qcal::calib
