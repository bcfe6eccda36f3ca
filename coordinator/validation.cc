#include "coordinator/validation.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/hf_config.h"
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
  std::string p = fs::path(path).lexically_normal().string();
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

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

Status CheckReadableDirectory(const char* field, const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    return Invalid(err == ENOENT
                       ? absl::StrCat(field, " '", path, "' does not exist")
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

// An output directory: outside the model, a directory if it exists, creatable otherwise.
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
  // The nearest existing ancestor must let us create the rest.
  fs::path ancestor = fs::path(path).parent_path();
  while (!ancestor.empty() && ::stat(ancestor.c_str(), &st) != 0) ancestor = ancestor.parent_path();
  if (ancestor.empty()) ancestor = "/";
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

StatusOr<Recipe> ValidateJobSpec(v1::JobSpec* spec) {
  if (spec->workers() < 1) {
    return Invalid(absl::StrCat("workers must be at least 1 (got ", spec->workers(), ")"));
  }
  if (spec->workers() > kMaxWorkers) {
    return Invalid(absl::StrCat("workers must be at most ", kMaxWorkers, " (got ",
                                spec->workers(), ")"));
  }
  if (spec->threads_per_worker() < 0) {
    return Invalid(absl::StrCat("threads_per_worker must be >= 0 (got ",
                                spec->threads_per_worker(), ")"));
  }
  if (spec->calib_batch() < 0) {
    return Invalid(absl::StrCat("calib_batch must be >= 0 (got ", spec->calib_batch(), ")"));
  }
  if (spec->name().size() > 128) return Invalid("name is longer than 128 bytes");
  for (unsigned char c : spec->name()) {
    if (c < 0x20 || c == 0x7f) return Invalid("name contains control characters");
  }

  if (spec->recipe_yaml().empty()) {
    return Invalid(absl::StrCat("recipe '", spec->recipe_path(), "' is empty"));
  }
  const std::string source = spec->recipe_path().empty() ? "recipe" : spec->recipe_path();
  StatusOr<Recipe> recipe = ParseRecipe(spec->recipe_yaml(), source);
  if (!recipe.ok()) return Invalid(std::string(recipe.status().message()));

  QCAL_ASSIGN_OR_RETURN(std::string model_dir, NormalizeAbsolute("model_dir", spec->model_dir()));
  spec->set_model_dir(model_dir);
  QCAL_RETURN_IF_ERROR(CheckReadableDirectory("model_dir", model_dir));
  QCAL_RETURN_IF_ERROR(CheckReadableFile("model config", model_dir + "/config.json"));
  StatusOr<LlamaConfig> config = LoadLlamaConfig(model_dir + "/config.json");
  if (!config.ok()) return Invalid(std::string(config.status().message()));

  QCAL_ASSIGN_OR_RETURN(std::string out_dir, NormalizeAbsolute("out_dir", spec->out_dir()));
  spec->set_out_dir(out_dir);
  QCAL_RETURN_IF_ERROR(CheckOutputDir("out_dir", out_dir, model_dir));
  if (!spec->job_dir().empty()) {
    QCAL_ASSIGN_OR_RETURN(std::string job_dir, NormalizeAbsolute("job_dir", spec->job_dir()));
    spec->set_job_dir(job_dir);
  }
  const std::string job_dir = spec->job_dir().empty() ? out_dir + ".job" : spec->job_dir();
  QCAL_RETURN_IF_ERROR(CheckOutputDir("job_dir", job_dir, model_dir));

  const MethodNeeds needs = recipe->needs();
  const bool calibrates = needs.float_hessians || needs.float_activations || needs.end_to_end ||
                          needs.sequential;
  if (calibrates) {
    if (recipe->calibration.files.empty()) {
      return Invalid(absl::StrCat(source, ": the recipe calibrates but lists no calibration files"));
    }
    bool relative = false;
    for (const std::string& f : recipe->calibration.files) relative |= f.empty() || f[0] != '/';
    if (relative) {
      QCAL_ASSIGN_OR_RETURN(std::string root, NormalizeAbsolute("data_root", spec->data_root()));
      spec->set_data_root(root);
      QCAL_RETURN_IF_ERROR(CheckReadableDirectory("data_root", root));
    }
    for (const std::string& f : recipe->calibration.files) {
      const std::string path = !f.empty() && f[0] == '/' ? f : spec->data_root() + "/" + f;
      QCAL_RETURN_IF_ERROR(CheckReadableFile(
          absl::StrCat("calibration file (", source, ": '", f, "')"), path));
    }
  }
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
  for (const v1::EvalData& d : eval.data()) {
    if (d.label().empty() || d.label().size() > 64) {
      return Invalid("eval: every data file needs a label of 1..64 bytes");
    }
    const std::string path =
        !d.path().empty() && d.path()[0] == '/' ? d.path() : spec->data_root() + "/" + d.path();
    QCAL_RETURN_IF_ERROR(CheckReadableFile(absl::StrCat("eval data '", d.label(), "'"), path));
  }
  return recipe;
}

}  // namespace qcal::coordinator
