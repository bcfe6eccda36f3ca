#include "worker/quant/quantize_job.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "worker/calib/calibration.h"
#include "worker/quant/finetune.h"
#include "worker/quant/quantized_checkpoint.h"

namespace qcal::quant {
namespace {

using Clock = std::chrono::steady_clock;

std::string RealPath(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

nlohmann::json MetricsToJson(const std::vector<LinearMetrics>& linears) {
  nlohmann::json arr = nlohmann::json::array();
  for (const LinearMetrics& m : linears) {
    arr.push_back({{"name", m.name},
                   {"proxy_loss", std::isnan(m.proxy_loss) ? nlohmann::json() : nlohmann::json(m.proxy_loss)},
                   {"relative", std::isnan(m.relative) ? nlohmann::json() : nlohmann::json(m.relative)},
                   {"code_bits", m.code_bits},
                   {"stored_bits", m.stored_bits},
                   {"seconds", m.seconds}});
  }
  return arr;
}

std::vector<LinearMetrics> MetricsFromJson(const nlohmann::json& arr) {
  std::vector<LinearMetrics> out;
  for (const auto& j : arr) {
    LinearMetrics m;
    m.name = j.value("name", "");
    m.proxy_loss = j["proxy_loss"].is_number() ? j["proxy_loss"].get<double>() : std::nan("");
    m.relative = j["relative"].is_number() ? j["relative"].get<double>() : std::nan("");
    m.code_bits = j.value("code_bits", 0.0);
    m.stored_bits = j.value("stored_bits", 0.0);
    m.seconds = j.value("seconds", 0.0);
    out.push_back(m);
  }
  return out;
}

// Append-only journal of finished work; each line is flushed and fsynced before the job moves on.
class Journal {
 public:
  static StatusOr<Journal> Open(const std::string& path) {
    Journal j;
    j.path_ = path;
    std::ifstream in(path);
    std::string line;
    int64_t lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (line.empty()) continue;
      auto e = nlohmann::json::parse(line, nullptr, false);
      if (e.is_discarded() || !e.is_object()) {
        // A torn last line (crash mid-append) is ignored; anything else is corruption.
        if (in.peek() == EOF) break;
        return absl::DataLossError(absl::StrCat(path, ": line ", lineno, " is not JSON"));
      }
      j.entries_.push_back(std::move(e));
    }
    return j;
  }
  const std::vector<nlohmann::json>& entries() const { return entries_; }
  Status Append(const nlohmann::json& entry) {
    const std::string line = entry.dump() + "\n";
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return absl::InternalError(absl::StrCat(path_, ": cannot open for append"));
    const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                    ::fsync(fd) == 0;
    ::close(fd);
    if (!ok) return absl::InternalError(absl::StrCat(path_, ": write failed"));
    entries_.push_back(entry);
    return absl::OkStatus();
  }

 private:
  std::string path_;
  std::vector<nlohmann::json> entries_;
};

nlohmann::json FiniteOrNull(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}
double NumberOrNan(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_number() ? e[key].get<double>() : std::nan("");
}

// ---- Float activations at block boundaries (for within-block fine-tuning).

std::string ActivationPath(const std::string& job_dir, int64_t boundary) {
  return absl::StrCat(job_dir, "/activations/block_", boundary, ".safetensors");
}

Status SaveActivation(const std::string& path, const at::Tensor& hidden, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("calibration_key", key);
  const at::Tensor c = hidden.detach().to(at::kFloat).contiguous();
  QCAL_RETURN_IF_ERROR(writer.AddF32("hidden", c.sizes().vec(), c.data_ptr<float>()));
  return writer.Write(path);
}

// The opened file and its "hidden" tensor. NotFound when absent, FailedPrecondition for another
// calibration key, DataLoss when malformed.
StatusOr<std::pair<std::unique_ptr<SafetensorsFile>, const TensorInfo*>> OpenActivation(
    const std::string& path, const std::string& key, const std::vector<int64_t>& shape) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::NotFoundError(path + ": no cached activations");
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  auto it = file->metadata().find("calibration_key");
  if (it == file->metadata().end() || it->second != key) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cached activations belong to another calibration"));
  }
  const TensorInfo* t = file->Find("hidden");
  if (t == nullptr || t->dtype != DType::kF32 || t->shape != shape) {
    return absl::DataLossError(absl::StrCat(path, ": missing or misshapen tensor 'hidden'"));
  }
  return std::make_pair(std::move(file), t);
}

