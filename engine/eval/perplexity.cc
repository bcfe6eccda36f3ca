#include "engine/eval/perplexity.h"

#include <chrono>
#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "engine/model/activation_store.h"
#include "engine/model/block_walk.h"
#include "common/log.h"
#include "engine/model/llama.h"

namespace qcal::eval {
namespace {

// A window of the stream; see the two conventions in perplexity.h.
struct Window {
  int64_t start;   // index into the stream
  int64_t length;  // input length
};

// Consecutive windows of equal length, batched: what one forward pass scores.
struct Batch {
  at::Tensor inputs;   // [nb, T] int64
  at::Tensor targets;  // [nb, T] int64
  int64_t windows_done = 0;  // windows scored once this batch is
};

struct Plan {
  std::vector<Batch> batches;
  int64_t text_count = 0;
  int64_t windows = 0;
};

// drop_bos: the model has a prefix ending with BOS (model::PrefixKv), which stands for a window's
// leading BOS: such a window runs without it, and its first target (predicted from the BOS) is
// not scored. Window 0 of the default convention, the only one that starts with BOS, is batched
// alone.
StatusOr<Plan> PlanBatches(const std::vector<int32_t>& text_tokens, const PerplexityOptions& opt,
                           int64_t max_pos, bool drop_bos = false) {
  if (opt.ctx < 2) return absl::InvalidArgumentError(absl::StrCat("--ctx ", opt.ctx, " < 2"));
  if (opt.ctx > max_pos) {
    return absl::InvalidArgumentError(absl::StrCat("--ctx ", opt.ctx,
                                                   " exceeds the model's max_position_embeddings ",
                                                   max_pos));
  }
  if (opt.batch < 1) return absl::InvalidArgumentError("batch must be >= 1");

  // Build the stream the windows index into.
  std::vector<int64_t> stream;
  int64_t text_count = static_cast<int64_t>(text_tokens.size());
  if (opt.max_tokens >= 0) text_count = std::min(text_count, opt.max_tokens);
  if (!opt.bos_per_window) stream.push_back(opt.bos_id);
  stream.insert(stream.end(), text_tokens.begin(), text_tokens.begin() + text_count);

  // bos_per_window: Window.length is the number of targets (= inputs, BOS included).
  // default: Window.length is ctx stream tokens (ctx - 1 targets).
  std::vector<Window> windows;
  if (opt.bos_per_window) {
    for (int64_t s = 0; s < text_count; s += opt.ctx - 1) {
      windows.push_back({s, std::min(opt.ctx - 1, text_count - s)});  // length = targets
    }
  } else {
    const int64_t n = static_cast<int64_t>(stream.size()) / opt.ctx;
    for (int64_t w = 0; w < n; ++w) windows.push_back({w * opt.ctx, opt.ctx});
  }
  if (windows.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("only ", text_count,
                                                   " tokens: not one window of --ctx ", opt.ctx));
  }
  Plan plan;
  plan.text_count = text_count;
  const int64_t num_windows = static_cast<int64_t>(windows.size());
  plan.windows = num_windows;
  for (int64_t w0 = 0; w0 < num_windows;) {
    // Batch consecutive windows of equal length.
    int64_t w1 = w0 + 1;
    const bool alone = drop_bos && !opt.bos_per_window && w0 == 0;
    while (!alone && w1 < num_windows && w1 - w0 < opt.batch &&
           windows[w1].length == windows[w0].length) {
      ++w1;
    }
    const int64_t nb = w1 - w0;
    const int64_t len = windows[w0].length;
    Batch batch;
    at::Tensor& inputs = batch.inputs;
    at::Tensor& targets = batch.targets;
    if (opt.bos_per_window) {
      // inputs: BOS, t[s], ..., t[s+len-2]  (len inputs); targets: t[s], ..., t[s+len-1]
      inputs = at::empty({nb, len}, at::kLong);
      targets = at::empty({nb, len}, at::kLong);
      auto in = inputs.accessor<int64_t, 2>();
      auto tg = targets.accessor<int64_t, 2>();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t s = windows[w0 + b].start;
        in[b][0] = opt.bos_id;
        for (int64_t j = 0; j < len; ++j) {
          if (j + 1 < len) in[b][j + 1] = stream[s + j];
          tg[b][j] = stream[s + j];
        }
      }
    } else {
      // inputs: stream[s .. s+len-2]; targets: stream[s+1 .. s+len-1]
      inputs = at::empty({nb, len - 1}, at::kLong);
      targets = at::empty({nb, len - 1}, at::kLong);
      auto in = inputs.accessor<int64_t, 2>();
      auto tg = targets.accessor<int64_t, 2>();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t s = windows[w0 + b].start;
        for (int64_t j = 0; j + 1 < len; ++j) {
          in[b][j] = stream[s + j];
          tg[b][j] = stream[s + j + 1];
        }
      }
    }
    batch.windows_done = w1;
    if (drop_bos && (opt.bos_per_window || w0 == 0)) {  // every row starts with BOS
      const int64_t t = inputs.size(1);
      inputs = inputs.narrow(1, 1, t - 1).contiguous();
      targets = targets.narrow(1, 1, t - 1).contiguous();
      if (t == 1) {  // nothing left to score
        w0 = w1;
        continue;
      }
    }
    plan.batches.push_back(std::move(batch));
    w0 = w1;
  }
  return plan;
}

