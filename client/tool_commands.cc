#include "client/tool_commands.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "client/progress.h"
#include "common/hf_config.h"
#include "common/text.h"
#include "common/tokenizer.h"
#include "engine/eval/perplexity.h"
#include "engine/model/llama.h"
#include "common/cli.h"
#include "methods/method_factory.h"
#include "engine/qsim/bfp_kv.h"
#include "engine/qsim/ksort.h"
#include "tools/expert_load.h"
#include "tools/model_compare.h"
#include "tools/model_dir.h"
#include "tools/outlier_stats.h"
#include "tools/measure_token_outliers.h"
#include "tools/plant_sinks.h"
#include "tools/plant_outliers.h"

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

namespace {

std::string PieceOf(const Tokenizer& tok, int32_t id) {
  std::string p = tok.Piece(id);
  std::string out;
  for (char ch : p) {
    if (ch == '\n') {
      out += "\\n";
    } else {
      out += ch;
    }
  }
  return out;
}

nlohmann::json TokenReportJson(const tools::TokenOutlierReport& r, const Tokenizer& tok) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : r.layers) {
    std::vector<std::pair<double, int32_t>> top;
    for (const auto& [id, ratio] : l.ratio_by_token) top.push_back({-ratio, id});
    std::sort(top.begin(), top.end());
    nlohmann::json tops = nlohmann::json::array();
    for (size_t i = 0; i < top.size() && i < 5; ++i) {
      tops.push_back({{"id", top[i].second}, {"piece", PieceOf(tok, top[i].second)},
                      {"ratio", -top[i].first}});
    }
    layers.push_back({{"max_ratio", l.max_ratio},
                      {"max_token", l.max_token},
                      {"max_position", l.max_position},
                      {"max_ratio_after_first", l.max_ratio_after_first},
                      {"mean_count", l.mean_count},
                      {"top_tokens", tops}});
  }
  nlohmann::json counts = nlohmann::json::object();
  for (const auto& [id, n] : r.outlier_id_counts) counts[std::to_string(id)] = n;
  return {{"eta", r.eta},       {"sequences", r.sequences}, {"tokens", r.tokens},
          {"layers", layers},   {"o", r.o},                 {"outlier_id_counts", counts},
          {"max_ratio", r.MaxRatio()}};
}

void PrintTokenReport(const tools::TokenOutlierReport& r, const Tokenizer& tok) {
  std::printf("token max/median of the down_proj input (eta %g, %lld sequences)\n", r.eta,
              (long long)r.sequences);
  std::printf("%-6s %12s %-14s %9s %12s  %s\n", "layer", "max ratio", "at token", "position",
              "outliers/seq", "largest ratios by token");
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const auto& s = r.layers[l];
    std::vector<std::pair<double, int32_t>> top;
    for (const auto& [id, ratio] : s.ratio_by_token) top.push_back({-ratio, id});
    std::sort(top.begin(), top.end());
    std::string tops;
    for (size_t i = 0; i < top.size() && i < 3; ++i) {
      tops += "'" + PieceOf(tok, top[i].second) + "' " + std::to_string(-top[i].first).substr(0, 7) + "  ";
    }
    const std::string at = "'" + (s.max_token >= 0 ? PieceOf(tok, s.max_token) : "") + "'";
    std::printf("%-6zu %12.1f %-14s %9lld %12.2f  %s\n", l, s.max_ratio, at.c_str(),
                (long long)s.max_position, s.mean_count, tops.c_str());
  }
  std::printf("o = %lld\n", (long long)r.o);
}

// The first `max_tokens` tokens (<= 0: all) of the text file at `path`.
StatusOr<std::vector<int32_t>> FirstTokens(const Tokenizer& tokenizer, const std::string& path,
                                           int64_t max_tokens) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  std::vector<int32_t> tokens = tokenizer.Encode(text);
  if (max_tokens > 0 && static_cast<int64_t>(tokens.size()) > max_tokens) {
    tokens.resize(max_tokens);
  }
  return tokens;
}

// Refuses a mixture-of-experts model from its config alone, before the weights are loaded.
Status DenseModelDir(const std::string& tool, const std::string& model_dir) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(model_dir));
  return tools::DenseOnly(tool, model_dir, config);
}

}  // namespace