StatusOr<at::Tensor> LoadActivation(const std::string& path, const std::string& key,
                                    const std::vector<int64_t>& shape) {
  QCAL_ASSIGN_OR_RETURN(auto opened, OpenActivation(path, key, shape));
  return at::from_blob(const_cast<uint8_t*>(opened.first->Data(*opened.second)), shape,
                       at::kFloat)
      .clone();
}

// The float model's hidden states entering every block and leaving the last, over `tokens`;
// reused from job_dir/activations when every file carries `key`.
StatusOr<bool> EnsureActivations(const model::LlamaModel& model, const at::Tensor& tokens,
                                 const std::string& job_dir, const std::string& key,
                                 int64_t batch,
                                 const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t blocks = model.num_blocks();
  const std::vector<int64_t> shape = {tokens.size(0), tokens.size(1), model.config().hidden_size};
  bool cached = true;
  for (int64_t l = 0; l <= blocks && cached; ++l) {
    cached = OpenActivation(ActivationPath(job_dir, l), key, shape).ok();
  }
  if (cached) return true;
  QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/activations"));
  at::NoGradGuard no_grad;
  at::Tensor x = model.Embed(tokens);
  for (int64_t l = 0; l < blocks; ++l) {
    QCAL_RETURN_IF_ERROR(SaveActivation(ActivationPath(job_dir, l), x, key));
    std::vector<at::Tensor> out;
    for (int64_t b = 0; b < x.size(0); b += batch) {
      out.push_back(model.block(l).Forward(x.narrow(0, b, std::min(x.size(0) - b, batch)),
                                           model.rope()));
    }
    x = at::cat(out, 0);
    if (progress) progress(l + 1, blocks);
  }
  QCAL_RETURN_IF_ERROR(SaveActivation(ActivationPath(job_dir, blocks), x, key));
  return false;
}

// Shard 0 with the tuned final norm (and untied head); embeddings copied from the float model.
Status WriteTunedNonBlockShard(const std::string& path, CheckpointReader& float_ckpt,
                               const TunableModel& tuned) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  const std::string embed_name = "model.embed_tokens.weight";
  QCAL_ASSIGN_OR_RETURN(auto found, float_ckpt.Find(embed_name));
  QCAL_ASSIGN_OR_RETURN(std::vector<float> embed, found.first->ReadF32(embed_name));
  QCAL_RETURN_IF_ERROR(writer.AddF32(embed_name, found.second->shape, embed.data()));
  auto add = [&](const std::string& name, const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kFloat).contiguous();
    return writer.AddF32(name, c.sizes().vec(), c.data_ptr<float>());
  };
  QCAL_RETURN_IF_ERROR(add("model.norm.weight", tuned.final_norm));
  if (!tuned.head_tied) QCAL_RETURN_IF_ERROR(add("lm_head.weight", tuned.head));
  return writer.Write(path);
}

}  // namespace

