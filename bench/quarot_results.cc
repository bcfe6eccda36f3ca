// quarot_results: QuaRot quantization (a job, as `qcal quantize` runs it) + perplexity, one JSON
// line per recipe (used for the QuaRot rows of docs/results.md; see scripts/quarot-results.sh).
// Not a test.
//
//   quarot_results --model DIR --data-root ../shared --eval FILE [--eval FILE...] --ctx N
//                  [--max-tokens N] [--save-dir DIR] [--kl] RECIPE.yaml...
//
// For each recipe: runs the job (runner/quantize_job.h: the recipe's calibration, every block,
// finalize) into DIR/<recipe name> (--save-dir; else a temporary directory, removed after), reads
// the checkpoint back through its method and evaluates perplexity (--bos-per-window windows of
// ctx tokens, every text token scored) on each --eval file. code_bits / stored_bits are the job's
// (quantization_config's: per weight over all linears).
// "float" as a recipe evaluates the float model. With --kl each evaluation also reports "kl", the
// mean KL(float ‖ quantized) of the next-token distributions in nats per scored token
// (tools::CompareToReference; the float model runs alongside).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "common/cli.h"
#include "common/recipe.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "common/atomic_file.h"
#include "engine/eval/perplexity.h"
#include "engine/qsim/rotate.h"
#include "methods/method_factory.h"
#include "methods/quarot/quarot_spec.h"
#include "methods/registry.h"
#include "runner/quantize_job.h"
#include "tools/model_compare.h"

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
    std::unique_ptr<model::LlamaModel> m;
    std::string temp_dir;  // the job's output when --save-dir is not given
    const auto t0 = Clock::now();
    if (path == "float") {
      out["recipe"] = "float";
      auto loaded = model::LlamaModel::Load(model_dir);
      if (!loaded.ok()) return Fail(loaded.status().ToString());
      m = std::move(*loaded);
    } else {
      auto recipe = qcal::LoadRecipe(path);
      if (!recipe.ok()) return Fail(recipe.status().ToString());
      out["recipe"] = recipe->name;
      if (recipe->method != "quarot") return Fail(path + ": not a quarot recipe");
      auto plan = qsim::PlanRotations(
          recipe->method_config<methods::quarot::QuarotConfig>().rotation, probe);
      if (!plan.ok()) return Fail(path + ": " + plan.status().ToString());
      out["rotations"] = plan->Describe();
      v1::JobSpec opt;
      opt.set_model_dir(model_dir);
      opt.set_data_root(data_root);
      opt.set_calib_batch(8);
      if (save_dir.empty()) {
        char tmpl[] = "/tmp/quarot_results.XXXXXX";
        if (::mkdtemp(tmpl) == nullptr) return Fail("cannot make a temporary directory");
        temp_dir = tmpl;
        opt.set_out_dir(temp_dir + "/out");
      } else {
        opt.set_out_dir(save_dir + "/" + recipe->name);  // its job directory: the default, beside it
      }
      auto result = job::RunQuantizeJob(*recipe, opt);
      if (!result.ok()) return Fail(path + ": " + result.status().ToString());
      for (const job::BlockSummary& b : result->blocks) {
        nlohmann::json rel;
        for (const auto& l : b.linears) rel[l.name] = l.relative;
        out["relative_proxy_loss"].push_back(rel);
      }
      out["code_bits"] = result->code_bits;
      out["stored_bits"] = result->stored_bits;
      out["quantize_s"] = Since(t0);
      if (!save_dir.empty()) out["saved"] = opt.out_dir();
      auto loaded = methods::LoadModel(opt.out_dir());
      if (!loaded.ok()) return Fail(loaded.status().ToString());
      m = std::move(*loaded);
    }
    for (size_t i = 0; i < evals.size(); ++i) {
      eval::PerplexityOptions opt;
      opt.ctx = ctx;
      opt.bos_per_window = true;
      opt.max_tokens = max_tokens;
      opt.bos_id = (*tokenizer)->bos_id();
      const auto t1 = Clock::now();
      if (kl) {
        auto c = tools::CompareToReference(*reference, *m, eval_tokens[i], opt);
        if (!c.ok()) return Fail(c.status().ToString());
        out["eval"].push_back({{"data", evals[i]},
                               {"perplexity", c->ppl_model},
                               {"kl", c->mean_kl},
                               {"tokens", c->tokens_scored},
                               {"seconds", Since(t1)}});
        continue;
      }
      auto r = eval::EvaluatePerplexity(*m, eval_tokens[i], opt);
      if (!r.ok()) return Fail(r.status().ToString());
      out["eval"].push_back({{"data", evals[i]},
                             {"perplexity", r->perplexity},
                             {"tokens", r->tokens_scored},
                             {"seconds", Since(t1)}});
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    if (!temp_dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(temp_dir, ec);
    }
  }
  return 0;
}
