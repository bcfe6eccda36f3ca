#include "client/tool_commands.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "client/progress.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "worker/eval/perplexity.h"
#include "worker/model/llama.h"
#include "common/cli.h"
#include "methods/worker_registry.h"
#include "worker/qsim/bfp_kv.h"
#include "worker/qsim/ksort.h"
#include "worker/tools/model_compare.h"
#include "worker/tools/outlier_stats.h"
#include "worker/tools/plant_outliers.h"

namespace qcal::client {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int RunPlantOutliers(const PlantOutliersCliOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  tools::PlantOutliersOptions p;
  p.alpha = o.alpha;
  p.beta = o.beta;
  p.down_channels = o.channels;
  p.v_channels = o.channels;
  p.k_pairs = o.k_pairs;
  p.seed = o.seed;
  auto r = tools::PlantOutliers(o.model_dir, o.out_dir, p);
  if (!r.ok()) return Fail(r.status());
  const double seconds = SecondsSince(t0);
  if (o.json) {
    nlohmann::json j = tools::PlanToJson(p, r->plan);
    j["model"] = o.model_dir;
    j["out_dir"] = r->out_dir;
    j["tensors"] = r->tensors;
    j["seconds"] = seconds;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("planted outliers %s -> %s (%.2f s)\n", o.model_dir.c_str(), r->out_dir.c_str(),
                seconds);
    std::printf(
        "  per layer: %lld down_proj-input channels and %lld o_proj-input channels x %g; "
        "%lld K RoPE pair(s) per KV head x %g (W_q / %g); seed %llu\n",
        (long long)p.down_channels, (long long)p.v_channels, p.alpha, (long long)p.k_pairs, p.beta,
        p.beta, (unsigned long long)p.seed);
    std::printf("  channels: %s/planted_outliers.json\n", r->out_dir.c_str());
  }
  return 0;
}

int RunOutlierStats(const OutlierStatsOptions& o) {
  auto model = methods::LoadModel(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  model::SetComputeThreads(model::AutoComputeThreads((*model)->config()));
  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto text = ReadTextFile(o.data_path);
  if (!text.ok()) return Fail(text.status());
  std::vector<int32_t> tokens = (*tokenizer)->Encode(*text);
  if (o.tokens > 0 && static_cast<int64_t>(tokens.size()) > o.tokens) tokens.resize(o.tokens);
  auto stats = tools::MeasureOutlierStats(**model, tokens, o.ctx, (*tokenizer)->bos_id());
  if (!stats.ok()) return Fail(stats.status());
  const tools::LayerOutlierStats m = stats->Max();
  if (o.json) {
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& l : stats->layers) {
      layers.push_back(
          {{"down_proj_input", l.down_input}, {"o_proj_input", l.o_input}, {"k", l.k}});
    }
    nlohmann::json j = {
        {"model", o.model_dir},
        {"data", o.data_path},
        {"tokens", stats->tokens},
        {"ctx", o.ctx},
        {"layers", layers},
        {"max", {{"down_proj_input", m.down_input}, {"o_proj_input", m.o_input}, {"k", m.k}}}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("model  %s\ndata   %s (%lld tokens, ctx %lld)\n", o.model_dir.c_str(),
                o.data_path.c_str(), (long long)stats->tokens, (long long)o.ctx);
    std::printf("max/median of per-channel max|x|\n");
    std::printf("%-6s %16s %14s %10s\n", "layer", "down_proj input", "o_proj input", "K");
    for (size_t l = 0; l < stats->layers.size(); ++l) {
      const auto& s = stats->layers[l];
      std::printf("%-6zu %16.1f %14.1f %10.1f\n", l, s.down_input, s.o_input, s.k);
    }
    std::printf("%-6s %16.1f %14.1f %10.1f\n", "max", m.down_input, m.o_input, m.k);
  }
  return 0;
}

int RunKvEval(const KvEvalOptions& o) {
  auto model = methods::LoadModel(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  model::LlamaModel& m = **model;
  model::SetComputeThreads(o.threads > 0 ? o.threads : model::AutoComputeThreads(m.config()));
  if (o.k_sort_order != "pairs" && o.k_sort_order != "channels") {
    return Fail(absl::InvalidArgumentError("--k-sort-order '" + o.k_sort_order +
                                           "': expected pairs or channels"));
  }
  if (o.k_sort) {
    qsim::KSortOptions ko;
    ko.order =
        o.k_sort_order == "pairs" ? qsim::KSortOrder::kPairs : qsim::KSortOrder::kChannels;
    ko.sort_values = o.sort_values;
    auto perms = qsim::ApplyKSort(m, ko);
    if (!perms.ok()) return Fail(perms.status());
  }
  if (o.key_point != "pre-rope" && o.key_point != "post-rope") {
    return Fail(absl::InvalidArgumentError("--key-point '" + o.key_point +
                                           "': expected pre-rope or post-rope"));
  }
  const int64_t block = o.block == 0 ? m.config().head_dim : o.block;
  std::string describe = "float K cache";
  if (o.key_bits < 16 || o.query_bits < 16) {
    qsim::BfpKeyCacheOptions bo;
    bo.key_bits = o.key_bits;
    bo.query_bits = o.query_bits;
    bo.block = o.block;
    bo.point = o.key_point == "pre-rope" ? qsim::KeyQuantPoint::kPreRope
                                         : qsim::KeyQuantPoint::kPostRope;
    auto d = qsim::InstallBfpKeyCache(m, bo);
    if (!d.ok()) return Fail(d.status());
    describe = *d;
  }
  if (o.k_sort) describe += absl::StrCat(", K-sort (", o.k_sort_order, ")");

  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto text = ReadTextFile(o.data_path);
  if (!text.ok()) return Fail(text.status());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> tokens = (*tokenizer)->Encode(*text);
  const double tokenize_s = SecondsSince(t0);
  eval::PerplexityOptions opt;
  opt.ctx = o.ctx;
  opt.bos_per_window = o.bos_per_window;
  opt.max_tokens = o.max_tokens;
  opt.batch = o.batch;
  opt.bos_id = (*tokenizer)->bos_id();
  ProgressBar bar(o.kl ? "perplexity + KL" : "perplexity", 0);
  auto update = [&bar](int64_t done, int64_t total) { bar.Update(done, total); };
  tools::ModelComparison c;
  if (o.kl) {
    auto reference = methods::LoadModel(o.model_dir);
    if (!reference.ok()) return Fail(reference.status());
    auto r = tools::CompareToReference(**reference, m, tokens, opt, update);
    bar.Finish();
    if (!r.ok()) return Fail(r.status());
    c = *r;
  } else {
    auto r = eval::EvaluatePerplexity(m, tokens, opt, update);
    bar.Finish();
    if (!r.ok()) return Fail(r.status());
    c.tokens_scored = r->tokens_scored;
    c.windows = r->windows;
    c.nll_model = r->mean_nll;
    c.ppl_model = r->perplexity;
    c.seconds = r->seconds;
  }
  const double seconds = c.seconds + tokenize_s;
  if (o.json) {
    nlohmann::json j = {{"model", o.model_dir},
                        {"data", o.data_path},
                        {"kv", describe},
                        {"key_bits", o.key_bits},
                        {"query_bits", o.query_bits},
                        {"block", block},
                        {"key_point", o.key_point},
                        {"k_sort", o.k_sort},
                        {"ctx", o.ctx},
                        {"bos_per_window", o.bos_per_window},
                        {"tokens", c.tokens_scored},
                        {"windows", c.windows},
                        {"mean_nll", c.nll_model},
                        {"perplexity", c.ppl_model},
                        {"seconds", seconds}};
    if (o.kl) {
      j["float_perplexity"] = c.ppl_reference;
      j["mean_kl"] = c.mean_kl;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("model       %s\n", o.model_dir.c_str());
    std::printf("kv          %s\n", describe.c_str());
    std::printf("data        %s (%lld tokens scored, ctx %lld)\n", o.data_path.c_str(),
                (long long)c.tokens_scored, (long long)o.ctx);
    std::printf("mean NLL    %.6f\n", c.nll_model);
    std::printf("perplexity  %.4f\n", c.ppl_model);
    if (o.kl) {
      std::printf("float ppl   %.4f\n", c.ppl_reference);
      std::printf("KL to float %.6f nats/token\n", c.mean_kl);
    }
    std::printf("wall time   %.2f s\n", seconds);
  }
  return 0;
}

void AddToolCommands(CLI::App& app, int* exit_code) {
  auto* tool = app.add_subcommand("tool", "Developer tools (outlier planting, KV-cache studies)");
  tool->require_subcommand(1);

  auto* plant = tool->add_subcommand(
      "plant-outliers", "Write a function-preserving variant with planted activation outliers");
  auto po = std::make_shared<PlantOutliersCliOptions>();
  plant->add_option("--model", po->model_dir, "float model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  plant->add_option("--out", po->out_dir, "output model directory")->required();
  plant->add_option("--alpha", po->alpha, "factor on down_proj-input and o_proj-input channels")
      ->capture_default_str();
  plant->add_option("--beta", po->beta, "factor on K RoPE pairs (W_q divided)")
      ->capture_default_str();
  plant
      ->add_option("--channels", po->channels,
                   "down_proj-input and o_proj-input channels per layer")
      ->capture_default_str();
  plant->add_option("--k-pairs", po->k_pairs, "K RoPE pairs per KV head")->capture_default_str();
  plant->add_option("--seed", po->seed, "seed of the channel choice")->capture_default_str();
  plant->add_flag("--json", po->json, "print one JSON object");
  plant->callback([po, exit_code] { *exit_code = RunPlantOutliers(*po); });

  auto* stats = tool->add_subcommand(
      "outlier-stats", "Max/median channel ratios of the down_proj input, o_proj input and K");
  auto so = std::make_shared<OutlierStatsOptions>();
  stats->add_option("--model", so->model_dir, "model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  stats->add_option("--data", so->data_path, "UTF-8 text file")
      ->required()
      ->check(CLI::ExistingFile);
  stats->add_option("--tokens", so->tokens, "use the first N tokens (0 = all)")
      ->capture_default_str();
  stats->add_option("--ctx", so->ctx, "window length (BOS + ctx-1 tokens)")->capture_default_str();
  stats->add_flag("--json", so->json, "print one JSON object");
  stats->callback([so, exit_code] { *exit_code = RunOutlierStats(*so); });

  auto* kv = tool->add_subcommand("kv-eval",
                                  "Perplexity with BFP keys (and queries), optionally K-sorted");
  auto ko = std::make_shared<KvEvalOptions>();
  kv->add_option("--model", ko->model_dir, "float model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  kv->add_option("--data", ko->data_path, "UTF-8 text file")->required()->check(CLI::ExistingFile);
  kv->add_option("--ctx", ko->ctx, "window length in tokens")->capture_default_str();
  kv->add_option("--max-tokens", ko->max_tokens, "use at most this many text tokens");
  kv->add_option("--batch", ko->batch, "windows per forward pass")->capture_default_str();
  kv->add_flag("--bos-per-window", ko->bos_per_window,
               "each window is BOS + ctx-1 text tokens (llama2.c convention)");
  kv->add_option("--key-bits", ko->key_bits, "BFP key mantissa bits (4 = BFP12; 16 = float)")
      ->capture_default_str();
  kv->add_option("--query-bits", ko->query_bits, "BFP query mantissa bits (8 = BFP16; 16 = float)")
      ->capture_default_str();
  kv->add_option("--block", ko->block, "BFP block size along head_dim (0 = head_dim)")
      ->capture_default_str();
  kv->add_option("--key-point", ko->key_point,
                 "where keys are quantized: pre-rope (the paper's cache) or post-rope")
      ->capture_default_str();
  kv->add_flag("--k-sort", ko->k_sort, "apply K-sort (Algorithm 1) to the model first");
  kv->add_option("--k-sort-order", ko->k_sort_order,
                 "channels (Algorithm 1: argsort of W_k row norms) or pairs (RoPE pairs adjacent)")
      ->capture_default_str();
  kv->add_option("--sort-values", ko->sort_values,
                 "with --k-sort, also sort v_proj rows with o_proj columns")
      ->capture_default_str();
  kv->add_flag("--kl", ko->kl,
               "also run the float model: report its perplexity and the mean KL(float || this)");
  kv->add_option("--threads", ko->threads, "compute threads (0 = auto)")
      ->check(CLI::Range(0, kMaxThreads));
  kv->add_flag("--json", ko->json, "print one JSON object");
  kv->callback([ko, exit_code] { *exit_code = RunKvEval(*ko); });
}

}  // namespace qcal::client
