#include "common/recipe.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/utf8.h"

namespace qcal {
namespace {

using json = nlohmann::json;

// Calibration text used when a recipe names none: WikiText-2's validation split is standard
// calibration text and distinct from every test set we report perplexity on.
constexpr char kDefaultCalibrationFile[] = "data/wikitext2/wiki.valid.tokens";
// Recipes are a few hundred bytes; a larger file is almost certainly the wrong path.
constexpr std::streamoff kMaxRecipeBytes = 1 << 20;
// Bounds that keep every size computed from a recipe far inside what a machine can allocate (a
// 70B calibration uses thousands of sequences of a few thousand tokens): a larger value is a typo,
// refused with the key and the limit rather than failing an allocation later.
constexpr int64_t kMaxSequences = 1 << 20;
constexpr int64_t kMaxSeqLen = 1 << 20;
constexpr int64_t kMaxCalibrationTokens = int64_t{1} << 31;
constexpr int64_t kMaxEpochs = 1 << 16;
constexpr int64_t kMaxFinetuneBatch = 1 << 20;

const std::vector<std::string> kCommonKeys = {"name", "method", "seed", "calibration",
                                              "finetune"};
const std::vector<std::string> kStageKeys = {"epochs", "lr", "batch", "holdout"};
const std::vector<std::string> kEndToEndKeys = {"enabled", "epochs", "lr", "batch", "holdout"};

Status ReadStage(const RecipeSection& section, FinetuneStage* stage) {
  QCAL_RETURN_IF_ERROR(section.ReadBool("enabled", &stage->enabled));
  QCAL_RETURN_IF_ERROR(section.ReadInt("epochs", &stage->epochs));
  QCAL_RETURN_IF_ERROR(section.ReadDouble("lr", &stage->lr));
  QCAL_RETURN_IF_ERROR(section.ReadInt("batch", &stage->batch));
  QCAL_RETURN_IF_ERROR(section.ReadDouble("holdout", &stage->holdout));
  QCAL_RETURN_IF_ERROR(section.RequireRange(
      "epochs", stage->epochs >= 1 && stage->epochs <= kMaxEpochs,
      absl::StrCat("in [1, ", kMaxEpochs, "]"), std::to_string(stage->epochs)));
  QCAL_RETURN_IF_ERROR(
      section.RequireRange("lr", stage->lr > 0, "greater than 0", FormatDouble(stage->lr)));
  QCAL_RETURN_IF_ERROR(section.RequireRange(
      "batch", stage->batch >= 1 && stage->batch <= kMaxFinetuneBatch,
      absl::StrCat("in [1, ", kMaxFinetuneBatch, "]"), std::to_string(stage->batch)));
  QCAL_RETURN_IF_ERROR(section.RequireRange("holdout", stage->holdout >= 0 && stage->holdout < 1,
                                            "in [0, 1)", FormatDouble(stage->holdout)));
  return Status();
}

json StageJson(const FinetuneStage& stage, bool with_enabled) {
  json j = {{"epochs", stage.epochs}, {"lr", stage.lr}, {"batch", stage.batch},
            {"holdout", stage.holdout}};
  if (with_enabled) j["enabled"] = stage.enabled;
  return j;
}

// JoinList({"quip", "rtn", "gptq"}, "or") = "quip, rtn or gptq"
std::string JoinList(const std::vector<std::string>& names, const char* conjunction) {
  if (names.size() <= 1) return absl::StrJoin(names, "");
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "), " ", conjunction, " ",
                      names.back());
}

std::vector<std::string> MethodNames(const std::vector<const MethodSpec*>& methods) {
  std::vector<std::string> names;
  for (const MethodSpec* m : methods) names.push_back(m->name());
  return names;
}

Status ReadCalibration(const RecipeSection& top, CalibrationSpec* spec) {
  QCAL_ASSIGN_OR_RETURN(
      RecipeSection calibration,
      top.ReadSection("calibration", {"files", "num_sequences", "seq_len", "seed", "precision",
                                      "moe_route_all", "moe_min_tokens"}));
  spec->files = {kDefaultCalibrationFile};
  if (const RecipeSection::Entry* files = calibration.Find("files")) {
    if (!files->value.IsSequence()) {
      return calibration.TypeError("files", "a list of file paths", files->value);
    }
    if (files->value.size() == 0) {
      return calibration.KeyError("files", "must list at least one file");
    }
    spec->files.clear();
    for (size_t i = 0; i < files->value.size(); ++i) {
      const YAML::Node item = files->value[i];
      if (!item.IsScalar() || item.Scalar().empty()) {
        return calibration.Error(absl::StrCat("key '", calibration.Path("files"), "' item ", i + 1,
                                              " (line ", LineOf(item),
                                              ") must be a non-empty file path, got ",
                                              DescribeYaml(item)));
      }
      spec->files.push_back(item.Scalar());
    }
  }
  QCAL_RETURN_IF_ERROR(calibration.ReadInt("num_sequences", &spec->num_sequences));
  QCAL_RETURN_IF_ERROR(calibration.RequireRange(
      "num_sequences", spec->num_sequences >= 1 && spec->num_sequences <= kMaxSequences,
      absl::StrCat("in [1, ", kMaxSequences, "]"), std::to_string(spec->num_sequences)));
  QCAL_RETURN_IF_ERROR(calibration.ReadInt("seq_len", &spec->seq_len));
  QCAL_RETURN_IF_ERROR(calibration.RequireRange(
      "seq_len", spec->seq_len >= 2 && spec->seq_len <= kMaxSeqLen,
      absl::StrCat("in [2, ", kMaxSeqLen, "]"), std::to_string(spec->seq_len)));
  QCAL_RETURN_IF_ERROR(calibration.RequireRange(
      "num_sequences", spec->num_sequences * spec->seq_len <= kMaxCalibrationTokens,
      absl::StrCat("such that num_sequences × seq_len is at most ", kMaxCalibrationTokens,
                   " tokens"),
      absl::StrCat(spec->num_sequences, " × ", spec->seq_len)));
  QCAL_RETURN_IF_ERROR(calibration.ReadChoice("precision", {"fp32", "bf16"}, &spec->precision));
  QCAL_RETURN_IF_ERROR(calibration.ReadBool("moe_route_all", &spec->moe_route_all));
  QCAL_RETURN_IF_ERROR(calibration.ReadInt("moe_min_tokens", &spec->moe_min_tokens));
  QCAL_RETURN_IF_ERROR(calibration.RequireRange(
      "moe_min_tokens", spec->moe_min_tokens >= -1,
      ">= 0, or -1 for the model's hidden size", std::to_string(spec->moe_min_tokens)));
  return calibration.ReadUint("seed", &spec->seed);
}

StatusOr<Recipe> ParseDocument(const YAML::Node& root, const std::string& source,
                               const std::vector<const MethodSpec*>& methods) {
  // Every key of every method is known at the top level, so a typo gets a suggestion and another
  // method's key gets the message below naming its methods.
  std::vector<std::string> known = kCommonKeys;
  for (const MethodSpec* m : methods) {
    for (const std::string& key : m->keys()) {
      if (std::find(known.begin(), known.end(), key) == known.end()) known.push_back(key);
    }
  }
  RecipeSection top(source, "");
  QCAL_RETURN_IF_ERROR(top.Load(root, known));
  Recipe recipe;
  const std::vector<std::string> names = MethodNames(methods);

  // --- method (required) ---
  if (!top.Has("method")) {
    return top.Error(absl::StrCat("missing required key 'method' (", JoinList(names, "or"), ")"));
  }
  QCAL_RETURN_IF_ERROR(top.ReadString("method", &recipe.method));
  const MethodSpec* spec = nullptr;
  for (const MethodSpec* m : methods) {
    if (recipe.method == m->name()) spec = m;
  }
  if (spec == nullptr) {
    std::string message = absl::StrCat("must be one of ", absl::StrJoin(names, ", "), ", got '",
                                       Printable(recipe.method), "'");
    const std::string suggestion = ClosestWithin2(recipe.method, names);
    if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
    return top.KeyError("method", message);
  }
  // Keys of other methods.
  const std::vector<std::string> own = spec->keys();
  for (const std::string& key : top.Keys()) {
    if (std::find(kCommonKeys.begin(), kCommonKeys.end(), key) != kCommonKeys.end() ||
        std::find(own.begin(), own.end(), key) != own.end()) {
      continue;
    }
    std::vector<std::string> owners;
    for (const MethodSpec* m : methods) {
      const std::vector<std::string> keys = m->keys();
      if (std::find(keys.begin(), keys.end(), key) != keys.end()) owners.push_back(m->name());
    }
    return top.KeyError(key, absl::StrCat("applies only to method", owners.size() > 1 ? "s " : " ",
                                          JoinList(owners, "and"), ", not ", recipe.method));
  }

  // --- name ---
  recipe.name = FileStem(source);
  QCAL_RETURN_IF_ERROR(top.ReadString("name", &recipe.name));
  if (recipe.name.empty()) {
    if (top.Has("name")) return top.KeyError("name", "must not be empty");
    return top.Error("no 'name' given and the file name has no stem to default to");
  }

  // --- seed, calibration, finetune ---
  QCAL_RETURN_IF_ERROR(top.ReadUint("seed", &recipe.seed));
  QCAL_RETURN_IF_ERROR(ReadCalibration(top, &recipe.calibration));
  QCAL_ASSIGN_OR_RETURN(RecipeSection finetune,
                        top.ReadSection("finetune", {"enabled", "block", "end_to_end"}));
  QCAL_RETURN_IF_ERROR(finetune.ReadBool("enabled", &recipe.finetune.enabled));
  QCAL_ASSIGN_OR_RETURN(
      RecipeSection block,
      finetune.ReadSection("block", kStageKeys,
                           {{"enabled",
                             "within-block fine-tuning is switched by 'finetune.enabled'"}}));
  QCAL_RETURN_IF_ERROR(ReadStage(block, &recipe.finetune.block));
  recipe.finetune.block.enabled = recipe.finetune.enabled;
  QCAL_ASSIGN_OR_RETURN(RecipeSection end_to_end,
                        finetune.ReadSection("end_to_end", kEndToEndKeys));
  QCAL_RETURN_IF_ERROR(ReadStage(end_to_end, &recipe.finetune.end_to_end));

  // --- the method's own keys ---
  QCAL_ASSIGN_OR_RETURN(recipe.config, spec->Parse(top, recipe));
  if (!recipe.config->needs().supports_finetune) {
    const std::string why = absl::StrCat("is not supported with method ", recipe.method);
    if (recipe.finetune.enabled) return finetune.KeyError("enabled", why);
    if (recipe.finetune.end_to_end.enabled) return end_to_end.KeyError("enabled", why);
  }
  return recipe;
}

// Counts the documents in `text`, stopping at 2 (all a recipe needs to know). Not YAML::LoadAll:
// in yaml-cpp 0.7 it loops forever, allocating, on text such as ",\n" (jbeder/yaml-cpp#1040,
// fixed upstream by #1319, "leave at first empty root"); this loop makes at most two passes.
class DocumentCounter final : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override { start = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
  YAML::Mark start;
};

int CountDocuments(const std::string& text, YAML::Mark* second_start) {
  std::istringstream stream(text);
  YAML::Parser parser(stream);
  DocumentCounter counter;
  int count = 0;
  while (count < 2 && parser.HandleNextDocument(counter)) {
    ++count;
    if (count == 2) *second_start = counter.start;
  }
  return count;
}

// Whether `text` holds anything besides blank lines, comments and document markers.
bool HasContent(const std::string& text) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    if (line.compare(first, 3, "---") == 0 || line.compare(first, 3, "...") == 0) {
      const size_t rest = line.find_first_not_of(" \t\r", first + 3);
      if (rest == std::string::npos || line[rest] == '#') continue;
    }
    return true;
  }
  return false;
}

}  // namespace

