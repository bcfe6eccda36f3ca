#include "methods/prefixquant/block_ft.h"

// The one translation unit of the method that needs LibTorch's optimizers (and autograd's
// backward()).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"

namespace qcal::methods::prefixquant {
namespace {

double MeanMse(const model::DecoderBlock& block, const model::Rope& rope, const at::Tensor& x,
               const at::Tensor& y, int64_t begin, int64_t end, int64_t batch) {
  if (end <= begin) return 0;
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t count = 0;
  for (int64_t s = begin; s < end; s += batch) {
    const int64_t b = std::min(batch, end - s);
    const at::Tensor d = block.Forward(x.narrow(0, s, b), rope).to(at::kDouble) -
                         y.narrow(0, s, b).to(at::kDouble);
    sum += d.pow(2).sum().item<double>();
    count += d.numel();
  }
  return sum / static_cast<double>(count);
}

}  // namespace

StatusOr<BlockFtReport> TrainBlock(const model::DecoderBlock& block, const model::Rope& rope,
                                   const at::Tensor& x, const at::Tensor& y, int64_t n_train,
                                   const std::vector<at::Tensor>& weights,
                                   const std::vector<at::Tensor>& steps, const BlockFtSpec& spec,
                                   uint64_t seed, const std::function<void()>& after_step) {
  const int64_t n = x.size(0);
  if (n_train < 1 || n_train > n || y.sizes() != x.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("block fine-tuning: ", n_train,
                                                   " training sequences of ", n));
  }
  BlockFtReport report;
  try {
    report.val_mse_before = MeanMse(block, rope, x, y, n_train, n, spec.batch);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    const bool train_weights = spec.lr_weights > 0 && !weights.empty();
    const bool train_steps = spec.lr_steps > 0 && !steps.empty();
    if (train_weights) {
      groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(spec.lr_weights));
      static_cast<torch::optim::AdamWOptions&>(groups.back().options()).weight_decay(0);
    }
    if (train_steps) {
      groups.emplace_back(steps, std::make_unique<torch::optim::AdamWOptions>(spec.lr_steps));
      static_cast<torch::optim::AdamWOptions&>(groups.back().options()).weight_decay(0);
    }
    if (groups.empty()) {
      report.val_mse_after = report.val_mse_before;
      return report;
    }
    const double base_lr[2] = {spec.lr_weights, spec.lr_steps};
    torch::optim::AdamW adam(std::move(groups), torch::optim::AdamWOptions(spec.lr_weights));
    const int64_t per_epoch = (n_train + spec.batch - 1) / spec.batch;
    const int64_t total = spec.epochs * per_epoch;
    std::mt19937_64 rng(seed);
    std::vector<int64_t> order(n_train);
    at::AutoGradMode grad(true);
    double first_sum = 0, last_sum = 0;
    int64_t t = 0;
    for (int64_t epoch = 0; epoch < spec.epochs; ++epoch) {
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      double epoch_sum = 0;
      for (int64_t s = 0; s < n_train; s += spec.batch, ++t) {
        const int64_t b = std::min(spec.batch, n_train - s);
        const at::Tensor idx =
            at::from_blob(order.data() + s, {b}, at::kLong).clone();
        const at::Tensor xb = x.index_select(0, idx), yb = y.index_select(0, idx);
        // Cosine decay per step to a tenth of each group's rate (the reference's min_lr_factor).
        const double f = 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * t / std::max<int64_t>(1, total)));
        for (size_t g = 0; g < adam.param_groups().size(); ++g) {
          const double lr = (train_weights && g == 0 ? base_lr[0] : base_lr[1]) * f;
          static_cast<torch::optim::AdamWOptions&>(adam.param_groups()[g].options()).lr(lr);
        }
        adam.zero_grad();
        const at::Tensor loss = (block.Forward(xb, rope) - yb).pow(2).mean();
        loss.backward();
        adam.step();
        {
          at::NoGradGuard no_grad;
          if (after_step) after_step();
        }
        epoch_sum += loss.item<double>();
      }
      if (epoch == 0) first_sum = epoch_sum / per_epoch;
      last_sum = epoch_sum / per_epoch;
    }
    report.train_loss_first = first_sum;
    report.train_loss_last = last_sum;
    report.steps = total;
    report.val_mse_after = MeanMse(block, rope, x, y, n_train, n, spec.batch);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("block fine-tuning: ", e.what()));
  }
  return report;
}

}  // namespace qcal::methods::prefixquant