// Negative log-likelihood of the targets under the logits [nb, T, V], summed in double.
double BatchNll(const at::Tensor& logits, const at::Tensor& targets) {
  at::Tensor logp = at::log_softmax(logits, -1);
  at::Tensor picked =
      logp.gather(-1, targets.to(logits.device()).unsqueeze(-1)).squeeze(-1);  // [nb, T]
  return -model::SumToDouble(picked);
}

PerplexityResult Finish(const Plan& plan, double nll_sum, int64_t scored, double seconds) {
  PerplexityResult r;
  r.tokens_encoded = plan.text_count;
  r.tokens_scored = scored;
  r.windows = plan.windows;
  r.mean_nll = nll_sum / static_cast<double>(scored);
  r.perplexity = std::exp(r.mean_nll);
  r.seconds = seconds;
  r.tokens_per_s = seconds > 0 ? scored / seconds : 0;
  return r;
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

StatusOr<PerplexityResult> EvaluatePerplexity(const model::LlamaModel& model,
                                              const std::vector<int32_t>& text_tokens,
                                              const PerplexityOptions& opt,
                                              const ProgressFn& progress) {
  const model::PrefixKv* prefix =
      model.num_blocks() > 0 ? model.block(0).hooks().prefix.get() : nullptr;
  const bool drop_bos = prefix != nullptr && !prefix->tokens.empty() &&
                        prefix->tokens.back() == opt.bos_id;
  QCAL_ASSIGN_OR_RETURN(Plan plan, PlanBatches(text_tokens, opt,
                                               model.config().max_position_embeddings, drop_bos));
  at::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  double nll_sum = 0;
  int64_t scored = 0;
  for (const Batch& b : plan.batches) {
    nll_sum += BatchNll(model.Forward(b.inputs), b.targets);
    scored += b.targets.numel();
    if (progress) progress(b.windows_done, plan.windows);
  }
  return Finish(plan, nll_sum, scored, Since(t0));
}

StatusOr<PerplexityResult> EvaluatePerplexityStreamed(model::ModelSource& source,
                                                      const std::vector<int32_t>& text_tokens,
                                                      const PerplexityOptions& opt,
                                                      const StreamOptions& stream,
                                                      const ProgressFn& progress) {
  // Block 0 is read first: a prefix installed by the checkpoint's method (PrefixQuant) changes
  // how the windows are cut, as in EvaluatePerplexity.
  const int64_t blocks = source.config().num_hidden_layers;
  std::unique_ptr<model::DecoderBlock> first;
  if (blocks > 0) {
    QCAL_ASSIGN_OR_RETURN(first, source.LoadBlock(0));
  }
  const model::PrefixKv* prefix = first ? first->hooks().prefix.get() : nullptr;
  const bool drop_bos = prefix != nullptr && !prefix->tokens.empty() &&
                        prefix->tokens.back() == opt.bos_id;
  QCAL_ASSIGN_OR_RETURN(Plan plan, PlanBatches(text_tokens, opt,
                                               source.config().max_position_embeddings, drop_bos));
  at::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> ids;
  for (const Batch& b : plan.batches) ids.push_back(b.inputs);
  try {
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::BlockWalk> walk,
                          model::BlockWalk::Embed(source, ids, stream.memory_budget_bytes,
                                                  stream.spill_path));
    bool warned = false;
    for (int64_t l = 0; l < blocks; ++l) {
      std::unique_ptr<model::DecoderBlock> block = std::move(first);
      if (l > 0) {
        QCAL_ASSIGN_OR_RETURN(block, source.LoadBlock(l));
      }
      bool on_device = false;
      if (!stream.device.is_cpu()) {
        const Status moved = block->MoveTo(stream.device);
        on_device = moved.ok();
        if (!on_device && !warned) {
          QCAL_LOG_WARN("evaluation: block {} runs on the CPU: {}", l, moved.ToString());
          warned = true;
        }
        if (!on_device) block = nullptr;  // partly moved: read it again
        if (block == nullptr) {
          QCAL_ASSIGN_OR_RETURN(block, source.LoadBlock(l));
        }
      }
      QCAL_RETURN_IF_ERROR(walk->Forward(*block, source.rope(),
                                         on_device ? stream.device : at::Device(at::kCPU)));
      if (stream.block_progress) stream.block_progress(l + 1, blocks);
    }
    double nll_sum = 0;
    int64_t scored = 0;
    for (int64_t i = 0; i < walk->chunks(); ++i) {
      const Batch& b = plan.batches[i];
      QCAL_ASSIGN_OR_RETURN(at::Tensor x, walk->store().Get(i));
      QCAL_ASSIGN_OR_RETURN(at::Tensor logits, source.Logits(x));
      nll_sum += BatchNll(logits, b.targets);
      scored += b.targets.numel();
      if (progress) progress(b.windows_done, plan.windows);
    }
    source.ReleaseHead();
    return Finish(plan, nll_sum, scored, Since(t0));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("evaluation forward failed: ", e.what()));
  }
}

}  // namespace qcal::eval
