#include "client/quantize_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/progress.h"
#include "common/cli.h"
#include "common/log.h"
#include "kernels/device_select.h"
#include "methods/registry.h"
#include "runner/job_inputs.h"
#include "runner/quantize_job.h"
#include "runner/task_plan.h"

namespace qcal::client {
namespace {

// The command line; RunQuantize makes the job's record (v1::JobSpec) from it.
struct QuantizeOptions {
  std::string recipe_path;
  std::string model_dir, out_dir, job_dir;
  std::string data_root = kDefaultDataRoot;
  int threads = 0;
  bool overwrite = false;
  std::string max_memory;
  std::string device = "auto";
  int experts_per_task = 0;
  bool json = false;
};

// Phases summed by name (seconds, largest host and device peaks), in first-seen order.
class PhaseSums {
 public:
  void Add(const v1::PhaseTiming& p) {
    auto [it, fresh] = sums_.try_emplace(p.name());
    if (fresh) order_.push_back(p.name());
    it->second.seconds += p.seconds();
    it->second.host = std::max(it->second.host, p.peak_host_bytes());
    it->second.device = std::max(it->second.device, p.peak_device_bytes());
  }
  // "read weights 0.01 s; quantize 1.10 s, peak 0.50 GiB (factor 0.20 s, round 0.80 s); ...":
  // a part "<parent>/<part>" goes in parentheses after its parent.
  std::string Line() const {
    std::string line;
    for (const std::string& name : order_) {
      if (name.find('/') != std::string::npos && sums_.count(Parent(name))) continue;
      const Sum& sum = sums_.at(name);
      absl::StrAppendFormat(&line, "%s%s %.2f s", line.empty() ? "" : "; ", name, sum.seconds);
      if (sum.host >= 0) absl::StrAppendFormat(&line, ", peak %.2f GiB", sum.host / 1073741824.0);
      if (sum.device >= 0) {
        absl::StrAppendFormat(&line, ", device peak %.2f GiB", sum.device / 1073741824.0);
      }
      std::string parts;
      for (const std::string& part : order_) {
        if (part.find('/') == std::string::npos || Parent(part) != name) continue;
        absl::StrAppendFormat(&parts, "%s%s %.2f s", parts.empty() ? "" : ", ",
                              part.substr(name.size() + 1), sums_.at(part).seconds);
      }
      if (!parts.empty()) absl::StrAppend(&line, " (", parts, ")");
    }
    return line;
  }

