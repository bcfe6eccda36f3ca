#include "tools/model_compare.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/model/llama.h"

namespace qcal::tools {
namespace {

// Whether `model` has a prefix installed that ends with BOS.
bool EndsWithBos(const model::LlamaModel& model, int32_t bos) {
  if (model.num_blocks() == 0) return false;
  const auto& prefix = model.block(0).hooks().prefix;
  return prefix != nullptr && !prefix->tokens.empty() && prefix->tokens.back() == bos;
}

}  // namespace

StatusOr<ModelComparison> CompareToReference(const model::LlamaModel& ref,
                                             const model::LlamaModel& m,
                                             const std::vector<int32_t>& text_tokens,
                                             const eval::PerplexityOptions& opt,
                                             const eval::ProgressFn& progress) {
  if (ref.config().vocab_size != m.config().vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("vocabularies differ: reference ",
                                                   ref.config().vocab_size, ", model ",
                                                   m.config().vocab_size));
  }
  const int64_t max_pos =
      std::min(ref.config().max_position_embeddings, m.config().max_position_embeddings);
  if (opt.ctx < 2 || opt.ctx > max_pos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ctx ", opt.ctx, ": must be in [2, ", max_pos, "]"));
  }
  int64_t text_count = static_cast<int64_t>(text_tokens.size());
  if (opt.max_tokens >= 0) text_count = std::min(text_count, opt.max_tokens);
  // Each window as (inputs, targets), built the way EvaluatePerplexity builds them.
  struct Window {
    std::vector<int64_t> in, target;
  };
  std::vector<Window> windows;
  if (opt.bos_per_window) {
    for (int64_t s = 0; s < text_count; s += opt.ctx - 1) {
      const int64_t len = std::min(opt.ctx - 1, text_count - s);
      Window w;
      w.in.push_back(opt.bos_id);
      for (int64_t j = 0; j < len; ++j) {
        if (j + 1 < len) w.in.push_back(text_tokens[s + j]);
        w.target.push_back(text_tokens[s + j]);
      }
      windows.push_back(std::move(w));
    }
  } else {
    std::vector<int64_t> stream = {opt.bos_id};
    stream.insert(stream.end(), text_tokens.begin(), text_tokens.begin() + text_count);
    const int64_t n = static_cast<int64_t>(stream.size()) / opt.ctx;
    for (int64_t w = 0; w < n; ++w) {
      Window win;
      for (int64_t j = 0; j + 1 < opt.ctx; ++j) {
        win.in.push_back(stream[w * opt.ctx + j]);
        win.target.push_back(stream[w * opt.ctx + j + 1]);
      }
      windows.push_back(std::move(win));
    }
  }
  if (windows.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("only ", text_count, " tokens: not one window of --ctx ", opt.ctx));
  }

  at::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  double nll_ref = 0, nll = 0, kl = 0;
  int64_t scored = 0;
  for (size_t i = 0; i < windows.size(); ++i) {
    Window& w = windows[i];
    const int64_t len = static_cast<int64_t>(w.in.size());
    at::Tensor in = at::from_blob(w.in.data(), {1, len}, at::kLong).clone();
    at::Tensor tg = at::from_blob(w.target.data(), {len, 1}, at::kLong).clone();
    // A model behind a prefix that ends with BOS reads the window without its own BOS (as
    // EvaluatePerplexity runs it); the first text token then has no prediction in that model,
    // so it is scored in neither.
    const bool drop_ref = EndsWithBos(ref, opt.bos_id) && w.in[0] == opt.bos_id;
    const bool drop_m = EndsWithBos(m, opt.bos_id) && w.in[0] == opt.bos_id;
    const int64_t skip = drop_ref || drop_m ? 1 : 0;
    if (len - skip < 1) continue;
    auto log_probs = [&](const model::LlamaModel& model, bool drop) {  // [len - skip, V]
      const at::Tensor x = drop ? in.narrow(1, 1, len - 1) : in;
      const at::Tensor lp = at::log_softmax(model.Forward(x)[0].to(at::kDouble), -1);
      return lp.narrow(0, skip - (drop ? 1 : 0), len - skip);
    };
    // On the reference's device (both models' when they share one; no copy on the CPU).
    at::Tensor lp_ref = log_probs(ref, drop_ref);
    at::Tensor lp = log_probs(m, drop_m).to(lp_ref.device());
    tg = tg.narrow(0, skip, len - skip).to(lp_ref.device());
    nll_ref -= model::SumToDouble(lp_ref.gather(1, tg));
    nll -= model::SumToDouble(lp.gather(1, tg));
    kl += model::SumToDouble(lp_ref.exp() * (lp_ref - lp));
    scored += len - skip;
    if (progress) progress(static_cast<int64_t>(i + 1), static_cast<int64_t>(windows.size()));
  }
  ModelComparison r;
  r.tokens_scored = scored;
  r.windows = static_cast<int64_t>(windows.size());
  r.nll_reference = nll_ref / scored;
  r.nll_model = nll / scored;
  r.ppl_reference = std::exp(r.nll_reference);
  r.ppl_model = std::exp(r.nll_model);
  r.mean_kl = kl / scored;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace qcal::tools
