// Calibration sequences (GPTQ's sampling): the recipe's text files are read (newlines
// normalised), concatenated with "\n\n", tokenized once, and num_sequences windows of seq_len − 1
// tokens are taken at offsets drawn uniformly with std::mt19937_64(seed); each sequence is BOS +
// its window.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/recipe.h"
#include "common/status.h"
#include "common/tokenizer.h"

namespace qcal::calib {

// [num_sequences, seq_len] int64. Files are resolved against `data_root` when relative. Errors:
// missing file (named), too little text for one window.
StatusOr<at::Tensor> SampleCalibrationTokens(const Tokenizer& tokenizer,
                                             const CalibrationSpec& spec,
                                             const std::string& data_root, int64_t seq_len,
                                             int32_t bos_id);

}  // namespace qcal::calib