MethodNeeds Recipe::needs() const {
  MethodNeeds needs = config ? config->needs() : MethodNeeds{};
  needs.float_activations = needs.float_activations || finetune.enabled;
  needs.end_to_end = needs.end_to_end || finetune.end_to_end.enabled;
  needs.expert_parts = needs.expert_parts && !finetune.enabled && !needs.sequential;
  return needs;
}

nlohmann::json Recipe::ToJson() const {
  // The common keys, then the method's: every setting that applies to the method and nothing
  // else, so ParseRecipe(ToJson().dump()) gives back this recipe.
  json j = {{"name", name}, {"method", method}, {"seed", seed}};
  j["calibration"] = {{"files", calibration.files},
                      {"num_sequences", calibration.num_sequences},
                      {"seq_len", calibration.seq_len},
                      {"seed", calibration.seed},
                      {"precision", calibration.precision}};
  // The MoE keys only when set: every other recipe's JSON (and the checkpoints that carry it)
  // stays as it was.
  if (calibration.moe_route_all) j["calibration"]["moe_route_all"] = true;
  if (calibration.moe_min_tokens != -1) {
    j["calibration"]["moe_min_tokens"] = calibration.moe_min_tokens;
  }
  j["finetune"] = {{"enabled", finetune.enabled},
                   {"block", StageJson(finetune.block, /*with_enabled=*/false)},
                   {"end_to_end", StageJson(finetune.end_to_end, /*with_enabled=*/true)}};
  if (config) config->AddToJson(&j);
  return j;
}

