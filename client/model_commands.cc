#include "client/model_commands.h"

#include <algorithm>
#include <cstdio>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "client/progress.h"
#include "common/atomic_file.h"
#include "common/llama2c.h"
#include "common/log.h"
#include "common/text.h"
#include "report/report.h"
#include "runner/job_dir.h"
#include "runner/workspace.h"
#include "common/tokenizer.h"
#include "engine/eval/perplexity.h"
#include "export/export.h"
#include "engine/model/llama.h"
#include "common/cli.h"
#include "methods/method_factory.h"
#include "tools/model_compare.h"

namespace qcal::client {
namespace {

}  // namespace

int RunImport(const ImportOptions& o) {
  if (o.format != "llama2c") {
    return Fail(absl::InvalidArgumentError("unknown import format '" + o.format +
                                           "' (supported: llama2c)"));
  }
  auto result = ImportLlama2c(o.model_path, o.tokenizer_path, o.out_dir);
  if (!result.ok()) return Fail(result.status());
  const LlamaConfig& c = result->config;
  if (o.json) {
    nlohmann::json j = {{"out_dir", result->out_dir},
                        {"parameters", result->num_parameters},
                        {"tensors", result->num_tensors},
                        {"config", LlamaConfigToJson(c)}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("imported %s -> %s\n", o.model_path.c_str(), result->out_dir.c_str());
    std::printf("  hidden %lld, intermediate %lld, layers %lld, heads %lld/%lld kv, vocab %lld, "
                "max positions %lld, %s head\n",
                (long long)c.hidden_size, (long long)c.intermediate_size,
                (long long)c.num_hidden_layers, (long long)c.num_attention_heads,
                (long long)c.num_key_value_heads, (long long)c.vocab_size,
                (long long)c.max_position_embeddings, c.tie_word_embeddings ? "tied" : "separate");
    std::printf("  %lld parameters in %lld tensors\n", (long long)result->num_parameters,
                (long long)result->num_tensors);
  }
  return 0;
}

int RunEval(const EvalOptions& options) {
  EvalOptions o = options;
  auto model = methods::LoadModel(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  if (o.ctx <= 0) o.ctx = std::min<int64_t>(2048, (*model)->config().max_position_embeddings);
  model::SetComputeThreads(o.threads > 0 ? o.threads
                                         : model::AutoComputeThreads((*model)->config()));
  auto device = model::ResolveTorchDevice(o.device);
  if (!device.ok()) return Fail(device.status());
  // On a device when both models can move there; otherwise both stay on the CPU.
  auto place = [&](model::LlamaModel& m, const std::string& what) {
    if (device->is_cpu()) return true;
    const Status moved = m.MoveTo(*device);
    if (!moved.ok()) {
      QCAL_LOG_WARN("evaluating on the CPU: {} cannot move to {}: {}", what, device->str(),
                    moved.ToString());
    }
    return moved.ok();
  };
  if (!place(**model, o.model_dir)) *device = at::Device(at::kCPU);
  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto text = ReadTextFile(o.data_path);
  if (!text.ok()) return Fail(text.status());

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> tokens = (*tokenizer)->Encode(*text);
  const double tokenize_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  if (!o.save_tokens.empty()) {
    const size_t n = o.max_tokens >= 0 ? std::min(tokens.size(), static_cast<size_t>(o.max_tokens))
                                       : tokens.size();
    const Status saved = WriteFileAtomic(
        o.save_tokens,
        std::string_view(reinterpret_cast<const char*>(tokens.data()), n * sizeof(int32_t)));
    if (!saved.ok()) return Fail(saved);
  }

  eval::PerplexityOptions opt;
  opt.ctx = o.ctx;
  opt.bos_per_window = o.bos_per_window;
  opt.max_tokens = o.max_tokens;
  opt.batch = o.batch;
  opt.bos_id = (*tokenizer)->bos_id();
  if (!o.reference_dir.empty()) {
    auto reference = methods::LoadModel(o.reference_dir);
    if (!reference.ok()) return Fail(reference.status());
    if (!device->is_cpu() && !place(**reference, o.reference_dir)) {
      (*model)->MoveTo(at::kCPU).IgnoreError();
      *device = at::Device(at::kCPU);
    }
    ProgressBar bar("perplexity + KL", 0);
    auto c = tools::CompareToReference(
        **reference, **model, tokens, opt,
        [&bar](int64_t done, int64_t total) { bar.Update(done, total); });
    bar.Finish();
    if (!c.ok()) return Fail(c.status());
    if (o.json) {
      nlohmann::json j = {{"model", o.model_dir},     {"reference", o.reference_dir},
                          {"data", o.data_path},      {"ctx", o.ctx},
                          {"bos_per_window", o.bos_per_window},
                          {"tokens", c->tokens_scored}, {"windows", c->windows},
                          {"mean_nll", c->nll_model}, {"perplexity", c->ppl_model},
                          {"reference_perplexity", c->ppl_reference},
                          {"mean_kl", c->mean_kl},    {"seconds", c->seconds + tokenize_s},
                          {"device", device->str()}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("model       %s\n", o.model_dir.c_str());
      std::printf("reference   %s\n", o.reference_dir.c_str());
      std::printf("data        %s (%lld tokens scored in %lld windows, ctx %lld)\n",
                  o.data_path.c_str(), (long long)c->tokens_scored, (long long)c->windows,
                  (long long)o.ctx);
      std::printf("perplexity  %.4f (reference %.4f on the same tokens)\n", c->ppl_model,
                  c->ppl_reference);
      std::printf("KL          %.6f nats/token, KL(reference || model)\n", c->mean_kl);
    }
    return 0;
  }
  ProgressBar bar("perplexity", 0);
  auto result = eval::EvaluatePerplexity(
      **model, tokens, opt, [&bar](int64_t done, int64_t total) { bar.Update(done, total); });
  bar.Finish();
  if (!result.ok()) return Fail(result.status());
  const double seconds = result->seconds + tokenize_s;
  if (o.json) {
    nlohmann::json j = {{"model", o.model_dir},
                        {"data", o.data_path},
                        {"ctx", o.ctx},
                        {"bos_per_window", o.bos_per_window},
                        {"tokens", result->tokens_scored},
                        {"tokens_encoded", result->tokens_encoded},
                        {"windows", result->windows},
                        {"mean_nll", result->mean_nll},
                        {"perplexity", result->perplexity},
                        {"seconds", seconds},
                        {"tokens_per_s", result->tokens_per_s},
                        {"device", device->str()}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("model       %s\n", o.model_dir.c_str());
    std::printf("data        %s (%lld tokens, ctx %lld, %s)\n", o.data_path.c_str(),
                (long long)result->tokens_encoded, (long long)o.ctx,
                o.bos_per_window ? "BOS per window" : "non-overlapping windows");
    std::printf("tokens      %lld scored in %lld windows\n", (long long)result->tokens_scored,
                (long long)result->windows);
    std::printf("mean NLL    %.6f\n", result->mean_nll);
    std::printf("perplexity  %.4f\n", result->perplexity);
    std::printf("wall time   %.2f s (tokenize %.2f s, model %.2f s)\n", seconds, tokenize_s,
                result->seconds);
    std::printf("tokens/s    %.0f\n", result->tokens_per_s);
  }
  return 0;
}

int RunGenerate(const GenerateOptions& o) {
  auto model = methods::LoadModel(o.model_dir);
  if (!model.ok()) return Fail(model.status());
  model::SetComputeThreads(o.threads > 0 ? o.threads
                                         : model::AutoComputeThreads((*model)->config()));
  auto tokenizer = LoadTokenizerFromModelDir(o.model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  std::vector<int32_t> prompt = {(*tokenizer)->bos_id()};
  if (!o.prompt.empty()) {
    std::vector<int32_t> enc = (*tokenizer)->Encode(o.prompt);
    prompt.insert(prompt.end(), enc.begin(), enc.end());
  }
  // llama2.c models end a story with BOS; HF models with EOS. Stop on either.
  std::vector<int32_t> out =
      model::GenerateGreedy(**model, prompt, o.max_new_tokens, (*tokenizer)->bos_id());
  if (!out.empty() && out.back() == (*tokenizer)->eos_id()) out.pop_back();
  std::vector<int32_t> generated(out.begin() + prompt.size(), out.end());
  std::string text = (*tokenizer)->Decode(std::vector<int32_t>(out.begin() + 1, out.end()));
  if (!text.empty() && text[0] == ' ') text.erase(0, 1);
  if (o.json) {
    nlohmann::json j = {{"prompt_ids", prompt}, {"generated_ids", generated}, {"text", text}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s\n", text.c_str());
  }
  return 0;
}

int RunExport(const ExportCommandOptions& o) {
  exporter::ExportOptions options;
  options.format = o.format;
  options.in_dir = o.in_dir;
  options.out_dir = o.out_dir;
  auto bytes = ParseBytes(o.max_shard_size, "--max-shard-size");
  if (!bytes.ok()) return Fail(bytes.status());
  options.max_shard_bytes = *bytes;
  // A job's output directory before the job finished holds shards but no config.json yet.
  if (Status finished = CheckJobFinished(o.in_dir); !finished.ok()) return Fail(finished);
  auto result = exporter::ExportCheckpoint(options);
  if (!result.ok()) return Fail(result.status());
  if (o.json) {
    nlohmann::json j = {{"out_dir", result->out_dir},
                        {"format", o.format},
                        {"shards", result->shards},
                        {"tensors", result->tensors},
                        {"tensor_bytes", result->tensor_bytes},
                        {"quantization_config", result->quantization_config}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("exported %s -> %s (%s): %lld tensors, %.1f MB in %zu shard%s\n",
                o.in_dir.c_str(), result->out_dir.c_str(), o.format.c_str(),
                (long long)result->tensors, result->tensor_bytes / 1e6, result->shards.size(),
                result->shards.size() == 1 ? "" : "s");
    if (!result->quantization_config.is_null()) {
      std::printf("quantization_config %s\n", result->quantization_config.dump().c_str());
    }
  }
  return 0;
}

int RunReport(const ReportCommandOptions& o) {
  auto found = FindJob(o.dir);
  if (!found.ok()) return Fail(found.status());
  const JobPaths paths(found->job_dir);
  auto journaled = report::ReadJournaledJob(paths.journal);
  if (!journaled.ok()) return Fail(journaled.status());
  // The output directory named on the command line, else the journal's.
  report::ReportInputs in = job::ReportInputsOf(
      paths.dir, found->out_dir.empty() ? journaled->out_dir : found->out_dir);
  nlohmann::json evals = nlohmann::json::array();
  if (!o.eval_paths.empty()) {
    auto reference = methods::LoadModel(journaled->model_dir);
    if (!reference.ok()) return Fail(reference.status());
    auto model = methods::LoadModel(in.out_dir);
    if (!model.ok()) return Fail(model.status());
    model::SetComputeThreads(o.threads > 0 ? o.threads
                                           : model::AutoComputeThreads((*model)->config()));
    auto tokenizer = LoadTokenizerFromModelDir(in.out_dir);
    if (!tokenizer.ok()) return Fail(tokenizer.status());
    for (const std::string& path : o.eval_paths) {
      auto text = ReadTextFile(path);
      if (!text.ok()) return Fail(text.status());
      const std::vector<int32_t> tokens = (*tokenizer)->Encode(*text);
      eval::PerplexityOptions opt;
      opt.ctx = o.ctx;
      opt.bos_per_window = o.bos_per_window;
      opt.max_tokens = o.max_tokens;
      opt.bos_id = (*tokenizer)->bos_id();
      ProgressBar bar("perplexity + KL", 0);
      auto c = tools::CompareToReference(
          **reference, **model, tokens, opt,
          [&bar](int64_t done, int64_t total) { bar.Update(done, total); });
      bar.Finish();
      if (!c.ok()) return Fail(Annotate(c.status(), path));
      in.evals.push_back({path, o.ctx, c->tokens_scored, c->ppl_reference, c->ppl_model,
                           c->mean_kl});
      evals.push_back({{"data", path}, {"perplexity", c->ppl_model},
                       {"reference_perplexity", c->ppl_reference}, {"mean_kl", c->mean_kl}});
    }
  }
  const std::string path = o.out.empty() ? paths.report : o.out;
  const Status written = report::WriteReport(in, path);
  if (!written.ok()) return Fail(written);
  if (o.json) {
    std::printf("%s\n", nlohmann::json({{"report", path}, {"job_dir", paths.dir},
                                        {"out_dir", in.out_dir}, {"evals", evals}})
                            .dump()
                            .c_str());
  } else {
    std::printf("report: %s\n", path.c_str());
  }
  return 0;
}

void AddModelCommands(CLI::App& app, int* exit_code) {
  auto* imp = app.add_subcommand("import", "Convert a checkpoint into a Hugging Face model dir");
  auto io = std::make_shared<ImportOptions>();
  imp->add_option("format", io->format, "source format (llama2c)")->required();
  imp->add_option("model", io->model_path, "llama2.c model .bin")->required()->check(
      CLI::ExistingFile);
  imp->add_option("tokenizer", io->tokenizer_path, "llama2.c tokenizer .bin")
      ->required()
      ->check(CLI::ExistingFile);
  imp->add_option("--out", io->out_dir, "output model directory")
      ->transform(qcal::CanonicalFlagPath)->required();
  imp->add_flag("--json", io->json, "print one JSON object");
  imp->callback([io, exit_code] { *exit_code = RunImport(*io); });

  auto* ev = app.add_subcommand("eval", "Perplexity of a model on a text file");
  auto eo = std::make_shared<EvalOptions>();
  ev->add_option("--model", eo->model_dir, "model directory")->required()->check(
      CLI::ExistingDirectory);
  ev->add_option("--data", eo->data_path, "UTF-8 text file")->required()->check(
      CLI::ExistingFile);
  ev->add_option("--ctx", eo->ctx,
                 "window length in tokens (default: the model's context, at most 2048)");
  ev->add_option("--max-tokens", eo->max_tokens, "use at most this many text tokens");
  ev->add_option("--batch", eo->batch, "windows per forward pass")->capture_default_str();
  ev->add_flag("--bos-per-window", eo->bos_per_window,
               "each window is BOS + ctx-1 text tokens (llama2.c convention)");
  ev->add_option("--threads", eo->threads, "compute threads (0 = auto: 1 for tiny models, else all cores)")
      ->check(CLI::Range(0, kMaxThreads));
  ev->add_option("--reference", eo->reference_dir,
                 "reference (float) model: also report its perplexity on the same tokens and "
                 "the mean KL(reference || model)")
      ->check(CLI::ExistingDirectory);
  ev->add_option("--device", eo->device,
                 "where LibTorch evaluates: auto (a GPU when this build's LibTorch has CUDA, else "
                 "the CPU), cpu, cuda, cuda:N")
      ->capture_default_str();
  ev->add_option("--save-tokens", eo->save_tokens,
                 "also write the evaluated text tokens to this file (int32 little-endian; the "
                 "windows are cut from them as --ctx / --bos-per-window say)");
  ev->add_flag("--json", eo->json, "print one JSON object on the last line");
  ev->callback([eo, exit_code] { *exit_code = RunEval(*eo); });

  auto* gen = app.add_subcommand("generate", "Greedy decoding from a prompt");
  auto go = std::make_shared<GenerateOptions>();
  gen->add_option("--model", go->model_dir, "model directory")->required()->check(
      CLI::ExistingDirectory);
  gen->add_option("--prompt", go->prompt, "prompt text (default: BOS only)");
  gen->add_option("--tokens", go->max_new_tokens, "new tokens")->capture_default_str();
  gen->add_option("--threads", go->threads, "compute threads (0 = auto: 1 for tiny models, else all cores)")
      ->check(CLI::Range(0, kMaxThreads));
  gen->add_flag("--json", go->json, "print one JSON object");
  gen->callback([go, exit_code] { *exit_code = RunGenerate(*go); });

  auto* ex = app.add_subcommand(
      "export", "Write a quantized checkpoint in a format other programs load: gptq (the GPTQ "
                "layout of transformers, AutoGPTQ and vLLM), compressed-tensors (pack-quantized, "
                "as llm-compressor writes it for vLLM and transformers) or dense (dequantized "
                "float)");
  auto xo = std::make_shared<ExportCommandOptions>();
  ex->add_option("--format", xo->format, "gptq | compressed-tensors | dense")
      ->check(CLI::IsMember({"gptq", "compressed-tensors", "dense"}))
      ->capture_default_str();
  ex->add_option("in", xo->in_dir, "a finished qcal checkpoint")->required()->check(
      CLI::ExistingDirectory);
  ex->add_option("out", xo->out_dir, "the new checkpoint directory")
      ->transform(qcal::CanonicalFlagPath)->required();
  ex->add_option("--max-shard-size", xo->max_shard_size,
                 "largest shard (K, M, G = 2^10, 2^20, 2^30 bytes)")
      ->capture_default_str();
  ex->add_flag("--json", xo->json, "print one JSON object");
  ex->callback([xo, exit_code] { *exit_code = RunExport(*xo); });

  auto* rep = app.add_subcommand(
      "report", "Write a job's report: one self-contained HTML page with plots (proxy loss by "
                "linear, fine-tuning curves, block error, time per phase and block, peak memory "
                "per rank; perplexity and KL against float with --eval)");
  auto ro = std::make_shared<ReportCommandOptions>();
  rep->add_option("dir", ro->dir, "a job directory, or a job's output directory (its job "
                                  "directory is DIR.job)")
      ->required()
      ->check(CLI::ExistingDirectory);
  rep->add_option("--eval", ro->eval_paths,
                  "measure perplexity and KL(float || quantized) on this UTF-8 text (repeatable); "
                  "the float model is the one the journal names")
      ->check(CLI::ExistingFile);
  rep->add_option("--ctx", ro->ctx, "window length in tokens for --eval")->capture_default_str();
  rep->add_option("--max-tokens", ro->max_tokens, "use at most this many text tokens");
  rep->add_flag("--bos-per-window", ro->bos_per_window,
                "each window is BOS + ctx-1 text tokens (llama2.c convention)");
  rep->add_option("--threads", ro->threads, "compute threads for --eval (0 = auto)")
      ->check(CLI::Range(0, kMaxThreads));
  rep->add_option("--out", ro->out, "the page's path (default: JOB_DIR/report.html)")
      ->transform(qcal::CanonicalFlagPath);
  rep->add_flag("--json", ro->json, "print one JSON object");
  rep->callback([ro, exit_code] { *exit_code = RunReport(*ro); });
}

}  // namespace qcal::client
