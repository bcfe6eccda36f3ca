#include "runner/job_plan.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checkpoint_layout.h"
#include "common/log.h"
#include "common/safe_fs.h"
#include "runner/job_dir.h"

namespace qcal {
namespace {

std::string RealPath(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// Fills the journal-derived fields of *plan (config, num_blocks and job_dir already set). The
// last block_done per layer counts; the last e2e_done counts only if no block_done follows it
// (a redone block invalidates the end-to-end stage).
Status EvaluateJournal(const Recipe& recipe, const std::string& out_dir,
                       const std::vector<nlohmann::json>& entries, const std::string& journal_path,
                       JobPlan* plan, bool report = true) {
  const int64_t blocks = plan->num_blocks;
  std::map<int64_t, nlohmann::json> done;
  // Expert groups of split MoE blocks: layer -> (begin, end) -> the last block_part_done.
  std::map<int64_t, std::map<std::pair<int64_t, int64_t>, nlohmann::json>> parts;
  nlohmann::json e2e_done;
  // Finished work counts only under a job_start of the same inputs (model, data, recipe, format):
  // a job directory reused for another model must not hand its blocks to this one.
  bool same_inputs = false, same_out = true;
  nlohmann::json other_inputs;
  int64_t stale = 0, elsewhere = 0;
  std::set<int64_t> other_out;  // layers whose last block_done was written into another output
  const std::string out_real = RealPath(out_dir);
  for (const auto& e : entries) {
    const std::string event = e.value("event", "");
    if (event == "job_start" && e.value("recipe_hash", "") != plan->recipe_hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          journal_path, " belongs to another recipe ('", e.value("recipe", std::string("?")),
          "'); give this recipe another --out, or replace that recipe's output with a fresh "
          "--job-dir and --overwrite"));
    }
    if (event == "job_start") {
      same_inputs = e.value("inputs_key", "") == plan->inputs.key;
      if (!same_inputs) other_inputs = e.contains("inputs") ? e["inputs"] : nlohmann::json();
      // Older journals name no output directory: their blocks are checked against this one.
      same_out = !e.contains("out") || e.value("out", "") == out_real;
      continue;
    }
    if ((event == "block_done" || event == "e2e_done" || event == "block_part_done") &&
        !same_inputs) {
      stale += event == "block_done" ? 1 : 0;
      continue;
    }
    if (event == "block_part_done" && same_out) {
      const v1::BlockResult r = BlockResultFromEntry(e);
      parts[r.layer()][{r.part().expert_begin(), r.part().expert_end()}] = e;
    }
    if (event == "block_done") {
      // A block another run wrote into another output still counts when this output holds the
      // same bytes (a moved output directory), but its absence here is no news.
      const int64_t layer = e.value("layer", int64_t{-1});
      if (same_out) {
        other_out.erase(layer);
      } else {
        other_out.insert(layer);
      }
      done[layer] = e;
      e2e_done = nlohmann::json();
    }
    if (event == "e2e_done") e2e_done = e;
  }
  plan->stale_blocks = stale;
  if (stale > 0 && report) {
    std::string note = absl::StrCat(
        journal_path, ": ", stale, " finished block(s) were computed from other inputs (",
        DescribeInputsChange(other_inputs, plan->inputs),
        "); they are redone, and calibration products of those inputs are recomputed");
    QCAL_LOG_WARN("{}", note);
    plan->notes.push_back(std::move(note));
  }
  plan->e2e_enabled = recipe.finetune.end_to_end.enabled;
  plan->e2e_finished = false;
  plan->e2e_done = nlohmann::json();
  plan->block_finished.assign(blocks, false);
  plan->block_done.clear();
  plan->parts_done.clear();
  if (plan->e2e_enabled && e2e_done.is_object()) {
    // Every shard was rewritten by the end-to-end stage; its checksums are the ones to match.
    bool ok = e2e_done.contains("checksums") && e2e_done["checksums"].is_object() &&
              e2e_done["checksums"].size() == static_cast<size_t>(blocks + 1);
    for (int64_t shard = 0; shard <= blocks && ok; ++shard) {
      const std::string name = ShardName(shard, blocks);
      auto sum = FileChecksum(out_dir + "/" + name);
      ok = sum.ok() && e2e_done["checksums"].value(name, "") == *sum;
    }
    for (int64_t l = 0; l < blocks && ok; ++l) ok = done.count(l) > 0;
    if (ok) {
      plan->e2e_finished = true;
      plan->e2e_done = e2e_done;
      plan->block_finished.assign(blocks, true);
      for (int64_t l = 0; l < blocks; ++l) plan->block_done[l] = done[l];
      return absl::OkStatus();
    }
    QCAL_LOG_WARN("journal says end-to-end fine-tuning is done but a shard is missing or "
                  "changed; redoing every block and the end-to-end stage");
    return absl::OkStatus();
  }
  for (const auto& [layer, e] : done) {
    if (layer < 0 || layer >= blocks) continue;
    plan->block_finished[layer] = CheckBlockDoneEntry(e, out_dir, blocks).ok();
    if (plan->block_finished[layer]) {
      plan->block_done[layer] = e;
    } else if (other_out.count(layer)) {
      ++elsewhere;
    } else {
      QCAL_LOG_WARN("block {}: journal says done but its shard is missing or changed; redoing",
                    layer);
    }
  }
  // An unfinished block's expert groups whose part files are intact are not redone.
  for (const auto& [layer, by_range] : parts) {
    if (layer < 0 || layer >= blocks || plan->block_finished[layer]) continue;
    for (const auto& [range, e] : by_range) {
      if (CheckBlockPartDoneEntry(e, out_dir, blocks).ok()) {
        plan->parts_done[layer].push_back(e);
      } else {
        QCAL_LOG_WARN("block {} experts [{}, {}): journal says done but its part file is "
                      "missing or changed; redoing", layer, range.first, range.second);
      }
    }
  }
  if (elsewhere > 0 && report) {
    QCAL_LOG_INFO("{}: {} block(s) were journaled by a run into another output directory and "
                  "are not in {}; they are done here too", journal_path, elsewhere, out_dir);
  }
  if (recipe.needs().sequential) {
    // Block l was calibrated on the outputs of blocks < l as quantized: a block redone
    // invalidates every later one.
    for (int64_t l = 0; l < blocks; ++l) {
      if (plan->block_finished[l]) continue;
      for (int64_t later = l + 1; later < blocks; ++later) {
        if (!plan->block_finished[later]) continue;
        QCAL_LOG_WARN("block {}: redone because block {} is (sequential calibration)", later, l);
        plan->block_finished[later] = false;
        plan->block_done.erase(later);
      }
      break;
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Plan

bool JobPlan::all_blocks_finished() const {
  for (bool f : block_finished) {
    if (!f) return false;
  }
  return true;
}

std::vector<int64_t> JobPlan::pending_blocks() const {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < static_cast<int64_t>(block_finished.size()); ++l) {
    if (!block_finished[l]) out.push_back(l);
  }
  return out;
}

bool JobPlan::has_calibrate_task(const Recipe& recipe) const {
  return (recipe.needs().calibrates_float_model() && !all_blocks_finished()) ||
         (e2e_enabled && !e2e_finished);
}

namespace {

std::string Size(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

// Bytes free to this process on the filesystem holding `dir`; -1 when unknown.
int64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) != 0) return -1;
  return static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
}

}  // namespace

DiskNeed EstimateDiskNeed(const Recipe& recipe, const LlamaConfig& c) {
  const MethodNeeds needs = recipe.needs();
  const int64_t blocks = c.num_hidden_layers, h = c.hidden_size, ff = c.intermediate_size;
  const int64_t tokens = recipe.calibration.num_sequences *
                         std::min(recipe.calibration.seq_len, c.max_position_embeddings);
  DiskNeed d;
  std::vector<std::string> parts;
  if (needs.float_hessians) {
    // Per input: the exact int128 sums, 16 bytes per entry of the triangle (hessian_format 3).
    int64_t per_block = 0;
    for (int64_t n : {h, c.q_dim(), h, ff}) per_block += 8 * n * (n + 1);
    d.job_bytes += per_block * blocks;
    parts.push_back(absl::StrCat("Hessians ", Size(static_cast<double>(per_block)), " a block"));
  }
  const int64_t boundary = 4 * tokens * h;
  if (needs.float_activations) {
    d.job_bytes += boundary * (blocks + 1);
    parts.push_back(absl::StrCat("activations ", Size(static_cast<double>(boundary)),
                                 " a block boundary"));
  }
  if (needs.sequential) {
    d.job_bytes += boundary * 2 * (needs.sequential_float ? 2 : 1);
    parts.push_back(absl::StrCat("sequential inputs ", Size(static_cast<double>(boundary)),
                                 " a block"));
  }
  d.job_detail = parts.empty() ? "no calibration products" : absl::StrJoin(parts, ", ");
  const int64_t linear = h * c.q_dim() + 2 * h * c.kv_dim() + c.q_dim() * h + 3 * h * ff;
  const int64_t table = c.torch_dtype == "float32" ? 4 : 2;
  // Codes at the recipe's bits plus about a quarter bit of scales and norms; tables as stored.
  d.out_bytes = linear * blocks * (std::max(recipe.bits(), 1) * 4 + 1) / 32 +
                c.vocab_size * h * table * (c.tie_word_embeddings ? 1 : 2);
  return d;
}

StatusOr<JobPlan> PlanJob(const Recipe& recipe, const std::string& model_dir,
                          const std::string& out_dir, const std::string& job_dir,
                          const std::string& data_root) {
  JobPlan plan;
  QCAL_ASSIGN_OR_RETURN(plan.config, LoadLlamaConfig(model_dir));
  const std::string model_real = RealPath(model_dir);
  QCAL_RETURN_IF_ERROR(MakeDirs(out_dir));
  const std::string out_real = RealPath(out_dir);
  if (out_real == model_real || out_real.rfind(model_real + "/", 0) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("output directory ", out_dir,
                                                   " is inside the input model directory ",
                                                   model_dir));
  }
  plan.job_dir = JobDirFor(job_dir, out_dir);
  QCAL_RETURN_IF_ERROR(MakeDirs(plan.job_dir));
  QCAL_RETURN_IF_ERROR(MakeDirs(StagingDir(out_dir)));
  plan.num_blocks = plan.config.num_hidden_layers;
  plan.recipe_hash = RecipeHash(recipe);
  const JobPaths paths(plan.job_dir);
  QCAL_ASSIGN_OR_RETURN(plan.inputs,
                        FingerprintInputs(recipe, model_dir, data_root, paths.inputs));
  const std::string& journal_path = paths.journal;
  QCAL_ASSIGN_OR_RETURN(Journal journal, Journal::Open(journal_path));
  QCAL_RETURN_IF_ERROR(EvaluateJournal(recipe, out_dir, journal.entries(), journal_path, &plan));
  // A 70B job's Hessians alone are over a terabyte: say so before the disk fills mid-job.
  plan.disk = EstimateDiskNeed(recipe, plan.config);
  QCAL_LOG_INFO("disk: about {} to {} ({}), {} to {} (the quantized checkpoint)",
                Size(static_cast<double>(plan.disk.job_bytes)), plan.job_dir,
                plan.disk.job_detail, Size(static_cast<double>(plan.disk.out_bytes)), out_dir);
  std::vector<std::tuple<std::string, int64_t, std::string>> checks = {
      {plan.job_dir, plan.disk.job_bytes, plan.disk.job_detail},
      {out_dir, plan.disk.out_bytes, "the quantized checkpoint"}};
  struct stat job_st, out_st;
  if (::stat(plan.job_dir.c_str(), &job_st) == 0 && ::stat(out_dir.c_str(), &out_st) == 0 &&
      job_st.st_dev == out_st.st_dev) {
    checks = {{plan.job_dir, plan.disk.job_bytes + plan.disk.out_bytes,
               plan.disk.job_detail + ", and the quantized checkpoint in " + out_dir}};
  }
  for (const auto& [dir, need, what] : checks) {
    const int64_t free = FreeBytes(dir);
    if (free < 0 || need <= free) continue;
    std::string note = absl::StrCat(
        dir, ": this job writes about ", Size(static_cast<double>(need)), " here (", what,
        ") but ", Size(static_cast<double>(free)), " are free on its filesystem; it will stop "
        "when the disk is full (finished work is kept, and a rerun after freeing space resumes)");
    QCAL_LOG_WARN("{}", note);
    plan.notes.push_back(std::move(note));
  }
  return plan;
}

