#include "export/export.h"

#include <sys/stat.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/checkpoint_layout.h"
#include "common/dtype.h"
#include "common/hf_config.h"
#include "common/io_util.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "export/format.h"
#include "export/tensor_plan.h"
#include "methods/method_factory.h"

namespace qcal::exporter {
namespace {

constexpr char kEmbed[] = "model.embed_tokens.weight";
constexpr char kNorm[] = "model.norm.weight";
constexpr char kHead[] = "lm_head.weight";

// The model's dtype (config.json torch_dtype): what the unquantized tensors of a packed export
// are stored in. Absent: float32, as Hugging Face assumes.
StatusOr<DType> ModelDType(const LlamaConfig& config, const std::string& dir) {
  const nlohmann::json& raw = config.raw;
  if (!raw.contains("torch_dtype") || raw["torch_dtype"].is_null()) return DType::kF32;
  if (!raw["torch_dtype"].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: torch_dtype is not a string"));
  }
  const std::string t = raw["torch_dtype"].get<std::string>();
  if (t == "float16" || t == "half") return DType::kF16;
  if (t == "bfloat16") return DType::kBF16;
  if (t == "float32" || t == "float") return DType::kF32;
  return absl::InvalidArgumentError(absl::StrCat(
      dir, "/config.json: torch_dtype '", t, "' (expected float16, bfloat16 or float32)"));
}

class Exporter {
 public:
  Exporter(ExportOptions options) : o_(std::move(options)) {}

  StatusOr<ExportResult> Run() {
    QCAL_RETURN_IF_ERROR(Open());
    QCAL_RETURN_IF_ERROR(Plan());
    const std::string partial = o_.out_dir + ".partial";
    std::error_code ec;
    std::filesystem::remove_all(partial, ec);  // a previous export's leftovers (ours by name)
    QCAL_RETURN_IF_ERROR(MakeDirs(partial));
    StatusOr<ExportResult> result = WriteInto(partial);
    if (result.ok()) {
      std::filesystem::remove(o_.out_dir, ec);  // an empty directory, checked in Open
      if (Status renamed = RenameNoFollow(partial, o_.out_dir); !renamed.ok()) {
        result = renamed;
      } else if (Status synced = SyncParentDir(o_.out_dir); !synced.ok()) {
        result = synced;
      }
    }
    if (!result.ok()) std::filesystem::remove_all(partial, ec);
    if (io::IsOutOfSpace(result.status())) {
      // The quantize job's advice (resume from the journal) does not apply: an export keeps
      // nothing of a failed run.
      std::string message(result.status().message());
      const std::string advice = io::kOutOfSpaceAdvice;
      message.replace(message.find(advice), advice.size(),
                      "free space on that filesystem and run the export again (it starts over; "
                      "the partial export was removed, the input checkpoint is unchanged)");
      return absl::FailedPreconditionError(message);
    }
    return result;
  }