StatusOr<QuantizeJobResult> RunQuantizeJob(const Recipe& recipe, const QuantizeJobOptions& opt_in,
                                           const std::function<void(const JobEvent&)>& on_event) {
  const auto t0 = Clock::now();
  QuantizeJobOptions opt = opt_in;
  if (opt.job_dir.empty()) opt.job_dir = opt.out_dir + ".job";
  if (opt.data_root.empty()) opt.data_root = "../shared";
  auto emit = [&](const std::string& phase, int64_t done, int64_t total, std::string msg = "") {
    if (on_event) on_event(JobEvent{phase, done, total, std::move(msg)});
  };
  const bool block_ft = recipe.finetune.enabled;
  const bool e2e_ft = recipe.finetune.end_to_end.enabled;

  // ---- Plan: validate inputs before any work.
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(opt.model_dir));
  const std::string model_real = RealPath(opt.model_dir);
  QCAL_RETURN_IF_ERROR(MakeDirs(opt.out_dir));
  const std::string out_real = RealPath(opt.out_dir);
  if (out_real == model_real || out_real.rfind(model_real + "/", 0) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("output directory ", opt.out_dir,
                                                   " is inside the input model directory ",
                                                   opt.model_dir));
  }
  QCAL_RETURN_IF_ERROR(MakeDirs(opt.job_dir));
  QCAL_ASSIGN_OR_RETURN(auto model, model::LlamaModel::Load(opt.model_dir));
  model::SetComputeThreads(opt.threads > 0 ? opt.threads : model::AutoComputeThreads(config));
  QCAL_ASSIGN_OR_RETURN(auto float_ckpt, CheckpointReader::Open(opt.model_dir));
  const int64_t blocks = config.num_hidden_layers;
  const std::string recipe_hash = Fnv1aHex(recipe.ToJson().dump());

  QCAL_ASSIGN_OR_RETURN(Journal journal, Journal::Open(opt.job_dir + "/journal.jsonl"));
  std::map<int64_t, nlohmann::json> done;  // layer -> block_done entry
  // The last e2e_done, if no block was (re)done after it: it supersedes the block checksums.
  nlohmann::json e2e_done;
  for (const auto& e : journal.entries()) {
    if (e.value("event", "") == "job_start" && e.value("recipe_hash", "") != recipe_hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          opt.job_dir, "/journal.jsonl belongs to another recipe ('",
          e.value("recipe", std::string("?")), "'); use a fresh --job-dir or --out"));
    }
    if (e.value("event", "") == "block_done") {
      done[e.value("layer", int64_t{-1})] = e;
      e2e_done = nlohmann::json();
    }
    if (e.value("event", "") == "e2e_done") e2e_done = e;
  }
  QCAL_RETURN_IF_ERROR(journal.Append({{"event", "job_start"},
                                       {"recipe", recipe.name},
                                       {"recipe_hash", recipe_hash},
                                       {"model", model_real}}));
  QuantizeJobResult result;
  result.out_dir = opt.out_dir;

  // Which blocks still need work (shard present and intact, per the journal)?
  std::vector<bool> finished(blocks, false);
  bool e2e_finished = false;
  if (e2e_ft && e2e_done.is_object()) {
    // Every shard was rewritten by the end-to-end stage; its checksums are the ones to match.
    e2e_finished = e2e_done.contains("checksums") && e2e_done["checksums"].size() ==
                                                         static_cast<size_t>(blocks + 1);
    for (int64_t shard = 0; shard <= blocks && e2e_finished; ++shard) {
      const std::string name = ShardName(shard, blocks);
      auto bytes = ReadFile(opt.out_dir + "/" + name);
      e2e_finished = bytes.ok() && e2e_done["checksums"].value(name, "") == Fnv1aHex(*bytes);
    }
    if (e2e_finished) {
      finished.assign(blocks, true);
    } else {
      QCAL_LOG_WARN("journal says end-to-end fine-tuning is done but a shard is missing or "
                    "changed; redoing every block and the end-to-end stage");
      done.clear();
    }
  }
  for (const auto& [layer, e] : done) {
    if (e2e_finished || layer < 0 || layer >= blocks) continue;
    auto bytes = ReadFile(opt.out_dir + "/" + ShardName(layer + 1, blocks));
    finished[layer] = bytes.ok() && Fnv1aHex(*bytes) == e.value("checksum", "");
    if (!finished[layer]) {
      QCAL_LOG_WARN("block {}: journal says done but its shard is missing or changed; redoing",
                    layer);
    }
  }
  bool all_finished = true;
  for (bool f : finished) all_finished = all_finished && f;
  const bool need_e2e = e2e_ft && !e2e_finished;

  // ---- Calibrate.
  std::vector<calib::BlockHessians> hessians;
  at::Tensor tokens;
  std::string calib_key;
  const bool need_hessians = recipe.needs_hessians() && !all_finished;
  const bool need_activations = block_ft && !all_finished;
  if (need_hessians || need_activations || need_e2e) {
    QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizerFromModelDir(opt.model_dir));
    const int64_t seq_len =
        std::min(recipe.calibration.seq_len, config.max_position_embeddings);
    calib_key = calib::CalibrationKey(opt.model_dir, config, recipe.calibration, opt.data_root,
                                      seq_len);
    QCAL_ASSIGN_OR_RETURN(tokens, calib::SampleCalibrationTokens(*tokenizer, recipe.calibration,
                                                                 opt.data_root, seq_len,
                                                                 tokenizer->bos_id()));
    result.calib_tokens = tokens.numel();
  }
  if (need_hessians) {
    const std::string& key = calib_key;
    emit("calibrate", 0, blocks);
    QCAL_ASSIGN_OR_RETURN(
        auto calib, calib::CollectModelHessians(*model, tokens, opt.job_dir, key, opt.calib_batch,
                                                [&](int64_t d, int64_t t) {
                                                  emit("calibrate", d, t);
                                                }));
    hessians = std::move(calib.hessians);
    result.calib_seconds = calib.seconds;
    result.hessians_from_cache = calib.from_cache;
    result.calib_tokens = calib.tokens;
  }

  if (need_activations) {
    emit("activations", 0, blocks);
    QCAL_ASSIGN_OR_RETURN(result.activations_from_cache,
                          EnsureActivations(*model, tokens, opt.job_dir, calib_key,
                                            opt.calib_batch, [&](int64_t d, int64_t t) {
                                              emit("activations", d, t);
                                            }));
  }

  // ---- Quantize, block by block; each finished block is one atomic shard + a journal line.
  double code_bits_sum = 0, stored_bits_sum = 0, weights = 0;
  for (int64_t l = 0; l < blocks; ++l) {
    BlockSummary summary;
    summary.layer = l;
    if (finished[l]) {
      summary.resumed = true;
      summary.linears = MetricsFromJson(done[l]["metrics"]);
      summary.seconds = done[l].value("seconds", 0.0);
      summary.mse_before_ft = NumberOrNan(done[l], "mse_before_ft");
      summary.mse_after_ft = NumberOrNan(done[l], "mse_after_ft");
      ++result.blocks_resumed;
    } else {
      BlockTaskResult task;
      if (block_ft) {
        const std::vector<int64_t> shape = {tokens.size(0), tokens.size(1), config.hidden_size};
        QCAL_ASSIGN_OR_RETURN(at::Tensor inputs,
                              LoadActivation(ActivationPath(opt.job_dir, l), calib_key, shape));
        QCAL_ASSIGN_OR_RETURN(at::Tensor targets, LoadActivation(ActivationPath(opt.job_dir, l + 1),
                                                                 calib_key, shape));
        QCAL_ASSIGN_OR_RETURN(
            task, QuantizeBlockWithFinetune(recipe, config, l, model->block(l).weights(),
                                            hessians.empty() ? nullptr : &hessians[l],
                                            model->rope(), inputs, targets));
      } else {
        QCAL_ASSIGN_OR_RETURN(task, QuantizeBlock(recipe, config, l, model->block(l).weights(),
                                                  hessians.empty() ? nullptr : &hessians[l]));
      }
      const std::string shard = ShardName(l + 1, blocks);
      QCAL_RETURN_IF_ERROR(WriteBlockShard(opt.out_dir + "/" + shard, l, task.weights).status());
      QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFile(opt.out_dir + "/" + shard));
      QCAL_RETURN_IF_ERROR(journal.Append({{"event", "block_done"},
                                           {"layer", l},
                                           {"shard", shard},
                                           {"bytes", bytes.size()},
                                           {"checksum", Fnv1aHex(bytes)},
                                           {"seconds", task.seconds},
                                           {"mse_before_ft", FiniteOrNull(task.mse_before_ft)},
                                           {"mse_after_ft", FiniteOrNull(task.mse_after_ft)},
                                           {"metrics", MetricsToJson(task.linears)}}));
      summary.linears = task.linears;
      summary.seconds = task.seconds;
      summary.mse_before_ft = task.mse_before_ft;
      summary.mse_after_ft = task.mse_after_ft;
    }
    const model::BlockWeights& fw = model->block(l).weights();
    for (size_t i = 0; i < summary.linears.size(); ++i) {
      const model::Linear& lin = fw.linear(model::kAllLinears[i]);
      const double n = static_cast<double>(lin.in_features() * lin.out_features());
      code_bits_sum += summary.linears[i].code_bits * n;
      stored_bits_sum += summary.linears[i].stored_bits * n;
      weights += n;
    }
    result.blocks.push_back(std::move(summary));
    emit("quantize", l + 1, blocks, absl::StrCat("block ", l));
  }
  result.code_bits = code_bits_sum / weights;
  result.stored_bits = stored_bits_sum / weights;

  const nlohmann::json quant_config =
      MakeQuantizationConfig(recipe, result.code_bits, result.stored_bits);
  const std::string shard0 = opt.out_dir + "/" + ShardName(0, blocks);

  // ---- End-to-end fine-tuning: tune the quantized model (read back from its shards, so a
  // resumed job tunes exactly what an uninterrupted one would) against the float model.
  if (need_e2e) {
    emit("finetune", 0, 1);
    // Shard 0 and the index make out_dir readable as a checkpoint (config.json comes last).
    QCAL_RETURN_IF_ERROR(WriteNonBlockShard(shard0, *float_ckpt, config).status());
    std::map<std::string, std::string> weight_map;
    uint64_t total = 0;
    for (int64_t shard = 0; shard <= blocks; ++shard) {
      const std::string name = ShardName(shard, blocks);
      QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(opt.out_dir + "/" + name));
      for (const TensorInfo& t : file->tensors()) {
        weight_map[t.name] = name;
        total += t.nbytes();
      }
    }
    QCAL_RETURN_IF_ERROR(WriteCheckpointIndex(opt.out_dir, weight_map, total));
    std::vector<model::BlockWeights> qblocks;
    {
      LlamaConfig qconfig = config;
      qconfig.raw["quantization_config"] = quant_config;
      QCAL_ASSIGN_OR_RETURN(auto qckpt, CheckpointReader::Open(opt.out_dir));
      for (int64_t l = 0; l < blocks; ++l) {
        QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, LoadAnyBlockWeights(*qckpt, qconfig, l));
        qblocks.push_back(std::move(w));
      }
    }
    QCAL_ASSIGN_OR_RETURN(TunableModel tuned,
                          AssembleTunableModel(config, *float_ckpt, std::move(qblocks)));
    QCAL_ASSIGN_OR_RETURN(EndToEndResult e2e, FinetuneEndToEnd(recipe, &tuned, *model, tokens));
    nlohmann::json checksums = nlohmann::json::object();
    for (int64_t l = 0; l < blocks; ++l) {
      const std::string name = ShardName(l + 1, blocks);
      QCAL_RETURN_IF_ERROR(
          WriteBlockShard(opt.out_dir + "/" + name, l, tuned.model->block(l).weights()).status());
      QCAL_ASSIGN_OR_RETURN(std::string bytes, ReadFile(opt.out_dir + "/" + name));
      checksums[name] = Fnv1aHex(bytes);
    }
    QCAL_RETURN_IF_ERROR(WriteTunedNonBlockShard(shard0, *float_ckpt, tuned));
    QCAL_ASSIGN_OR_RETURN(std::string bytes0, ReadFile(shard0));
    checksums[ShardName(0, blocks)] = Fnv1aHex(bytes0);
    QCAL_RETURN_IF_ERROR(journal.Append({{"event", "e2e_done"},
                                         {"checksums", checksums},
                                         {"kl_before", FiniteOrNull(e2e.heldout_kl_before)},
                                         {"kl_after", FiniteOrNull(e2e.heldout_kl_after)},
                                         {"best_epoch", e2e.best_epoch},
                                         {"head_tuned", e2e.head_tuned},
                                         {"seconds", e2e.seconds}}));
    result.e2e_kl_before = e2e.heldout_kl_before;
    result.e2e_kl_after = e2e.heldout_kl_after;
    emit("finetune", 1, 1);
  } else if (e2e_finished) {
    result.e2e_resumed = true;
    result.e2e_kl_before = NumberOrNan(e2e_done, "kl_before");
    result.e2e_kl_after = NumberOrNan(e2e_done, "kl_after");
  }

  // ---- Finalize. With end-to-end fine-tuning shard 0 holds the tuned final norm already.
  emit("finalize", 0, 1);
  if (!e2e_ft) {
    QCAL_RETURN_IF_ERROR(WriteNonBlockShard(shard0, *float_ckpt, config).status());
  }
  QCAL_RETURN_IF_ERROR(FinalizeCheckpoint(opt.out_dir, opt.model_dir, config, quant_config));
  QCAL_RETURN_IF_ERROR(journal.Append({{"event", "job_done"}}));
  emit("finalize", 1, 1);
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

}  // namespace qcal::quant