nlohmann::json JobStartEntry(const Recipe& recipe, const JobPlan& plan,
                             const std::string& model_dir, const std::string& out_dir) {
  return {{"event", "job_start"},
          {"recipe", recipe.name},
          {"recipe_hash", plan.recipe_hash},
          {"model", RealPath(model_dir)},
          {"out", RealPath(out_dir)},
          {"inputs_key", plan.inputs.key},
          {"inputs", plan.inputs.FilesJson()}};
}


BitsPerWeight AggregateBits(const LlamaConfig& config,
                            const std::map<int64_t, nlohmann::json>& block_done) {
  double code_sum = 0, stored_sum = 0, weights = 0;
  for (const auto& [layer, entry] : block_done) {
    if (!entry.contains("metrics") || !entry["metrics"].is_array()) continue;
    // The seven linears of a block in the worker's order (model::kAllLinears) with their sizes
    // (Llama 4's dense layers have an MLP of their own width).
    const int64_t h = config.hidden_size, ff = config.MlpSize(layer);
    const struct {
      const char* name;
      int64_t in, out;
    } linears[] = {{"self_attn.q_proj", h, config.q_dim()},
                   {"self_attn.k_proj", h, config.kv_dim()},
                   {"self_attn.v_proj", h, config.kv_dim()},
                   {"self_attn.o_proj", config.q_dim(), h},
                   {"mlp.gate_proj", h, ff},
                   {"mlp.up_proj", h, ff},
                   {"mlp.down_proj", ff, h}};
    constexpr size_t kLinears = sizeof(linears) / sizeof(linears[0]);
    const nlohmann::json& metrics = entry["metrics"];
    for (size_t i = 0; i < metrics.size(); ++i) {
      const nlohmann::json& m = metrics[i];
      const std::string name = m.is_object() ? m.value("name", "") : "";
      double n = 0;
      if (name.rfind("experts.", 0) == 0) {
        // A routed expert's linear, "experts.<e>.<gate_proj|up_proj|down_proj>".
        n = static_cast<double>(h * config.intermediate_size);
      } else {
        // By name; a metric without a known name falls back to its position.
        size_t k = i < kLinears ? i : kLinears;
        for (size_t j = 0; j < kLinears; ++j) {
          if (name == linears[j].name) k = j;
        }
        if (k >= kLinears) continue;
        n = static_cast<double>(linears[k].in * linears[k].out);
      }
      code_sum += m.value("code_bits", 0.0) * n;
      stored_sum += m.value("stored_bits", 0.0) * n;
      weights += n;
    }
  }
  BitsPerWeight bits;
  if (weights > 0) {
    bits.code_bits = code_sum / weights;
    bits.stored_bits = stored_sum / weights;
  }
  return bits;
}

