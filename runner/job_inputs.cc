#include "runner/job_inputs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_layout.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"

namespace qcal {
namespace {

namespace fs = std::filesystem;

Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// With symlinks resolved where the path exists.
std::string Resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(path, ec);
  return ec ? path : p.string();
}

bool IsInsideOrEqual(const std::string& path, const std::string& dir) {
  if (path == dir) return true;
  const std::string prefix = dir == "/" ? "/" : dir + "/";
  return path.compare(0, prefix.size(), prefix) == 0;
}

// An output directory: outside the model, a directory if it exists, creatable otherwise.
// A checkpoint already in out_dir is this job's (its journal names a run into out_dir: a resume
// or a rerun) or is replaced only when asked.
Status CheckExistingCheckpoint(const v1::JobSpec& in) {
  if (in.overwrite()) return absl::OkStatus();
  std::error_code ec;
  bool holds = false;
  for (const char* f : {"config.json", "model.safetensors.index.json", "model.safetensors"}) {
    holds |= std::filesystem::exists(in.out_dir() + "/" + f, ec);
  }
  if (!holds) return absl::OkStatus();
  const std::string out = Resolved(in.out_dir());
  // A missing journal has no entries; a damaged one is reported when the job opens it.
  if (StatusOr<Journal> journal = Journal::Open(JobPaths(in.job_dir()).journal); journal.ok()) {
    for (const nlohmann::json& e : journal->entries()) {
      if (e.value("event", "") != "job_start") continue;
      // Journals older than the "out" field are taken to be this output's.
      if (!e.contains("out") || e.value("out", "") == out) return absl::OkStatus();
    }
  }
  return Invalid(absl::StrCat(
      "out_dir '", in.out_dir(), "' already holds a checkpoint that job directory '", in.job_dir(),
      "' did not write (its journal names no run into it); qcal does not replace a checkpoint "
      "silently: pass --overwrite to replace it, or choose another --out"));
}

Status CheckOutputDir(const char* field, const std::string& path, const std::string& model_dir) {
  const std::string resolved = Resolved(path);
  const std::string model = Resolved(model_dir);
  if (IsInsideOrEqual(resolved, model)) {
    return Invalid(absl::StrCat(field, " '", path, "' is ",
                                resolved == model ? "the model directory" : "inside model_dir '",
                                resolved == model ? "" : model_dir + "'",
                                "; write the output outside the input"));
  }
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return Invalid(absl::StrCat(field, " '", path, "' exists and is not a directory"));
    }
    if (::access(path.c_str(), W_OK | X_OK) != 0) {
      return Invalid(absl::StrCat(field, " '", path, "' is not writable: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }
  // The nearest existing ancestor must let us create the rest (a relative path's, from the
  // working directory).
  std::error_code ec;
  fs::path absolute = fs::absolute(path, ec);
  if (ec) absolute = path;
  fs::path ancestor = absolute.parent_path();
  while (!ancestor.empty() && ::stat(ancestor.c_str(), &st) != 0) {
    if (ancestor == ancestor.parent_path()) break;
    ancestor = ancestor.parent_path();
  }
  if (ancestor.empty() || ::stat(ancestor.c_str(), &st) != 0) {
    return Invalid(absl::StrCat(field, " '", path, "' cannot be created: no existing parent"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return Invalid(absl::StrCat(field, " '", path, "' cannot be created: '", ancestor.string(),
                                "' is not a directory"));
  }
  if (::access(ancestor.c_str(), W_OK | X_OK) != 0) {
    return Invalid(absl::StrCat(field, " '", path, "' cannot be created: '", ancestor.string(),
                                "' is not writable"));
  }
  return absl::OkStatus();
}

}  // namespace

Status CheckReadableDirectory(const std::string& field, const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    return Invalid(err == ENOENT ? absl::StrCat(field, " '", path, "' does not exist")
                                 : absl::StrCat(field, " '", path, "': ", std::strerror(err)));
  }
  if (!S_ISDIR(st.st_mode)) return Invalid(absl::StrCat(field, " '", path, "' is not a directory"));
  if (::access(path.c_str(), R_OK | X_OK) != 0) {
    return Invalid(absl::StrCat(field, " '", path, "' is not readable: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

Status CheckReadableFile(const std::string& what, const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    return Invalid(err == ENOENT ? absl::StrCat(what, " '", path, "' does not exist")
                                 : absl::StrCat(what, " '", path, "': ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) return Invalid(absl::StrCat(what, " '", path, "' is not a file"));
  if (::access(path.c_str(), R_OK) != 0) {
    return Invalid(absl::StrCat(what, " '", path, "' is not readable: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

Status CheckLayerTensors(const LlamaConfig& config, const std::string& model_dir) {
  // Without a readable checkpoint there is nothing to compare; opening the model says why later.
  auto ckpt = CheckpointReader::Open(model_dir);
  if (!ckpt.ok()) return absl::OkStatus();
  const std::string prefix = config.TensorName("model.layers.");
  std::set<int64_t> layers;
  for (const std::string& name : (*ckpt)->TensorNames()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t dot = name.find('.', prefix.size());
    int64_t layer = 0;
    if (dot == std::string::npos ||
        !absl::SimpleAtoi(name.substr(prefix.size(), dot - prefix.size()), &layer)) {
      continue;
    }
    layers.insert(layer);
  }
  const int64_t n = config.num_hidden_layers;
  for (int64_t l = 0; l < n; ++l) {
    if (layers.count(l)) continue;
    const std::string held =
        layers.empty() ? "no block tensors at all"
                       : absl::StrCat(layers.size(), " block(s), layers ", *layers.begin(), " to ",
                                      *layers.rbegin());
    return Invalid(absl::StrCat(model_dir, "/config.json: num_hidden_layers is ", n,
                                " but the checkpoint has no tensors of layer ", l, " (it holds ",
                                held, "): the config does not describe these weights"));
  }
  if (!config.tie_word_embeddings && !(*ckpt)->Has(config.TensorName("lm_head.weight"))) {
    return Invalid(absl::StrCat(
        model_dir, "/config.json: tie_word_embeddings is false but the checkpoint has no "
        "lm_head.weight: set tie_word_embeddings to true if the head is the embedding table, or "
        "add the head's weights"));
  }
  return absl::OkStatus();
}

namespace {

// What qcal does not yet do with a mixture-of-experts model, refused before any work: the
// methods that do not quantize routed experts.
Status CheckMoeRecipe(const Recipe& recipe, const LlamaConfig& config, const v1::JobSpec& in) {
  const std::string model = absl::StrCat(in.model_dir(), "/config.json: ", config.architecture,
                                         " is a mixture-of-experts model (", config.num_experts,
                                         " experts, top ", config.experts_per_token, ")");
  if (!recipe.needs().supports_moe) {
    return Invalid(absl::StrCat(
        model, "; method ", recipe.method, " (", in.recipe_path(), ") does not quantize routed "
        "experts yet (its prefixed outlier tokens and static block fine-tuning are not carried "
        "through a router): use method rtn, gptq, quip, quarot or spinquant"));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<LlamaConfig> CheckJobInputs(const Recipe& recipe, const v1::JobSpec& in) {
  QCAL_RETURN_IF_ERROR(CheckReadableDirectory("model_dir", in.model_dir()));
  QCAL_RETURN_IF_ERROR(CheckReadableFile("model config", in.model_dir() + "/config.json"));
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(in.model_dir() + "/config.json"));
  if (config.is_moe()) QCAL_RETURN_IF_ERROR(CheckMoeRecipe(recipe, config, in));
  QCAL_RETURN_IF_ERROR(CheckLayerTensors(config, in.model_dir()));
  // The files finalize copies into the output: refused now, not after hours of work.
  QCAL_RETURN_IF_ERROR(CheckTokenizerFilesCopyable(in.model_dir()));
  QCAL_RETURN_IF_ERROR(CheckOutputDir("out_dir", in.out_dir(), in.model_dir()));
  QCAL_RETURN_IF_ERROR(CheckOutputDir("job_dir", in.job_dir(), in.model_dir()));
  QCAL_RETURN_IF_ERROR(CheckExistingCheckpoint(in));
  if (recipe.needs().reads_calibration_text()) {
    // Token ids past the embedding table would fail deep inside the forward pass ("row 2360 was
    // asked for"): say which files disagree before anything runs. A tokenizer that does not load
    // is reported where the job loads it.
    if (StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizerFromModelDir(in.model_dir());
        tok.ok() && (*tok)->vocab_size() > config.vocab_size) {
      return Invalid(absl::StrCat(
          in.model_dir(), ": the tokenizer has ", (*tok)->vocab_size(), " tokens but config.json's "
          "vocab_size is ", config.vocab_size, " (the embedding table's rows): the tokenizer "
          "files do not belong to this model"));
    }
    if (recipe.calibration.files.empty()) {
      return Invalid(
          absl::StrCat(in.recipe_path(), ": the recipe calibrates but lists no calibration files"));
    }
    bool relative = false;
    for (const std::string& f : recipe.calibration.files) relative |= f.empty() || f[0] != '/';
    if (relative) QCAL_RETURN_IF_ERROR(CheckReadableDirectory("data_root", in.data_root()));
    for (const std::string& f : recipe.calibration.files) {
      const std::string path = !f.empty() && f[0] == '/' ? f : in.data_root() + "/" + f;
      QCAL_RETURN_IF_ERROR(CheckReadableFile(
          absl::StrCat("calibration file (", in.recipe_path(), ": '", f, "')"), path));
    }
  }
  return config;
}

}  // namespace qcal

namespace qcal {

void ResolveJobSpec(v1::JobSpec* spec) {
  spec->set_job_dir(JobDirFor(spec->job_dir(), spec->out_dir()));
  spec->set_data_root(DataRootOr(spec->data_root()));
  if (spec->calib_batch() < 1) spec->set_calib_batch(kDefaultCalibBatch);
  if (spec->recipe_path().empty()) spec->set_recipe_path("recipe");
  if (spec->workers() < 1) spec->set_workers(1);
}

}  // namespace qcal
