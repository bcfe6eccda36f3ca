#include "coordinator/validation.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/safe_fs.h"
#include "common/cli.h"
#include "common/hf_config.h"
#include "runner/job_dir.h"
#include "runner/job_inputs.h"
#include "methods/registry.h"

namespace qcal::coordinator {
namespace {

namespace fs = std::filesystem;

Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// Lexically normal, without a trailing slash. InvalidArgument when empty or relative.
StatusOr<std::string> NormalizeAbsolute(const char* field, const std::string& path) {
  if (path.empty()) return Invalid(absl::StrCat(field, " is empty"));
  if (path[0] != '/') {
    return Invalid(absl::StrCat(field, " '", path,
                                "' is not an absolute path (the client resolves paths before "
                                "submitting)"));
  }
  // Canonical (links resolved once, here): below these paths the job writes nothing through a
  // link (common/safe_fs.h), and the roots a user may use are compared on canonical paths.
  StatusOr<std::string> p = CanonicalPath(path);
  if (!p.ok()) return Invalid(absl::StrCat(field, ": ", p.status().message()));
  return *p;
}

// InvalidArgument naming the field when `value` holds a control character.
Status NoControlCharacters(const std::string& field, const std::string& value) {
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return Invalid(absl::StrCat(field, " contains a control character (byte ", i, ", 0x",
                                  absl::Hex(c, absl::kZeroPad2), "); paths and names may not"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> CalibrationPaths(const Recipe& recipe, const v1::JobSpec& spec) {
  std::vector<std::string> out;
  if (!recipe.needs().reads_calibration_text()) return out;
  for (const std::string& f : recipe.calibration.files) {
    const std::string p = !f.empty() && f[0] == '/' ? f : spec.data_root() + "/" + f;
    StatusOr<std::string> c = CanonicalPath(p);
    out.push_back(c.ok() ? *c : p);
  }
  return out;
}

Status CheckModelFilesUnderRoots(const Principal& who, const std::string& model_dir) {
  for (const std::string& root : who.read_roots) {
    if (root == "/") return absl::OkStatus();
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(model_dir, ec)) {
    const std::string path = entry.path().string();
    StatusOr<std::string> real = CanonicalPath(path);
    if (!real.ok()) continue;  // a dangling link: the readers name it
    if (Status s = CheckUnderRoots(who, "model file", *real, false); !s.ok()) {
      return absl::PermissionDeniedError(absl::StrCat(
          path, " resolves to a file outside the directories user '", who.name,
          "' may read; link only to files under them"));
    }
  }
  return absl::OkStatus();
}

StatusOr<Recipe> ValidateJobSpec(v1::JobSpec* spec) {
  // Every string a person typed: other people's terminals print them (qcal list, the log).
  const std::pair<const char*, const std::string*> strings[] = {
      {"recipe_path", &spec->recipe_path()}, {"model_dir", &spec->model_dir()},
      {"out_dir", &spec->out_dir()},         {"job_dir", &spec->job_dir()},
      {"data_root", &spec->data_root()},     {"name", &spec->name()},
      {"device", &spec->device()}};
  for (const auto& [field, value] : strings) {
    QCAL_RETURN_IF_ERROR(NoControlCharacters(field, *value));
  }
  for (const v1::EvalData& d : spec->eval().data()) {
    QCAL_RETURN_IF_ERROR(NoControlCharacters("eval data label", d.label()));
    QCAL_RETURN_IF_ERROR(NoControlCharacters("eval data path", d.path()));
  }
  if (spec->workers() < 1) {
    return Invalid(absl::StrCat("workers must be at least 1 (got ", spec->workers(), ")"));
  }
  if (spec->workers() > kMaxWorkers) {
    return Invalid(absl::StrCat("workers must be at most ", kMaxWorkers, " (got ",
                                spec->workers(), ")"));
  }
  if (const std::string& d = spec->device();
      !d.empty() && d != "auto" && d != "cpu" && d != "cuda" &&
      !(d.size() > 5 && d.rfind("cuda:", 0) == 0 &&
        d.find_first_not_of("0123456789", 5) == std::string::npos)) {
    return Invalid(absl::StrCat("device must be auto, cpu, cuda or cuda:N (got '", d, "')"));
  }
  if (spec->threads_per_worker() < 0 || spec->threads_per_worker() > kMaxThreads) {
    return Invalid(absl::StrCat("threads_per_worker must be in [0, ", kMaxThreads, "] (got ",
                                spec->threads_per_worker(), ")"));
  }
  if (spec->calib_batch() < 0) {
    return Invalid(absl::StrCat("calib_batch must be >= 0 (got ", spec->calib_batch(), ")"));
  }
  if (spec->experts_per_task() < -1) {
    return Invalid(absl::StrCat("experts_per_task must be -1 (whole blocks), 0 (the default) "
                                "or a count of experts (got ", spec->experts_per_task(), ")"));
  }
  if (spec->name().size() > 128) return Invalid("name is longer than 128 bytes");

  if (spec->recipe_yaml().empty()) {
    return Invalid(absl::StrCat("recipe '", spec->recipe_path(), "' is empty"));
  }
  const std::string source = spec->recipe_path().empty() ? "recipe" : spec->recipe_path();
  StatusOr<Recipe> recipe = ParseRecipe(spec->recipe_yaml(), source);
  if (!recipe.ok()) return Invalid(std::string(recipe.status().message()));

  QCAL_ASSIGN_OR_RETURN(std::string model_dir, NormalizeAbsolute("model_dir", spec->model_dir()));
  spec->set_model_dir(model_dir);
  QCAL_ASSIGN_OR_RETURN(std::string out_dir, NormalizeAbsolute("out_dir", spec->out_dir()));
  spec->set_out_dir(out_dir);
  if (!spec->job_dir().empty()) {
    QCAL_ASSIGN_OR_RETURN(std::string job_dir, NormalizeAbsolute("job_dir", spec->job_dir()));
    spec->set_job_dir(job_dir);
  }
  bool relative_calibration = false;
  for (const std::string& f : recipe->calibration.files) {
    relative_calibration |= f.empty() || f[0] != '/';
  }
  if (relative_calibration && recipe->needs().reads_calibration_text()) {
    QCAL_ASSIGN_OR_RETURN(std::string root, NormalizeAbsolute("data_root", spec->data_root()));
    spec->set_data_root(root);
  }
  // The same checks `qcal quantize` makes, on the spec resolved as the workers will resolve it
  // (runner/job_inputs.h). The stored spec keeps what the user gave.
  v1::JobSpec resolved = *spec;
  ResolveJobSpec(&resolved);
  StatusOr<LlamaConfig> config = CheckJobInputs(*recipe, resolved);
  if (!config.ok()) return Invalid(std::string(config.status().message()));
  if (spec->max_memory_bytes() < 0) {
    return Invalid(absl::StrCat("max_memory_bytes must be >= 0 (got ", spec->max_memory_bytes(),
                                ")"));
  }
  const v1::EvalSpec& eval = spec->eval();
  if (eval.data_size() > 16) return Invalid("eval: at most 16 data files");
  if (eval.data_size() > 0 && eval.ctx() != 0 && eval.ctx() < 2) {
    return Invalid(absl::StrCat("eval.ctx must be at least 2 (got ", eval.ctx(), ")"));
  }
  if (eval.data_size() > 0 && eval.ctx() > config->max_position_embeddings) {
    return Invalid(absl::StrCat("eval.ctx ", eval.ctx(), " exceeds the model's context of ",
                                config->max_position_embeddings));
  }
  for (v1::EvalData& d : *spec->mutable_eval()->mutable_data()) {
    if (d.label().empty() || d.label().size() > 64) {
      return Invalid("eval: every data file needs a label of 1..64 bytes");
    }
    const std::string path =
        !d.path().empty() && d.path()[0] == '/' ? d.path() : spec->data_root() + "/" + d.path();
    const std::string what = absl::StrCat("eval data '", d.label(), "'");
    QCAL_RETURN_IF_ERROR(CheckReadableFile(what, path));
    // Canonical, as every other path of the spec (the user's read roots are checked on it).
    StatusOr<std::string> canonical = CanonicalPath(path);
    if (!canonical.ok()) return Invalid(absl::StrCat(what, ": ", canonical.status().message()));
    d.set_path(*canonical);
  }
  return recipe;
}

}  // namespace qcal::coordinator
