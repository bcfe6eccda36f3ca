#include "client/slurm_command.h"

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <filesystem>
#include <regex>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "client/slurm_templates.h"
#include "common/atomic_file.h"
#include "common/cli.h"
#include "runner/task_plan.h"

namespace qcal::client {
namespace fs = std::filesystem;
namespace {

// A word for bash: unchanged when it is plainly safe, else single-quoted.
std::string ShellWord(const std::string& s) {
  static const std::regex safe("^[A-Za-z0-9_@%+=:,./-]+$");
  if (!s.empty() && std::regex_match(s, safe)) return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Absolute and canonical (links resolved once, here: common/safe_fs.h).
std::string AbsolutePath(const std::string& p) { return CanonicalFlagPath(p); }

std::string ThisExecutable() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "qcal";
}

// Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
bool ValidSlurmTime(const std::string& t) {
  static const std::regex re(R"(^(\d+-)?\d+(:\d+){0,2}$)");
  return std::regex_match(t, re);
}

}  // namespace

StatusOr<std::string> FillSlurmTemplate(const std::string& templ,
                                        const std::map<std::string, std::string>& fields) {
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t at = templ.find('@', pos);
    if (at == std::string::npos) break;
    const size_t end = templ.find('@', at + 1);
    if (end == std::string::npos) break;
    const std::string name = templ.substr(at + 1, end - at - 1);
    const bool is_field = !name.empty() && std::regex_match(name, std::regex("^[A-Z_]+$"));
    if (!is_field) {  // a literal '@' (as in USR1@600)
      out += templ.substr(pos, at + 1 - pos);
      pos = at + 1;
      continue;
    }
    auto it = fields.find(name);
    if (it == fields.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the sbatch template names @", name,
                                                     "@, which qcal slurm-script does not fill"));
    }
    out += templ.substr(pos, at - pos);
    out += it->second;
    pos = end + 1;
  }
  out += templ.substr(pos);
  return out;
}

StatusOr<std::string> MakeSlurmScript(const SlurmScriptOptions& o) {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (o.recipe.empty() || o.model_dir.empty() || o.out_dir.empty()) {
    return bad("--recipe, --model and --out are required");
  }
  if (o.nodes < 1) return bad(absl::StrCat("--nodes must be at least 1, not ", o.nodes));
  if (o.tasks_per_node < 1) {
    return bad(absl::StrCat("--ranks-per-node must be at least 1, not ", o.tasks_per_node));
  }
  if (o.cpus_per_task < 1) {
    return bad(absl::StrCat("--cpus-per-rank must be at least 1, not ", o.cpus_per_task));
  }
  if (!ValidSlurmTime(o.time)) {
    return bad(absl::StrCat("--time '", o.time,
                            "' is not a Slurm time (MM, HH:MM:SS, D-HH:MM:SS, ...)"));
  }
  if (o.signal_lead_s < 60 || o.signal_lead_s > 65535) {
    return bad(absl::StrCat("--signal-lead ", o.signal_lead_s,
                            " s: Slurm delivers the signal with ±60 s resolution; use 60..65535"));
  }
  for (const auto* s : {&o.partition, &o.account, &o.qos, &o.job_name}) {
    if (s->find_first_of(" \t\n'\"\\$`") != std::string::npos) {
      return bad(absl::StrCat("'", *s, "': spaces, quotes and shell characters are not allowed "
                              "in Slurm names"));
    }
  }
  const std::string out = AbsolutePath(o.out_dir);
  std::string extra;
  if (!o.partition.empty()) absl::StrAppend(&extra, "#SBATCH --partition=", o.partition, "\n");
  if (!o.account.empty()) absl::StrAppend(&extra, "#SBATCH --account=", o.account, "\n");
  if (!o.qos.empty()) absl::StrAppend(&extra, "#SBATCH --qos=", o.qos, "\n");
  if (!extra.empty()) extra.pop_back();
  std::string run_args = o.eval ? "" : "--no-eval";
  if (!o.data_root.empty()) {
    absl::StrAppend(&run_args, run_args.empty() ? "" : " ", "--data-root ",
                    ShellWord(AbsolutePath(o.data_root)));
  }
  if (o.calib_batch > 0) absl::StrAppend(&run_args, " --calib-batch ", o.calib_batch);
  if (o.experts_per_task != 0) {
    absl::StrAppend(&run_args, " --experts-per-task ", o.experts_per_task);
  }
  const std::string name =
      o.job_name.empty() ? absl::StrCat("qcal-", fs::path(out).filename().string()) : o.job_name;
  std::map<std::string, std::string> fields = {
      {"JOB_NAME", ShellWord(name)},
      {"NODES", std::to_string(o.nodes)},
      {"TASKS_PER_NODE", std::to_string(o.tasks_per_node)},
      {"CPUS_PER_TASK", std::to_string(o.cpus_per_task)},
      {"TIME", o.time},
      {"SIGNAL_LEAD", std::to_string(o.signal_lead_s)},
      {"LOG", out + ".slurm-%j.log"},
      {"EXTRA_SBATCH", extra},
      {"QCAL", ShellWord(o.qcal_binary.empty() ? ThisExecutable() : AbsolutePath(o.qcal_binary))},
      {"STATE", ShellWord(o.state_dir.empty() ? out + ".service" : AbsolutePath(o.state_dir))},
      {"RECIPE", ShellWord(AbsolutePath(o.recipe))},
      {"MODEL", ShellWord(AbsolutePath(o.model_dir))},
      {"OUT", ShellWord(out)},
      {"RUN_ARGS", run_args},
  };
  if (out.find_first_of(" \t\n") != std::string::npos) {
    return bad(absl::StrCat("--out '", out, "': #SBATCH --output cannot hold whitespace"));
  }
  return FillSlurmTemplate(o.cpu ? kSlurmCpuTemplate : kSlurmGpuTemplate, fields);
}

void AddSlurmCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "slurm-script",
      "Write an sbatch script that quantizes on a Slurm cluster (coordinator on the batch host, "
      "workers as one srun step, requeue before the time limit, automatic resume)");
  auto o = std::make_shared<SlurmScriptOptions>();
  auto path = std::make_shared<std::string>();
  cmd->add_option("--recipe", o->recipe, "recipe YAML")->required()->check(CLI::ExistingFile);
  cmd->add_option("--model", o->model_dir, "float model directory (shared filesystem)")
      ->required();
  cmd->add_option("--out", o->out_dir, "output checkpoint directory (shared filesystem)")
      ->required();
  cmd->add_option("--state", o->state_dir,
                  "coordinator state (default OUT.service, beside the job directory)");
  cmd->add_option("--data-root", o->data_root, "where the recipe's calibration files resolve");
  cmd->add_flag("--cpu", o->cpu, "CPU nodes: no --gpus-per-task");
  cmd->add_option("--nodes", o->nodes, "nodes")->capture_default_str();
  cmd->add_option("--ranks-per-node", o->tasks_per_node, "worker ranks per node (one per GPU)")
      ->capture_default_str();
  cmd->add_option("--cpus-per-rank", o->cpus_per_task, "CPU threads per rank")
      ->capture_default_str();
  cmd->add_option("--time", o->time, "time limit")->capture_default_str();
  cmd->add_option("--partition", o->partition, "partition");
  cmd->add_option("--account", o->account, "account");
  cmd->add_option("--qos", o->qos, "quality of service");
  cmd->add_option("--job-name", o->job_name, "Slurm job name (default qcal-<out name>)");
  cmd->add_option("--signal-lead", o->signal_lead_s,
                  "seconds before the time limit at which the job stops and requeues itself")
      ->capture_default_str();
  cmd->add_option("--qcal", o->qcal_binary, "qcal executable the script runs (default: this one)");
  cmd->add_option("--calib-batch", o->calib_batch, "sequences per calibration forward");
  cmd->add_option("--experts-per-task", o->experts_per_task, kExpertsPerTaskHelp)
      ->check(CLI::Range(-1, 1 << 20));
  cmd->add_flag("--eval", o->eval, "add the evaluation phase (perplexities by the workers)");
  cmd->add_option("-o,--output", *path, "write the script here (default: stdout)")
      ->transform(qcal::CanonicalFlagPath);
  cmd->callback([o, path, exit_code] {
    StatusOr<std::string> script = MakeSlurmScript(*o);
    if (!script.ok()) {
      *exit_code = Fail(script.status());
      return;
    }
    if (path->empty()) {
      std::fwrite(script->data(), 1, script->size(), stdout);
      *exit_code = 0;
      return;
    }
    if (Status s = WriteFileAtomic(*path, *script); !s.ok()) {
      *exit_code = Fail(s);
      return;
    }
    std::error_code ec;
    fs::permissions(*path, fs::perms::owner_exec | fs::perms::group_exec | fs::perms::others_exec,
                    fs::perm_options::add, ec);
    std::printf("wrote %s: submit it with `sbatch %s`\n", path->c_str(), path->c_str());
    *exit_code = 0;
  });
}

}  // namespace qcal::client
