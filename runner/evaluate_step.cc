// EvaluateStep: perplexity of the float or the quantized model on one text file. (runner/job_steps.h)
#include "runner/job_steps.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/safe_fs.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "engine/eval/perplexity.h"
#include "methods/method_factory.h"
#include "runner/budgets.h"
#include "runner/job_dir.h"
#include "runner/step_util.h"

namespace qcal::job {
namespace {

// A relative text path resolves under the spec's data root.
std::string Resolve(const std::string& root, const std::string& path) {
  return !path.empty() && path[0] == '/' ? path : root + "/" + path;
}

}  // namespace

StatusOr<v1::EvalResult> EvaluateStep(JobContext* ctx, const v1::EvalParams& params,
                                      const JobEventFn& on_event) {
  const bool quantized = params.model() == "quantized";
  if (!quantized && params.model() != "float") {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: model '", params.model(), "' is neither float nor quantized"));
  }
  const std::string dir = quantized ? ctx->spec.out_dir() : ctx->spec.model_dir();
  std::unique_ptr<model::ModelSource> source;
  if (quantized) {
    QCAL_ASSIGN_OR_RETURN(source, methods::OpenModel(dir));
  } else {
    QCAL_ASSIGN_OR_RETURN(source, model::OpenFloatCheckpoint(dir));
  }
  QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(dir));
  QCAL_ASSIGN_OR_RETURN(std::string text,
                        ReadTextFile(Resolve(ctx->spec.data_root(), params.path())));
  eval::PerplexityOptions opt;
  opt.ctx = params.ctx();
  opt.max_tokens = params.max_tokens();
  opt.bos_per_window = params.bos_per_window();
  opt.bos_id = tokenizer->bos_id();
  eval::StreamOptions stream;
  stream.memory_budget_bytes = ActivationBudget(*ctx);
  stream.device = ctx->torch_device;
  QCAL_RETURN_IF_ERROR(MakeDirs(JobPaths(ctx->spec.job_dir()).spill));
  stream.spill_path =
      absl::StrCat(JobPaths(ctx->spec.job_dir()).spill, "/eval-", params.model(), "-",
                   params.label(), ".f32");
  const std::string phase = absl::StrCat("eval ", params.label(), " ", params.model());
  stream.block_progress = [&](int64_t d, int64_t t) { step::Emit(on_event, phase, d, t); };
  QCAL_ASSIGN_OR_RETURN(eval::PerplexityResult r,
                        eval::EvaluatePerplexityStreamed(*source, tokenizer->Encode(text), opt,
                                                         stream));
  v1::EvalResult result;
  *result.mutable_params() = params;
  result.set_tokens(r.tokens_encoded);
  result.set_scored(r.tokens_scored);
  result.set_windows(r.windows);
  result.set_perplexity(r.perplexity);
  result.set_mean_nll(r.mean_nll);
  result.set_seconds(r.seconds);
  return result;
}

}  // namespace qcal::job