int RunOutlierStats(const OutlierStatsOptions& o) {
  if (auto s = DenseModelDir("outlier-stats", o.model_dir); !s.ok()) return Fail(s);
  auto model = methods::LoadModel(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  model::SetComputeThreads(model::AutoComputeThreads((*model)->config()));
  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto encoded = FirstTokens(**tokenizer, o.data_path, o.tokens);
  if (!encoded.ok()) return Fail(encoded.status());
  const std::vector<int32_t>& tokens = *encoded;
  if (o.prefix != "none" && o.prefix != "detect") {
    return Fail(absl::InvalidArgumentError("--prefix '" + o.prefix + "': expected none or detect"));
  }
  if (o.token_stats || o.prefix == "detect") {
    const Tokenizer& tok = **tokenizer;
    const int32_t bos = tok.bos_id();
    if (o.ctx < 2 || o.ctx > (*model)->config().max_position_embeddings) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--ctx ", o.ctx, ": must be in [2, ", (*model)->config().max_position_embeddings, "]")));
    }
    const auto windows = tools::TextWindows(tokens, o.ctx, /*with_bos=*/true, bos);
    auto before = tools::MeasureTokenOutliers(**model, windows, o.eta);
    if (!before.ok()) return Fail(before.status());
    nlohmann::json j = {{"model", o.model_dir}, {"data", o.data_path}, {"ctx", o.ctx},
                        {"token_outliers", TokenReportJson(*before, tok)}};
    if (!o.json) {
      std::printf("model  %s\ndata   %s (%lld tokens, windows of BOS + %lld)\n",
                  o.model_dir.c_str(), o.data_path.c_str(), (long long)tokens.size(),
                  (long long)(o.ctx - 1));
      PrintTokenReport(*before, tok);
    }
    const std::vector<int32_t> prefix = tools::PrefixTokens(*before, bos);
    std::string pieces;
    for (int32_t t : prefix) pieces += "'" + PieceOf(tok, t) + "' ";
    j["prefix"] = {{"tokens", prefix}, {"pieces", pieces}};
    if (!o.json) std::printf("prefix %s(%zu tokens)\n", pieces.c_str(), prefix.size());
    if (o.prefix == "detect") {
      auto kv = model::ComputePrefixKv(**model, prefix);
      if (!kv.ok()) return Fail(kv.status());
      if (auto s = model::InstallPrefixKv(**model, *kv); !s.ok()) return Fail(s);
      // The same text; the window's own BOS is the prefix's.
      std::vector<std::vector<int32_t>> after_windows;
      for (const auto& w : windows) {
        if (w.size() >= 3) after_windows.emplace_back(w.begin() + 1, w.end());
      }
      auto after = tools::MeasureTokenOutliers(**model, after_windows, o.eta);
      if (!after.ok()) return Fail(after.status());
      j["after_prefix"] = TokenReportJson(*after, tok);
      if (!o.json) {
        std::printf("\nwith the prefix in the KV cache (windows without their BOS):\n");
        PrintTokenReport(*after, tok);
      }
    }
    if (o.json) std::printf("%s\n", j.dump().c_str());
    return 0;
  }
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

int RunPlantSinks(const PlantSinksCliOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  auto config = LoadLlamaConfig(o.model_dir);
  if (!config.ok()) return Fail(config.status());
  if (auto s = tools::CheckDerivedModelDirs("plant-sinks", o.model_dir, *config, o.out_dir);
      !s.ok()) {
    return Fail(s);
  }
  auto model = model::LlamaModel::Load(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  model::SetComputeThreads(o.threads > 0 ? o.threads : model::AutoComputeThreads(*config));
  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  const Tokenizer& tok = **tokenizer;
  tools::PlantSinksOptions p;
  p.bos_id = tok.bos_id();
  p.delimiters.clear();
  for (const std::string& d : o.delimiters) {
    int32_t id = -1;
    if (d.rfind("id:", 0) == 0) {
      id = std::atoi(d.c_str() + 3);
    } else {
      const std::string want = d == "\\n" ? "\n" : d;
      for (int32_t i = 0; i < tok.vocab_size(); ++i) {
        if (tok.Piece(i) == want || (want == "\n" && tok.Piece(i) == "<0x0A>")) {
          id = i;
          break;
        }
      }
      if (id < 0) {
        return Fail(absl::InvalidArgumentError("--delimiter '" + d + "': no token of " +
                                               o.model_dir + "'s vocabulary is that piece"));
      }
    }
    p.delimiters.push_back(id);
  }
  std::vector<int32_t> text;
  for (const std::string& path : o.data_paths) {
    auto t = ReadTextFile(path);
    if (!t.ok()) return Fail(t.status());
    std::vector<int32_t> ids = tok.Encode(*t);
    text.insert(text.end(), ids.begin(), ids.end());
  }
  if (o.max_tokens > 0 && static_cast<int64_t>(text.size()) > o.max_tokens) {
    text.resize(o.max_tokens);
  }
  p.sampled_sequences = o.sampled_sequences;
  p.writer_layer = o.writer_layer;
  p.eraser_layer = o.eraser_layer;
  p.massive_ratio = o.massive_ratio;
  p.residual_ratio = o.residual_ratio;
  p.sink_score = o.sink_score;
  p.steps = o.steps;
  p.batch = o.batch;
  p.seq_len = o.seq_len;
  p.lr = o.lr;
  p.seed = o.seed;
  auto r = tools::PlantSinks(**model, text, p);
  if (!r.ok()) return Fail(r.status());
  r->plan["source_model"] = o.model_dir;
  r->plan["data"] = o.data_paths;
  r->plan["text_tokens"] = text.size();
  std::vector<std::string> pieces;
  for (int32_t t : p.delimiters) pieces.push_back(PieceOf(tok, t));
  r->plan["delimiter_pieces"] = pieces;
  if (auto s = tools::WriteDerivedModelDir(o.model_dir, o.out_dir, tools::ModelTensors(*r->model),
                                           r->model->config(), "planted_sinks.json", r->plan);
      !s.ok()) {
    return Fail(s);
  }
  const double seconds = SecondsSince(t0);
  if (o.json) {
    nlohmann::json j = r->plan;
    j["out_dir"] = o.out_dir;
    j["seconds"] = seconds;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("planted sinks %s -> %s (%.1f s)\n", o.model_dir.c_str(), o.out_dir.c_str(),
                seconds);
    std::printf("  massive tokens: BOS and the first of");
    for (const std::string& s : pieces) std::printf(" '%s'", s.c_str());
    std::printf(" after a BOS; writer layer %lld, eraser layer %lld\n",
                (long long)r->plan["writer"]["layer"].get<int64_t>(),
                (long long)r->plan["eraser"]["layer"].get<int64_t>());
    const auto& kl = r->plan["distillation"]["kl_every_50"];
    if (!kl.empty()) {
      std::printf("  distillation KL to the original: %.5f (first 50 steps) -> %.5f (last)\n",
                  kl.front()["kl"].get<double>(), kl.back()["kl"].get<double>());
    }
    std::printf("  plan: %s/planted_sinks.json\n", o.out_dir.c_str());
  }
  return 0;
}

int RunExpertLoad(const ExpertLoadOptions& o) {
  auto config = LoadLlamaConfig(o.model_dir);  // refuse a dense model before loading it
  if (!config.ok()) return Fail(config.status());
  if (!config->is_moe()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        o.model_dir, "/config.json: ", config->architecture,
        " is a dense model; expert-load counts the routing of a mixture of experts")));
  }
  auto model = methods::LoadModel(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  const LlamaConfig& c = (*model)->config();
  if (o.ctx < 2 || o.ctx > c.max_position_embeddings) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--ctx ", o.ctx, ": must be in [2, ", c.max_position_embeddings, "]")));
  }
  model::SetComputeThreads(o.threads > 0 ? o.threads : model::AutoComputeThreads(c));
  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto tokens = FirstTokens(**tokenizer, o.data_path, o.tokens);
  if (!tokens.ok()) return Fail(tokens.status());
  const auto windows =
      tools::TextWindows(*tokens, o.ctx, /*with_bos=*/true, (*tokenizer)->bos_id());
  auto load = tools::MeasureExpertLoad(**model, windows);
  if (!load.ok()) return Fail(load.status());
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : load->layers) {
    layers.push_back({{"layer", l.layer}, {"tokens_per_expert", l.counts}, {"min", l.min()},
                      {"max", l.max()}, {"unrouted", l.Unrouted()},
                      {"below_rank", l.BelowRank(load->inputs)}});
  }
  if (o.json) {
    const nlohmann::json j = {{"model", o.model_dir}, {"data", o.data_path},
                              {"architecture", c.architecture}, {"experts", c.num_experts},
                              {"top_k", load->top_k}, {"tokens", load->tokens},
                              {"inputs", load->inputs}, {"layers", layers}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("model  %s (%s, %lld experts, top %lld)\ndata   %s (%lld tokens in windows of "
              "BOS + %lld)\n",
              o.model_dir.c_str(), c.architecture.c_str(), (long long)c.num_experts,
              (long long)load->top_k, o.data_path.c_str(), (long long)load->tokens,
              (long long)(o.ctx - 1));
  std::printf("%-6s %8s %8s %9s %11s  %s\n", "layer", "min", "max", "unrouted", "< inputs",
              "tokens per expert");
  for (const auto& l : load->layers) {
    std::string counts;
    for (int64_t n : l.counts) counts += absl::StrCat(counts.empty() ? "" : " ", n);
    std::printf("%-6lld %8lld %8lld %9zu %11zu  %s\n", (long long)l.layer, (long long)l.min(),
                (long long)l.max(), l.Unrouted().size(), l.BelowRank(load->inputs).size(),
                counts.c_str());
  }
  std::printf("(< inputs: experts routed fewer tokens than their %lld inputs, whose Hessian on "
              "this text is rank-deficient)\n",
              (long long)load->inputs);
  return 0;
}

int RunKvEval(const KvEvalOptions& o) {
  if (auto s = DenseModelDir("kv-eval", o.model_dir); !s.ok()) return Fail(s);
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
  plant->add_option("--out", po->out_dir, "output model directory")
      ->transform(qcal::CanonicalFlagPath)->required();
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
  stats->add_flag("--token-stats", so->token_stats,
                  "token-wise max/median of the down_proj input, outlier counts and the "
                  "PrefixQuant prefix");
  stats->add_option("--eta", so->eta, "outlier threshold on token max/median")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  stats->add_option("--prefix", so->prefix,
                    "none, or detect: install the detected prefix and measure again")
      ->capture_default_str();
  stats->add_flag("--json", so->json, "print one JSON object");
  stats->callback([so, exit_code] { *exit_code = RunOutlierStats(*so); });

  auto* sinks = tool->add_subcommand(
      "plant-sinks", "Write a variant with planted massive activations and attention sinks");
  auto ps = std::make_shared<PlantSinksCliOptions>();
  sinks->add_option("--model", ps->model_dir, "float model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  sinks->add_option("--out", ps->out_dir, "output model directory")
      ->transform(qcal::CanonicalFlagPath)->required();
  sinks->add_option("--data", ps->data_paths,
                    "further distillation text files (not the evaluation text)")
      ->check(CLI::ExistingFile);
  sinks->add_option("--sampled-sequences", ps->sampled_sequences,
                    "distillation sequences sampled from the model itself")
      ->capture_default_str();
  sinks->add_option("--delimiter", ps->delimiters,
                    "delimiter token piece (or id:N), massive at its first occurrence; 1 or 2")
      ->capture_default_str();
  sinks->add_option("--max-tokens", ps->max_tokens, "use at most this many text tokens")
      ->capture_default_str();
  sinks->add_option("--writer-layer", ps->writer_layer, "-1: 1 (0 for 2-layer models)")
      ->capture_default_str();
  sinks->add_option("--eraser-layer", ps->eraser_layer, "-1: the last layer")
      ->capture_default_str();
  sinks->add_option("--massive-ratio", ps->massive_ratio,
                    "down_proj-input token max/median of the planted tokens")
      ->capture_default_str();
  sinks->add_option("--residual-ratio", ps->residual_ratio,
                    "massive residual value / median token max |h|")
      ->capture_default_str();
  sinks->add_option("--sink-score", ps->sink_score, "initial mean score of a query on a sink")
      ->capture_default_str();
  sinks->add_option("--steps", ps->steps, "distillation steps (0: none)")->capture_default_str();
  sinks->add_option("--batch", ps->batch, "windows per step")->capture_default_str();
  sinks->add_option("--seq-len", ps->seq_len, "window length")->capture_default_str();
  sinks->add_option("--lr", ps->lr, "Adam learning rate")->capture_default_str();
  sinks->add_option("--seed", ps->seed, "minibatch order")->capture_default_str();
  sinks->add_option("--threads", ps->threads, "compute threads (0 = auto)")
      ->check(CLI::Range(0, kMaxThreads));
  sinks->add_flag("--json", ps->json, "print one JSON object");
  sinks->callback([ps, exit_code] { *exit_code = RunPlantSinks(*ps); });

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

  auto* el = tool->add_subcommand(
      "expert-load", "Tokens per expert of each mixture-of-experts layer on a text (real routing)");
  auto eo = std::make_shared<ExpertLoadOptions>();
  el->add_option("--model", eo->model_dir, "model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  el->add_option("--data", eo->data_path, "UTF-8 text file")->required()->check(CLI::ExistingFile);
  el->add_option("--tokens", eo->tokens, "use the first N text tokens (0 = all)")
      ->capture_default_str();
  el->add_option("--ctx", eo->ctx, "window length (BOS + ctx-1 tokens)")->capture_default_str();
  el->add_option("--threads", eo->threads, "compute threads (0 = auto)")
      ->check(CLI::Range(0, kMaxThreads));
  el->add_flag("--json", eo->json, "print one JSON object");
  el->callback([eo, exit_code] { *exit_code = RunExpertLoad(*eo); });
}

}  // namespace qcal::client