 private:
  Status Open() {
    if (o_.format != "gptq" && o_.format != "dense" && o_.format != "compressed-tensors") {
      return absl::InvalidArgumentError(absl::StrCat(
          "export format '", o_.format, "' (supported: gptq, compressed-tensors, dense)"));
    }
    if (o_.max_shard_bytes <= 0) {
      return absl::InvalidArgumentError("--max-shard-size must be positive");
    }
    // config.json is written last (common/checkpoint_layout.h): without it the directory is no
    // finished checkpoint (`qcal export` first asks the job directory whether a job is still
    // writing it: runner/job_dir.h CheckJobFinished).
    std::error_code exists_ec;
    if (!std::filesystem::exists(o_.in_dir + "/config.json", exists_ec)) {
      return absl::FailedPreconditionError(absl::StrCat(
          o_.in_dir, ": no config.json, so not a finished checkpoint (a quantization job writes "
          "it last)"));
    }
    src_.dir = o_.in_dir;
    QCAL_ASSIGN_OR_RETURN(src_.config, LoadLlamaConfig(o_.in_dir));
    if (!src_.config.raw.contains("quantization_config")) {
      return absl::InvalidArgumentError(absl::StrCat(
          o_.in_dir, "/config.json: a float model (no quantization_config): nothing to export"));
    }
    QCAL_ASSIGN_OR_RETURN(src_.method, methods::CheckpointMethod(src_.config, o_.in_dir));
    QCAL_ASSIGN_OR_RETURN(src_.served, src_.method->inference().Served());
    QCAL_ASSIGN_OR_RETURN(src_.model_dtype, ModelDType(src_.config, o_.in_dir));
    QCAL_ASSIGN_OR_RETURN(src_.ckpt, CheckpointReader::Open(o_.in_dir));
    // The output: a new directory (or an empty one), not inside the input.
    const std::filesystem::path in = std::filesystem::weakly_canonical(o_.in_dir);
    const std::filesystem::path out = std::filesystem::weakly_canonical(o_.out_dir);
    auto [a, b] = std::mismatch(in.begin(), in.end(), out.begin(), out.end());
    if (a == in.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          o_.out_dir, ": the export's directory is the input checkpoint or inside it (",
          o_.in_dir, ")"));
    }
    struct stat st;
    if (::stat(o_.out_dir.c_str(), &st) == 0) {
      std::error_code ec;
      if (!S_ISDIR(st.st_mode) || !std::filesystem::is_empty(o_.out_dir, ec)) {
        return absl::AlreadyExistsError(absl::StrCat(
            o_.out_dir, ": exists and is not an empty directory; the export writes a new one"));
      }
    }
    const bool packed = o_.format != "dense";
    plan_ = std::make_unique<TensorPlan>(&src_, /*read_grids=*/packed);
    format_ = o_.format == "gptq"    ? MakeGptqFormat(src_, plan_.get())
              : o_.format == "dense" ? MakeDenseFormat(src_, plan_.get())
                                     : MakeCompressedTensorsFormat(src_, plan_.get());
    return format_->Check();
  }

