// quarot_results: QuaRot quantization in process + perplexity, one JSON line per recipe (used for
// the QuaRot rows of docs/results.md; see scripts/quarot-results.sh). Not a test.
//
//   quarot_results --model DIR --data-root ../shared --eval FILE [--eval FILE...] --ctx N
//                  [--max-tokens N] [--save-dir DIR] [--kl] RECIPE.yaml...
//
// For each recipe: loads the float model, samples the recipe's calibration tokens (when
// NeedsCalibration), runs methods::quarot::QuantizeModel, and evaluates perplexity (--bos-per-window
// windows of ctx tokens, every text token scored) on each --eval file. With --save-dir the
// quantized model is also written as a checkpoint (DIR/<recipe name>) that `qcal eval` loads.
// "float" as a recipe evaluates the float model. With --kl each evaluation also reports "kl", the
// mean KL(float ‖ quantized) of the next-token distributions in nats per scored token
// (tools::CompareToReference; the float model runs alongside).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "common/cli.h"
#include "common/recipe.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "worker/calib/calibration.h"
#include "worker/eval/perplexity.h"
#include "methods/quarot/checkpoint.h"
#include "methods/quarot/quarot_model.h"
#include "methods/registry.h"
#include "worker/tools/model_compare.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qcal;
  SetProgramName("quarot_results");
  std::string model_dir, data_root = "../shared", save_dir;
  std::vector<std::string> evals, recipes;
  int64_t ctx = 512, max_tokens = -1;
  bool kl = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--model") model_dir = next();
    else if (a == "--data-root") data_root = next();
    else if (a == "--eval") evals.push_back(next());
    else if (a == "--ctx") ctx = std::atoll(next().c_str());
    else if (a == "--max-tokens") max_tokens = std::atoll(next().c_str());
    else if (a == "--save-dir") save_dir = next();
    else if (a == "--kl") kl = true;
    else if (a.rfind("--", 0) == 0) return Fail("unknown option " + a);
    else recipes.push_back(a);
  }
  if (model_dir.empty() || evals.empty() || recipes.empty()) {
    return Fail("usage: --model DIR --eval FILE [--eval FILE] [--ctx N] RECIPE.yaml|float...");
  }
  auto probe = LlamaConfig();
  auto config = LoadLlamaConfig(model_dir);
  if (!config.ok()) return Fail(config.status().ToString());
  probe = *config;
  model::SetComputeThreads(model::AutoComputeThreads(probe));
  auto tokenizer = LoadTokenizerFromModelDir(model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status().ToString());
  std::vector<std::vector<int32_t>> eval_tokens;
  for (const std::string& f : evals) {
    auto text = ReadTextFile(f);
    if (!text.ok()) return Fail(text.status().ToString());
    eval_tokens.push_back((*tokenizer)->Encode(*text));
  }
  std::unique_ptr<model::LlamaModel> reference;
  if (kl) {
    auto r = model::LlamaModel::Load(model_dir);
    if (!r.ok()) return Fail(r.status().ToString());
    reference = std::move(*r);
  }
  for (const std::string& path : recipes) {
    nlohmann::json out = {{"model", model_dir}};
    auto m = model::LlamaModel::Load(model_dir);
    if (!m.ok()) return Fail(m.status().ToString());
    const auto t0 = Clock::now();
    if (path == "float") {
      out["recipe"] = "float";
    } else {
      auto recipe = qcal::LoadRecipe(path);
      if (!recipe.ok()) return Fail(recipe.status().ToString());
      out["recipe"] = recipe->name;
      at::Tensor calib;
      if (methods::quarot::NeedsCalibration(*recipe)) {
        const int64_t seq_len = std::min(recipe->calibration.seq_len,
                                         probe.max_position_embeddings);
        auto c = calib::SampleCalibrationTokens(**tokenizer, recipe->calibration, data_root,
                                                seq_len, (*tokenizer)->bos_id());
        if (!c.ok()) return Fail(c.status().ToString());
        calib = *c;
      }
      auto report = methods::quarot::QuantizeModel(**m, *recipe, calib, 8);
      if (!report.ok()) return Fail(path + ": " + report.status().ToString());
      out["rotations"] = report->plan.Describe();
      double code = 0, stored = 0, n = 0;
      for (const auto& b : report->blocks) {
        nlohmann::json rel;
        for (const auto& l : b.linears) rel[l.name] = l.relative;
        out["relative_proxy_loss"].push_back(rel);
        for (const auto& l : b.linears) {
          code += l.code_bits;
          stored += l.stored_bits;
          n += 1;
        }
      }
      out["code_bits"] = n > 0 ? code / n : 32.0;
      out["stored_bits"] = n > 0 ? stored / n : 32.0;
      out["quantize_s"] = Since(t0);
      if (!save_dir.empty()) {
        const Status s = methods::quarot::SaveQuarotCheckpoint(**m, *recipe, model_dir,
                                                      save_dir + "/" + recipe->name,
                                                      out["code_bits"], out["stored_bits"]);
        if (!s.ok()) return Fail(s.ToString());
        out["saved"] = save_dir + "/" + recipe->name;
      }
    }
    for (size_t i = 0; i < evals.size(); ++i) {
      eval::PerplexityOptions opt;
      opt.ctx = ctx;
      opt.bos_per_window = true;
      opt.max_tokens = max_tokens;
      opt.bos_id = (*tokenizer)->bos_id();
      const auto t1 = Clock::now();
      if (kl) {
        auto c = tools::CompareToReference(*reference, **m, eval_tokens[i], opt);
        if (!c.ok()) return Fail(c.status().ToString());
        out["eval"].push_back({{"data", evals[i]},
                               {"perplexity", c->ppl_model},
                               {"kl", c->mean_kl},
                               {"tokens", c->tokens_scored},
                               {"seconds", Since(t1)}});
        continue;
      }
      auto r = eval::EvaluatePerplexity(**m, eval_tokens[i], opt);
      if (!r.ok()) return Fail(r.status().ToString());
      out["eval"].push_back({{"data", evals[i]},
                             {"perplexity", r->perplexity},
                             {"tokens", r->tokens_scored},
                             {"seconds", Since(t1)}});
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}