 private:
  static std::string Parent(const std::string& name) { return name.substr(0, name.find('/')); }
  struct Sum {
    double seconds = 0;
    int64_t host = -1;
    int64_t device = -1;
  };
  std::vector<std::string> order_;
  std::map<std::string, Sum> sums_;
};

int RunQuantize(const QuantizeOptions& o) {
  v1::JobSpec spec;
  spec.set_recipe_path(o.recipe_path);
  spec.set_model_dir(o.model_dir);
  spec.set_out_dir(o.out_dir);
  spec.set_job_dir(o.job_dir);
  spec.set_data_root(o.data_root);
  spec.set_workers(1);
  spec.set_threads_per_worker(o.threads);
  spec.set_device(o.device);
  spec.set_overwrite(o.overwrite);
  spec.set_experts_per_task(o.experts_per_task);
  if (!o.max_memory.empty()) {
    auto bytes = ParseBytes(o.max_memory, "--max-memory");
    if (!bytes.ok()) return Fail(bytes.status());
    spec.set_max_memory_bytes(*bytes);
  }
  auto device = kernels::SelectComputeDevice(o.device);
  if (!device.ok()) return Fail(device.status());
  QCAL_LOG_INFO("quantize: device {}", *device);
  auto recipe = LoadRecipe(o.recipe_path);
  if (!recipe.ok()) return Fail(recipe.status());
  std::unique_ptr<ProgressBar> bar;
  std::string phase;
  auto result = job::RunQuantizeJob(*recipe, spec, [&](const job::JobEvent& e) {
    if (e.phase == "block") {  // inside the running block: a note on the quantize bar
      if (bar) bar->Note(absl::StrCat(e.message, " (", e.done, "/", e.total, ")"));
      return;
    }
    if (e.phase != phase) {
      if (bar) bar->Finish();
      phase = e.phase;
      bar = std::make_unique<ProgressBar>(e.phase, e.total);
    }
    bar->Update(e.done, e.total);
  });
  if (bar) bar->Finish();
  if (!result.ok()) return Fail(result.status());
  // Phases as JSON: name, seconds, peak resident bytes (null when unknown).
  auto phases_json = [](const std::vector<v1::PhaseTiming>& phases) {
    nlohmann::json out = nlohmann::json::array();
    for (const v1::PhaseTiming& p : phases) {
      out.push_back({{"name", p.name()},
                     {"seconds", p.seconds()},
                     {"peak_host_bytes", p.peak_host_bytes() >= 0
                                             ? nlohmann::json(p.peak_host_bytes())
                                             : nlohmann::json()},
                     {"peak_device_bytes", p.peak_device_bytes() >= 0
                                               ? nlohmann::json(p.peak_device_bytes())
                                               : nlohmann::json()}});
    }
    return out;
  };
  if (o.json) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : result->blocks) {
      nlohmann::json linears = nlohmann::json::array();
      for (const auto& m : b.linears) {
        linears.push_back({{"name", m.name},
                           {"proxy_loss", std::isnan(m.proxy_loss) ? nlohmann::json() : nlohmann::json(m.proxy_loss)},
                           {"relative", std::isnan(m.relative) ? nlohmann::json() : nlohmann::json(m.relative)},
                           {"code_bits", m.code_bits},
                           {"stored_bits", m.stored_bits}});
      }
      blocks.push_back({{"layer", b.layer}, {"seconds", b.seconds}, {"resumed", b.resumed},
                        {"phases", phases_json(b.phases)}, {"linears", linears}});
    }
    nlohmann::json j = {{"recipe", recipe->name},
                        {"out_dir", result->out_dir},
                        {"code_bits_per_weight", result->code_bits},
                        {"stored_bits_per_weight", result->stored_bits},
                        {"calibration_tokens", result->calib_tokens},
                        {"calibration_seconds", result->calib_seconds},
                        {"hessians_from_cache", result->hessians_from_cache},
                        {"blocks_resumed", result->blocks_resumed},
                        {"seconds", result->seconds},
                        {"phases", phases_json(result->phases)},
                        {"calibrate_phases", phases_json(result->calibrate_phases)},
                        {"finetune_phases", phases_json(result->finetune_phases)},
                        {"peak_host_bytes", result->peak_host_bytes >= 0
                                                ? nlohmann::json(result->peak_host_bytes)
                                                : nlohmann::json()},
                        {"peak_device_bytes", result->peak_device_bytes >= 0
                                                  ? nlohmann::json(result->peak_device_bytes)
                                                  : nlohmann::json()},
                        {"blocks", blocks}};
    if (!result->expert_loads.empty()) {
      nlohmann::json loads = nlohmann::json::array();
      for (const v1::ExpertLoad& l : result->expert_loads) {
        loads.push_back({{"layer", l.layer()},
                         {"routed_tokens", std::vector<int64_t>(l.routed_tokens().begin(),
                                                                l.routed_tokens().end())},
                         {"every_token", std::vector<int64_t>(l.every_token().begin(),
                                                              l.every_token().end())}});
      }
      j["expert_loads"] = loads;
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("recipe %s -> %s\n", recipe->name.c_str(), result->out_dir.c_str());
  if (recipe->needs().float_hessians) {
    std::printf("calibration: %lld tokens, %.1f s%s\n", (long long)result->calib_tokens,
                result->calib_seconds, result->hessians_from_cache ? " (cached Hessians)" : "");
  }
  // A MoE model's routing of the calibration tokens, one line per MoE block.
  for (const v1::ExpertLoad& l : result->expert_loads) {
    std::vector<int64_t> t(l.routed_tokens().begin(), l.routed_tokens().end());
    if (t.empty()) continue;
    std::sort(t.begin(), t.end());
    std::printf("block %lld: tokens per expert %lld fewest / %lld median / %lld most of %zu "
                "experts%s\n",
                (long long)l.layer(), (long long)t.front(), (long long)t[t.size() / 2],
                (long long)t.back(), t.size(),
                l.every_token_size() > 0
                    ? absl::StrCat("; calibrated on every token: ",
                                   absl::StrJoin(l.every_token(), ", "))
                          .c_str()
                    : "");
  }
  std::printf("\n%-6s %-18s %14s %12s %8s\n", "block", "linear", "proxy loss", "relative",
              "bits");
  for (const auto& b : result->blocks) {
    // A MoE block's routed experts in one line: their bits and, with Hessians (not RTN), the
    // mean and the worst of their relative proxy losses.
    double expert_sum = 0, worst = -1, expert_bits = 0;
    int64_t expert_linears = 0;
    std::string worst_name;
    for (const auto& m : b.linears) {
      if (m.name.rfind("experts.", 0) == 0) {
        ++expert_linears;
        expert_bits += m.stored_bits;
        expert_sum += m.relative;
        if (m.relative > worst) worst = m.relative, worst_name = m.name;
        continue;
      }
      std::printf("%-6lld %-18s %14.6g %12.4g %8.3f\n", (long long)b.layer, m.name.c_str(),
                  m.proxy_loss, m.relative, m.stored_bits);
    }
    if (expert_linears > 0) {
      const std::string loss =
          worst_name.empty()
              ? std::string("no proxy loss (no Hessian)")
              : absl::StrFormat("relative %.4g mean, %.4g worst (%s)",
                                expert_sum / expert_linears, worst, worst_name);
      std::printf("%-6lld %-18s %lld expert linears, %.3f bits: %s\n", (long long)b.layer,
                  "(routed experts)", (long long)expert_linears, expert_bits / expert_linears,
                  loss.c_str());
    }
    std::printf("%-6lld %-18s %s%.2f s\n", (long long)b.layer, "(block)",
                b.resumed ? "resumed from journal, " : "", b.seconds);
  }
  std::printf("\nbits per weight: %.3f codes, %.3f stored (codes + signs + scales)\n",
              result->code_bits, result->stored_bits);
  std::printf("blocks resumed: %lld of %zu; wall time %.1f s\n", (long long)result->blocks_resumed,
              result->blocks.size(), result->seconds);
  // Where the time went: the job's phases, calibration's, then the block tasks' phases summed
  // over the blocks (parts of a phase in parentheses after it).
  auto print = [](const char* label, const std::vector<v1::PhaseTiming>& phases) {
    PhaseSums sums;
    for (const v1::PhaseTiming& p : phases) sums.Add(p);
    const std::string line = sums.Line();
    if (!line.empty()) std::printf("%s: %s\n", label, line.c_str());
  };
  print("phases", result->phases);
  print("calibrate", result->calibrate_phases);
  std::vector<v1::PhaseTiming> in_blocks;
  for (const auto& b : result->blocks) in_blocks.insert(in_blocks.end(), b.phases.begin(),
                                                        b.phases.end());
  print("block tasks", in_blocks);
  print("finetune", result->finetune_phases);
  return 0;
}

}  // namespace

void AddQuantizeCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("quantize", "Quantize a model with a recipe (in this process)");
  auto o = std::make_shared<QuantizeOptions>();
  cmd->add_option("--recipe", o->recipe_path, "recipe YAML (jobs/*.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--model", o->model_dir, "float model directory (HF layout)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--out", o->out_dir, "output checkpoint directory")
      ->transform(qcal::CanonicalFlagPath)->required();
  cmd->add_option("--job-dir", o->job_dir,
                  "journal, Hessians and other resumable state (default: OUT.job)");
  cmd->add_option("--data-root", o->data_root,
                  "where the recipe's calibration files are resolved")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "compute threads (0 = auto)")
      ->check(CLI::Range(0, kMaxThreads));
  cmd->add_option("--max-memory", o->max_memory,
                  "activations kept in memory before spilling them to the job directory: 8G, "
                  "512M, ... (default: half the machine's RAM)");
  cmd->add_option("--device", o->device,
                  "compute device: auto (a GPU when one is usable, else the CPU), cpu, cuda, "
                  "cuda:N")
      ->capture_default_str();
  cmd->add_option("--experts-per-task", o->experts_per_task, kExpertsPerTaskHelp)
      ->check(CLI::Range(-1, 1 << 20));
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a finished checkpoint in --out that this job directory did not write");
  cmd->callback([o, exit_code] { *exit_code = RunQuantize(*o); });
}

}  // namespace qcal::client
