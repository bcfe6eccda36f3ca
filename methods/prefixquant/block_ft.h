// Block-wise fine-tuning of a PrefixQuant block (the reference's Block-AP; prefixquant_spec.h
// BlockFtSpec): the one translation unit that needs LibTorch's optimizers.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "methods/prefixquant/prefixquant_spec.h"
#include "engine/model/llama.h"

namespace qcal::methods::prefixquant {

struct BlockFtReport {
  double val_mse_before = 0, val_mse_after = 0;      // held-out sequences [n_train, N)
  double train_loss_first = 0, train_loss_last = 0;  // mean of the first / last epoch's steps
  int64_t steps = 0;
};

// Trains `weights` (lr_weights) and `steps` (lr_steps), float32 leaves that the block's forward
// reads, to minimise MSE(block(x[i]), y[i]) over the sequences i < n_train of x, y [N, S, hidden],
// `spec.epochs` passes in batches of spec.batch in an order drawn from std::mt19937_64(seed);
// after every optimizer step `after_step` runs (no grad: the callers clamp the steps). The
// held-out MSE is measured on [n_train, N) (0 when empty). Deterministic for a fixed thread count.
StatusOr<BlockFtReport> TrainBlock(const model::DecoderBlock& block, const model::Rope& rope,
                                   const at::Tensor& x, const at::Tensor& y, int64_t n_train,
                                   const std::vector<at::Tensor>& weights,
                                   const std::vector<at::Tensor>& steps, const BlockFtSpec& spec,
                                   uint64_t seed, const std::function<void()>& after_step);

}  // namespace qcal::methods::prefixquant