  // The tensors in Hugging Face's order: embedding, each block (norms, attention, the dense MLP
  // or shared expert, a MoE block's router and routed experts), final norm, head, then anything
  // outside the text model (a multimodal Llama 4's vision tower and projector, as stored). The
  // float ones in the format's dtype, or (nullopt) tables as stored, vectors float32.
  Status Plan() {
    const LlamaConfig& c = src_.config;
    const int64_t hidden = c.hidden_size;
    const std::optional<DType> float_dtype = format_->FloatDType();
    const DType vector_dtype = float_dtype.value_or(DType::kF32);
    auto table = [&](const std::string& name) -> Status {
      QCAL_ASSIGN_OR_RETURN(auto found, src_.ckpt->Find(name));
      return plan_->AddTable(name, float_dtype.value_or(found.second->dtype));
    };
    auto norm = [&](int64_t layer, const char* name, at::Tensor model::BlockWeights::*field) {
      plan_->AddBlockTensor(c.TensorName(absl::StrCat("model.layers.", layer, ".", name)),
                            vector_dtype, {hidden}, layer,
                            [vector_dtype, field](const LoadedBlock& b, const Sink& sink) {
                              const at::Tensor w = (b.weights.*field).to(at::kFloat).contiguous();
                              return SinkAs(vector_dtype, w.data_ptr<float>(), w.numel(), sink);
                            });
    };
    QCAL_RETURN_IF_ERROR(table(c.TensorName(kEmbed)));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::vector<LinearRef> linears = BlockLinears(c, l);
      std::vector<LinearRef> experts;
      norm(l, "input_layernorm.weight", &model::BlockWeights::input_norm);
      bool mlp = false;
      for (const LinearRef& ref : linears) {
        if (ref.expert >= 0) {
          experts.push_back(ref);
          continue;
        }
        if (!mlp && ref.kind == model::LinearKind::kGate) {
          norm(l, "post_attention_layernorm.weight", &model::BlockWeights::post_norm);
          mlp = true;
        }
        QCAL_RETURN_IF_ERROR(format_->PlanLinear(ref));
      }
      if (!mlp) norm(l, "post_attention_layernorm.weight", &model::BlockWeights::post_norm);
      if (!c.IsMoeLayer(l)) continue;
      // The router, kept in float by qcal: in the format's float dtype (what engines run it in).
      plan_->AddBlockTensor(c.RouterModule(l) + ".weight", vector_dtype, {c.num_experts, hidden},
                            l, [vector_dtype](const LoadedBlock& b, const Sink& sink) -> Status {
                              const at::Tensor w =
                                  b.weights.moe->router.to(at::kFloat).contiguous();
                              return SinkAs(vector_dtype, w.data_ptr<float>(), w.numel(), sink);
                            });
      QCAL_RETURN_IF_ERROR(format_->PlanExperts(experts));
    }
    QCAL_RETURN_IF_ERROR(plan_->AddSmall(c.TensorName(kNorm), vector_dtype));
    if (src_.ckpt->Has(c.TensorName(kHead))) QCAL_RETURN_IF_ERROR(table(c.TensorName(kHead)));
    if (!c.tensor_prefix.empty()) {
      for (const std::string& name : src_.ckpt->TensorNames()) {
        if (name.compare(0, c.tensor_prefix.size(), c.tensor_prefix) == 0) continue;
        QCAL_RETURN_IF_ERROR(plan_->AddStored(name));
        ++copied_as_stored_;
      }
      QCAL_LOG_INFO("export: {} tensors outside the text model ({}) copied as stored",
                    copied_as_stored_, c.tensor_prefix);
    }
    format_->PlanDone();
    return absl::OkStatus();
  }

  StatusOr<ExportResult> WriteInto(const std::string& dir) {
    // Shards by size, in order (a tensor larger than the limit alone in its shard).
    const std::vector<PlannedTensor>& planned = plan_->tensors();
    std::vector<std::vector<const PlannedTensor*>> shards(1);
    uint64_t in_shard = 0, total = 0;
    for (const PlannedTensor& p : planned) {
      const uint64_t limit = static_cast<uint64_t>(o_.max_shard_bytes);
      if (!shards.back().empty() && in_shard + p.bytes > limit) {
        shards.emplace_back();
        in_shard = 0;
      }
      shards.back().push_back(&p);
      in_shard += p.bytes;
      total += p.bytes;
    }
    ExportResult result;
    result.out_dir = o_.out_dir;
    std::map<std::string, std::string> weight_map;
    const int64_t n = static_cast<int64_t>(shards.size());
    for (int64_t i = 0; i < n; ++i) {
      const std::string name = n == 1 ? "model.safetensors"
                                      : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, n);
      SafetensorsWriter writer;
      writer.SetMetadata("format", "pt");  // transformers requires it
      for (const PlannedTensor* p : shards[i]) {
        QCAL_RETURN_IF_ERROR(writer.AddStreamed(p->name, p->dtype, p->shape, p->produce));
        weight_map[p->name] = name;
      }
      QCAL_RETURN_IF_ERROR(writer.Write(dir + "/" + name));
      QCAL_LOG_INFO("export: wrote {} ({} tensors)", name, shards[i].size());
      result.shards.push_back(name);
    }
    if (n > 1) QCAL_RETURN_IF_ERROR(WriteCheckpointIndex(dir, weight_map, total));
    result.tensors = static_cast<int64_t>(planned.size());
    result.tensor_bytes = total;

    LlamaConfig out = src_.config;
    out.raw.erase("quantization_config");
    QCAL_ASSIGN_OR_RETURN(result.quantization_config, format_->Finish(dir, &out.raw));
    QCAL_RETURN_IF_ERROR(CopyTokenizerFiles(o_.in_dir, dir));
    QCAL_RETURN_IF_ERROR(
        WriteFileAtomic(dir + "/config.json", LlamaConfigToJson(out).dump(2) + "\n"));
    return result;
  }

  ExportOptions o_;
  Source src_;
  std::unique_ptr<TensorPlan> plan_;  // before format_, which plans into it
  std::unique_ptr<Format> format_;
  int64_t copied_as_stored_ = 0;
};

}  // namespace

StatusOr<ExportResult> ExportCheckpoint(const ExportOptions& options) {
  Exporter exporter(options);
  return exporter.Run();
}

}  // namespace qcal::exporter