StatusOr<nlohmann::json> FinalizeJob(const Recipe& recipe, const std::string& model_dir,
                                     const std::string& out_dir, Journal* journal) {
  JobPlan plan;
  QCAL_ASSIGN_OR_RETURN(plan.config, LoadLlamaConfig(model_dir));
  plan.num_blocks = plan.config.num_hidden_layers;
  plan.recipe_hash = RecipeHash(recipe);
  // The finishing driver journaled the last job_start: its blocks are the ones of these inputs.
  for (const nlohmann::json& e : journal->entries()) {
    if (e.value("event", "") == "job_start") plan.inputs.key = e.value("inputs_key", "");
  }
  QCAL_RETURN_IF_ERROR(
      EvaluateJournal(recipe, out_dir, journal->entries(), journal->path(), &plan,
                      /*report=*/false));
  const std::vector<int64_t> pending = plan.pending_blocks();
  if (!pending.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        journal->path(), ": cannot finalize: block ", pending.front(), " (", pending.size(),
        " in all) has no block_done entry with an intact shard in ", out_dir));
  }
  if (plan.e2e_enabled && !plan.e2e_finished) {
    return absl::FailedPreconditionError(absl::StrCat(
        journal->path(), ": cannot finalize: end-to-end fine-tuning has no valid e2e_done entry"));
  }
  const BitsPerWeight bits = AggregateBits(plan.config, plan.block_done);
  const nlohmann::json quant_config = MakeQuantizationConfig(recipe, plan.config, bits.code_bits,
                                                             bits.stored_bits);
  // With end-to-end fine-tuning shard 0 already holds the tuned final norm (and head); a method
  // that transforms the non-block weights had block 0's task write them (checked with block 0's
  // entry), with an untied head.
  const bool transformed = recipe.needs().transforms_non_block;
  LlamaConfig out_config = plan.config;
  if (transformed) out_config.tie_word_embeddings = false;
  if (!plan.e2e_enabled && !transformed) {
    QCAL_ASSIGN_OR_RETURN(auto float_ckpt, CheckpointReader::Open(model_dir));
    QCAL_RETURN_IF_ERROR(
        WriteNonBlockShard(out_dir + "/" + ShardName(0, plan.num_blocks), *float_ckpt,
                           plan.config)
            .status());
  }
  // The checksums the journal accepted (verified against the files by EvaluateJournal above)
  // go into the index; shard 0, when finalize wrote it just now, is checksummed from its file.
  std::map<std::string, std::string> checksums;
  for (const auto& [layer, entry] : plan.block_done) {
    checksums[entry.value("shard", "")] = entry.value("checksum", "");
    if (entry.contains("also_wrote") && entry["also_wrote"].is_object()) {
      for (const auto& [name, sum] : entry["also_wrote"].items()) {
        if (sum.is_string()) checksums[name] = sum.get<std::string>();
      }
    }
  }
  if (plan.e2e_finished) {
    for (const auto& [name, sum] : plan.e2e_done["checksums"].items()) {
      if (sum.is_string()) checksums[name] = sum.get<std::string>();
    }
  }
  if (!plan.e2e_enabled && !transformed) checksums.erase(ShardName(0, plan.num_blocks));
  QCAL_RETURN_IF_ERROR(
      FinalizeCheckpoint(out_dir, model_dir, out_config, quant_config, std::move(checksums)));
  QCAL_RETURN_IF_ERROR(RemoveStaging(out_dir));
  // Expert-group part files an assembled block's shard holds (left by a run that stopped
  // between journaling the block and removing them).
  QCAL_RETURN_IF_ERROR(RemovePartFiles(out_dir));
  QCAL_RETURN_IF_ERROR(journal->Append({{"event", "job_done"}}));
  nlohmann::json summary = {{"out_dir", out_dir},
                            {"blocks", plan.num_blocks},
                            {"code_bits", bits.code_bits},
                            {"stored_bits", bits.stored_bits},
                            {"e2e", plan.e2e_enabled}};
  if (plan.e2e_finished) {
    summary["e2e_kl_before"] = plan.e2e_done.value("kl_before", nlohmann::json());
    summary["e2e_kl_after"] = plan.e2e_done.value("kl_after", nlohmann::json());
  }
  return summary;
}

}  // namespace qcal