StatusOr<Recipe> ParseRecipeWith(const std::string& yaml_text, const std::string& source_in,
                                 const std::vector<const MethodSpec*>& methods) {
  const std::string source = source_in.empty() ? "<recipe>" : source_in;
  // YAML is Unicode text, and a recipe's strings end up in JSON (the journal, the job record) and
  // protobuf messages, both of which require UTF-8: refuse other bytes here, for every path.
  if (const std::string where = DescribeInvalidUtf8(yaml_text); !where.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not UTF-8 text at ", where, "; a recipe must be UTF-8"));
  }
  // YAML does not allow C0 control characters other than tab, LF and CR (nor DEL) in a stream;
  // yaml-cpp reads a NUL inside a scalar as a stray 0xA0 byte, which is not UTF-8.
  {
    int line = 1;
    size_t line_start = 0;
    for (size_t i = 0; i < yaml_text.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(yaml_text[i]);
      if (c == '\n') {
        ++line;
        line_start = i + 1;
      } else if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7F) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: control character 0x%02x at line %d, byte %d; YAML does not allow it", source,
            c, line, static_cast<int>(i - line_start + 1)));
      }
    }
  }
  YAML::Node root;
  int document_count = 0;
  YAML::Mark second_document;
  try {
    root = YAML::Load(yaml_text);
    // An empty first document is reported below; counting after one could meet the LoadAll bug's
    // endless empty documents, which would read as a second document.
    if (!root.IsNull()) document_count = CountDocuments(yaml_text, &second_document);
  } catch (const YAML::DeepRecursion& e) {
    // yaml-cpp's own message for this is "bad file".
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": YAML nested too deeply at line ", e.mark.line + 1, ", column ",
        e.mark.column + 1, " (", e.depth(), " levels; a recipe needs a handful)"));
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": YAML error: ", e.msg));
    }
    // YAML forbids tabs in indentation, and yaml-cpp's message for them ("illegal map value")
    // does not say so.
    std::string hint;
    size_t line_start = 0;
    for (int line = 0; line < e.mark.line && line_start != std::string::npos; ++line) {
      line_start = yaml_text.find('\n', line_start);
      if (line_start != std::string::npos) ++line_start;
    }
    if (line_start != std::string::npos && line_start < yaml_text.size()) {
      const size_t indent_end = yaml_text.find_first_not_of(" \t", line_start);
      const std::string indent = yaml_text.substr(line_start, indent_end - line_start);
      if (indent.find('\t') != std::string::npos) hint = " (YAML indentation must use spaces, not tabs)";
    }
    return absl::InvalidArgumentError(absl::StrCat(source, ": YAML error at line ",
                                                   e.mark.line + 1, ", column ", e.mark.column + 1,
                                                   ": ", e.msg, hint));
  }
  if (root.IsNull()) {
    if (HasContent(yaml_text)) {
      // yaml-cpp 0.7 reads some malformed text (a line starting with ',') as an empty document.
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": YAML error: the text does not read as a mapping of keys to values"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the recipe is empty; 'method' (", JoinList(MethodNames(methods), "or"),
        ") is required"));
  }
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": a recipe must be a mapping of keys to values, got ", DescribeYaml(root)));
  }
  if (document_count > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": holds more than one YAML document (the second starts at line ",
                     second_document.line + 1, "); a recipe is one document"));
  }
  try {
    return ParseDocument(root, source, methods);
  } catch (const std::exception& e) {
    // Node accessors throw only on misuse; keep the file name if one ever does.
    return absl::InternalError(absl::StrCat(source, ": reading the recipe: ", e.what()));
  }
}

StatusOr<Recipe> LoadRecipeWith(const std::string& path,
                                const std::vector<const MethodSpec*>& methods) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    const int error = errno;
    const std::string message = absl::StrCat(path, ": cannot open: ", std::strerror(error));
    if (error == ENOENT || error == ENOTDIR) return absl::NotFoundError(message);
    if (error == EACCES) return absl::PermissionDeniedError(message);
    return absl::FailedPreconditionError(message);
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::DataLossError(absl::StrCat(path, ": cannot read"));
  if (size > kMaxRecipeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes is too large for a recipe (limit ",
                     kMaxRecipeBytes, ")"));
  }
  in.seekg(0, std::ios::beg);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), size)) {
    return absl::DataLossError(absl::StrCat(path, ": read failed"));
  }
  return ParseRecipeWith(text, path, methods);
}

}  // namespace qcal
