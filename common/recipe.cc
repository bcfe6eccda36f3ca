#include "common/recipe.h"

#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace qcal {
namespace {

using json = nlohmann::json;

// Calibration text used when a recipe names none: WikiText-2's validation split is standard
// calibration text and distinct from every test set we report perplexity on.
constexpr char kDefaultCalibrationFile[] = "data/wikitext2/wiki.valid.tokens";
// Recipes are a few hundred bytes; a larger file is almost certainly the wrong path.
constexpr std::streamoff kMaxRecipeBytes = 1 << 20;

struct CodebookInfo {
  const char* name;
  int bits;
};
constexpr CodebookInfo kCodebooks[] = {
    {"e8p", 2},      {"rvq3_e8p_e8", 3}, {"rvq4_e8p_e8p", 4},
    {"halfint2", 2}, {"halfint3", 3},    {"halfint4", 4},
};

const char* DefaultCodebookForBits(int bits) {
  switch (bits) {
    case 2: return "e8p";
    case 3: return "rvq3_e8p_e8";
    case 4: return "rvq4_e8p_e8p";
    default: return nullptr;
  }
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions), case-folded, so
// "bitz", "btis" and "Bits" are all one edit from "bits".
int EditDistance(const std::string& a_in, const std::string& b_in) {
  auto lower = [](std::string s) {
    for (char& c : s) {
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    }
    return s;
  };
  const std::string a = lower(a_in), b = lower(b_in);
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1, 0));
  for (size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

// The closest candidate within edit distance 2, or "" when none is that close.
std::string ClosestWithin2(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  int best_distance = 3;
  for (const std::string& candidate : candidates) {
    const int distance = EditDistance(word, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best;
}

// Scalars from the file, made safe to echo in an error message.
std::string Printable(const std::string& text, size_t max_len = 60) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max_len; ++i) {
    const unsigned char u = static_cast<unsigned char>(text[i]);
    out.push_back(u >= 0x20 && u < 0x7f ? text[i] : '?');
  }
  if (text.size() > max_len) out += "...";
  return out;
}

int LineOf(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  return mark.is_null() ? 0 : mark.line + 1;
}

// How a value appears in "got ..." messages.
std::string Describe(const YAML::Node& value) {
  switch (value.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return "an empty value";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Scalar:
      break;
  }
  if (value.Tag() == "!") return absl::StrCat("the quoted string \"", Printable(value.Scalar()), "\"");
  return absl::StrCat("'", Printable(value.Scalar()), "'");
}

// A plain (unquoted, untagged-as-string) scalar: the only form numbers and booleans take.
bool IsPlainScalar(const YAML::Node& value) {
  return value.IsScalar() && value.Tag() != "!" && value.Tag() != "tag:yaml.org,2002:str";
}

// One mapping of the recipe after its keys were checked: every key known, none repeated.
// Keeps the key nodes for line numbers in later errors.
class Section {
 public:
  struct Entry {
    YAML::Node key;
    YAML::Node value;
  };

  Section(std::string source, std::string path)
      : source_(std::move(source)), path_(std::move(path)) {}

  // Checks `map`'s keys against `known`. `hints` maps a key that is wrong here to advice.
  Status Load(const YAML::Node& map, const std::vector<std::string>& known,
              const std::vector<std::pair<std::string, std::string>>& hints = {}) {
    for (auto it = map.begin(); it != map.end(); ++it) {
      const YAML::Node key = it->first;
      if (!key.IsScalar()) {
        return Error(absl::StrCat("a key at line ", LineOf(key), Where(), " is ", Describe(key),
                                  "; keys must be plain names"));
      }
      const std::string name = key.Scalar();
      bool is_known = false;
      for (const std::string& k : known) is_known = is_known || k == name;
      if (!is_known) {
        std::string message =
            absl::StrCat("unknown key '", Printable(Path(name)), "' (line ", LineOf(key), ")");
        bool hinted = false;
        for (const auto& [wrong, advice] : hints) {
          if (wrong == name) {
            absl::StrAppend(&message, "; ", advice);
            hinted = true;
          }
        }
        const std::string suggestion = ClosestWithin2(name, known);
        if (!hinted && !suggestion.empty()) {
          absl::StrAppend(&message, "; did you mean '", Path(suggestion), "'?");
        } else if (!hinted) {
          absl::StrAppend(&message, "; known keys", Where(), ": ", absl::StrJoin(known, ", "));
        }
        return Error(message);
      }
      for (const Entry& entry : entries_) {
        if (entry.key.Scalar() == name) {
          return Error(absl::StrCat("duplicate key '", Path(name), "' (line ", LineOf(key),
                                    ", first at line ", LineOf(entry.key), ")"));
        }
      }
      entries_.push_back({key, it->second});
    }
    return Status();
  }

  const Entry* Find(const std::string& name) const {
    for (const Entry& entry : entries_) {
      if (entry.key.Scalar() == name) return &entry;
    }
    return nullptr;
  }
  bool Has(const std::string& name) const { return Find(name) != nullptr; }
  int Line(const std::string& name) const {
    const Entry* entry = Find(name);
    return entry ? LineOf(entry->key) : 0;
  }

  std::string Path(const std::string& name) const {
    return path_.empty() ? name : absl::StrCat(path_, ".", name);
  }
  // "key 'calibration.seq_len' (line 7)"
  std::string KeyRef(const std::string& name) const {
    return absl::StrCat("key '", Path(name), "' (line ", Line(name), ")");
  }
  Status Error(const std::string& message) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", message));
  }
  Status KeyError(const std::string& name, const std::string& message) const {
    return Error(absl::StrCat(KeyRef(name), " ", message));
  }
  Status TypeError(const std::string& name, const char* expected, const YAML::Node& got) const {
    return KeyError(name, absl::StrCat("must be ", expected, ", got ", Describe(got)));
  }

  // Readers: leave *out untouched when the key is absent.
  Status ReadInt(const std::string& name, int64_t* out) const {
    const Entry* entry = Find(name);
    if (!entry) return Status();
    const YAML::Node& v = entry->value;
    if (!IsPlainScalar(v)) return TypeError(name, "an integer", v);
    const std::string& s = v.Scalar();
    size_t start = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
    bool digits = s.size() > start;
    for (size_t i = start; i < s.size(); ++i) digits = digits && s[i] >= '0' && s[i] <= '9';
    if (!digits) return TypeError(name, "an integer", v);
    errno = 0;
    const long long value = std::strtoll(s.c_str(), nullptr, 10);
    if (errno == ERANGE) return KeyError(name, absl::StrCat("is out of range: ", Printable(s)));
    *out = value;
    return Status();
  }

  Status ReadUint(const std::string& name, uint64_t* out) const {
    const Entry* entry = Find(name);
    if (!entry) return Status();
    const YAML::Node& v = entry->value;
    if (!IsPlainScalar(v)) return TypeError(name, "a non-negative integer", v);
    const std::string& s = v.Scalar();
    const size_t start = (!s.empty() && s[0] == '+') ? 1 : 0;
    bool digits = s.size() > start;
    for (size_t i = start; i < s.size(); ++i) digits = digits && s[i] >= '0' && s[i] <= '9';
    if (!digits) return TypeError(name, "a non-negative integer", v);
    errno = 0;
    const unsigned long long value = std::strtoull(s.c_str() + start, nullptr, 10);
    if (errno == ERANGE) return KeyError(name, absl::StrCat("is out of range: ", Printable(s)));
    *out = value;
    return Status();
  }

  Status ReadDouble(const std::string& name, double* out) const {
    const Entry* entry = Find(name);
    if (!entry) return Status();
    const YAML::Node& v = entry->value;
    if (!IsPlainScalar(v)) return TypeError(name, "a number", v);
    const std::string& s = v.Scalar();
    // Decimal and exponent forms only: no inf/nan/hex, which no setting here can use.
    bool chars_ok = !s.empty();
    for (char c : s) {
      chars_ok = chars_ok && ((c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' ||
                              c == '+' || c == '-');
    }
    const size_t start = (!s.empty() && s[0] == '+') ? 1 : 0;
    double value = 0;
    if (chars_ok) {
      const char* first = s.data() + start;
      const char* last = s.data() + s.size();
      const auto [ptr, ec] = std::from_chars(first, last, value);
      chars_ok = ec == std::errc() && ptr == last;
    }
    if (!chars_ok || !std::isfinite(value)) return TypeError(name, "a number", v);
    *out = value;
    return Status();
  }

  Status ReadBool(const std::string& name, bool* out) const {
    const Entry* entry = Find(name);
    if (!entry) return Status();
    const YAML::Node& v = entry->value;
    // YAML 1.2 core schema booleans only (not yes/no/on/off, which YAML 1.1 readers disagree on).
    if (IsPlainScalar(v)) {
      const std::string& s = v.Scalar();
      if (s == "true" || s == "True" || s == "TRUE") {
        *out = true;
        return Status();
      }
      if (s == "false" || s == "False" || s == "FALSE") {
        *out = false;
        return Status();
      }
    }
    return TypeError(name, "a boolean (true or false)", v);
  }

  Status ReadString(const std::string& name, std::string* out) const {
    const Entry* entry = Find(name);
    if (!entry) return Status();
    if (!entry->value.IsScalar()) return TypeError(name, "a string", entry->value);
    *out = entry->value.Scalar();
    return Status();
  }

  // A nested mapping; absent is fine (returns an empty section).
  StatusOr<Section> ReadSection(const std::string& name, const std::vector<std::string>& known,
                                const std::vector<std::pair<std::string, std::string>>& hints =
                                    {}) const {
    Section section(source_, Path(name));
    const Entry* entry = Find(name);
    if (!entry) return section;
    if (!entry->value.IsMap()) return TypeError(name, "a mapping", entry->value);
    QCAL_RETURN_IF_ERROR(section.Load(entry->value, known, hints));
    return section;
  }

  Status RequireRange(const std::string& name, bool ok, const std::string& rule,
                      const std::string& got) const {
    if (ok || !Has(name)) return Status();
    return KeyError(name, absl::StrCat("must be ", rule, ", got ", got));
  }

  const std::string& source() const { return source_; }

 private:
  std::string Where() const { return path_.empty() ? "" : absl::StrCat(" in '", path_, "'"); }

  std::string source_;
  std::string path_;
  std::vector<Entry> entries_;
};

std::string FormatDouble(double value) {
  std::ostringstream out;
  out.precision(std::numeric_limits<double>::max_digits10);
  out << value;
  return out.str();
}

// "jobs/quip-e8p-2bit.yaml" -> "quip-e8p-2bit".
std::string FileStem(const std::string& path) {
  std::string base = path;
  const size_t slash = base.find_last_of('/');
  if (slash != std::string::npos) base = base.substr(slash + 1);
  const size_t dot = base.find_last_of('.');
  if (dot != std::string::npos && dot > 0) base = base.substr(0, dot);
  return base;
}

const std::vector<std::string> kStageKeys = {"epochs", "lr", "batch", "holdout"};
const std::vector<std::string> kEndToEndKeys = {"enabled", "epochs", "lr", "batch", "holdout"};

Status ReadStage(const Section& section, FinetuneStage* stage) {
  QCAL_RETURN_IF_ERROR(section.ReadBool("enabled", &stage->enabled));
  QCAL_RETURN_IF_ERROR(section.ReadInt("epochs", &stage->epochs));
  QCAL_RETURN_IF_ERROR(section.ReadDouble("lr", &stage->lr));
  QCAL_RETURN_IF_ERROR(section.ReadInt("batch", &stage->batch));
  QCAL_RETURN_IF_ERROR(section.ReadDouble("holdout", &stage->holdout));
  QCAL_RETURN_IF_ERROR(section.RequireRange("epochs", stage->epochs >= 1, "at least 1",
                                            std::to_string(stage->epochs)));
  QCAL_RETURN_IF_ERROR(
      section.RequireRange("lr", stage->lr > 0, "greater than 0", FormatDouble(stage->lr)));
  QCAL_RETURN_IF_ERROR(section.RequireRange("batch", stage->batch >= 1, "at least 1",
                                            std::to_string(stage->batch)));
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

// A string key restricted to `allowed`, with a suggestion for near misses.
Status ReadChoice(const Section& section, const std::string& name,
                  const std::vector<std::string>& allowed, std::string* out) {
  QCAL_RETURN_IF_ERROR(section.ReadString(name, out));
  for (const std::string& a : allowed) {
    if (*out == a) return Status();
  }
  std::string message = absl::StrCat("must be ", absl::StrJoin(allowed, " or "), ", got '",
                                     Printable(*out), "'");
  const std::string suggestion = ClosestWithin2(*out, allowed);
  if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
  return section.KeyError(name, message);
}

// rotation, activations and kv_cache (method quarot).
Status ReadQuarotSections(const Section& top, Recipe* recipe) {
  // --- rotation ---
  QCAL_ASSIGN_OR_RETURN(
      Section rotation,
      top.ReadSection("rotation", {"enabled", "r1", "r2", "r3", "r4", "seed"}));
  RotationSpec& rot = recipe->rotation;
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("enabled", &rot.enabled));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r1", &rot.r1));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r2", &rot.r2));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r3", &rot.r3));
  QCAL_RETURN_IF_ERROR(rotation.ReadBool("r4", &rot.r4));
  QCAL_RETURN_IF_ERROR(rotation.ReadUint("seed", &rot.seed));

  // --- activations ---
  QCAL_ASSIGN_OR_RETURN(
      Section act, top.ReadSection("activations",
                                   {"bits", "clip", "granularity", "static", "symmetric"}));
  ActivationQuantSpec& a = recipe->activations;
  if (top.Has("activations") && !act.Has("bits")) {
    return top.KeyError("activations", "needs 'bits' (2..8, or 16 for float activations)");
  }
  int64_t bits = a.bits;
  QCAL_RETURN_IF_ERROR(act.ReadInt("bits", &bits));
  QCAL_RETURN_IF_ERROR(act.RequireRange("bits", (bits >= 2 && bits <= 8) || bits == 16,
                                        "2..8, or 16 (not quantized)", std::to_string(bits)));
  a.bits = static_cast<int>(bits);
  QCAL_RETURN_IF_ERROR(act.ReadDouble("clip", &a.clip));
  QCAL_RETURN_IF_ERROR(act.RequireRange("clip", a.clip > 0 && a.clip <= 1, "in (0, 1]",
                                        FormatDouble(a.clip)));
  QCAL_RETURN_IF_ERROR(ReadChoice(act, "granularity", {"per_token", "per_tensor"},
                                  &a.granularity));
  QCAL_RETURN_IF_ERROR(act.ReadBool("static", &a.is_static));
  if (a.is_static && a.granularity != "per_tensor") {
    return act.KeyError("static", "applies only to granularity per_tensor (per-token scales are "
                                  "computed from each token)");
  }
  QCAL_RETURN_IF_ERROR(act.ReadBool("symmetric", &a.symmetric));

  // --- kv_cache ---
  QCAL_ASSIGN_OR_RETURN(
      Section kv, top.ReadSection("kv_cache", {"bits", "format", "granularity", "group", "clip",
                                               "symmetric", "static", "k_sort",
                                               "key_point"}));
  KvCacheSpec& k = recipe->kv_cache;
  if (top.Has("kv_cache") && !kv.Has("bits")) {
    return top.KeyError("kv_cache", "needs 'bits' (2..8, or 16 for a float cache)");
  }
  QCAL_RETURN_IF_ERROR(ReadChoice(kv, "format", {"int", "bfp"}, &k.format));
  const bool bfp = k.format == "bfp";
  bits = k.bits;
  QCAL_RETURN_IF_ERROR(kv.ReadInt("bits", &bits));
  QCAL_RETURN_IF_ERROR(kv.RequireRange(
      "bits", (bits >= 2 && bits <= 8) || bits == 16,
      bfp ? "2..8 (mantissa bits, sign included), or 16 (not quantized)"
          : "2..8, or 16 (not quantized)",
      std::to_string(bits)));
  k.bits = static_cast<int>(bits);
  QCAL_RETURN_IF_ERROR(kv.ReadInt("group", &k.group));
  QCAL_RETURN_IF_ERROR(kv.RequireRange("group", k.group >= 0,
                                       "0 (= head_dim) or a positive channel count",
                                       std::to_string(k.group)));
  if (bfp) {
    for (const char* key : {"granularity", "clip", "symmetric", "static"}) {
      if (kv.Has(key)) {
        return kv.KeyError(key, "applies only to format int (bfp blocks of 'group' channels "
                                "share one exponent)");
      }
    }
    k.granularity = "per_group";
    QCAL_RETURN_IF_ERROR(ReadChoice(kv, "key_point", {"pre_rope", "post_rope"}, &k.key_point));
  } else {
    if (kv.Has("key_point")) {
      return kv.KeyError("key_point", "applies only to format bfp (an int cache holds keys after "
                                      "RoPE and R3, as QuaRot quantizes them)");
    }
    QCAL_RETURN_IF_ERROR(ReadChoice(kv, "granularity", {"per_group", "per_token", "per_tensor"},
                                    &k.granularity));
    QCAL_RETURN_IF_ERROR(kv.ReadDouble("clip", &k.clip));
    QCAL_RETURN_IF_ERROR(kv.RequireRange("clip", k.clip > 0 && k.clip <= 1, "in (0, 1]",
                                         FormatDouble(k.clip)));
    QCAL_RETURN_IF_ERROR(kv.ReadBool("symmetric", &k.symmetric));
    QCAL_RETURN_IF_ERROR(kv.ReadBool("static", &k.is_static));
    if (k.granularity == "per_tensor" && !k.is_static && k.enabled()) {
      return kv.KeyError("granularity", "per_tensor needs 'static: true' (a dynamic per-tensor "
                                        "scale would let later tokens change cached entries)");
    }
    if (k.is_static && k.granularity != "per_tensor") {
      return kv.KeyError("static", "applies only to granularity per_tensor");
    }
    if (kv.Has("group") && k.granularity != "per_group") {
      return kv.KeyError("group", "applies only to granularity per_group");
    }
  }
  QCAL_RETURN_IF_ERROR(kv.ReadBool("k_sort", &k.k_sort));
  if (k.k_sort && !bfp) {
    return kv.KeyError("k_sort", "applies only to format bfp");
  }
  if (k.k_sort && rot.enabled && rot.r3) {
    return kv.KeyError("k_sort", absl::StrCat(
        "cannot be combined with rotation.r3 (R3's Hadamard mixes every channel of a head after "
        "RoPE, so the sorted order never reaches the cache); set r3: false",
        rotation.Has("r3") ? absl::StrCat(" (line ", rotation.Line("r3"), ")") : ""));
  }
  return Status();
}

StatusOr<Recipe> ParseDocument(const YAML::Node& root, const std::string& source) {
  Section top(source, "");
  QCAL_RETURN_IF_ERROR(top.Load(
      root, {"name", "method", "bits", "codebook", "incoherence", "scale", "seed", "damp",
             "scalar", "calibration", "finetune", "weights", "rotation", "activations",
             "kv_cache"}));
  Recipe recipe;

  // --- method (required) ---
  if (!top.Has("method")) {
    return top.Error("missing required key 'method' (quip, rtn, gptq or quarot)");
  }
  std::string method;
  QCAL_RETURN_IF_ERROR(top.ReadString("method", &method));
  if (method == "quip") {
    recipe.method = QuantMethod::kQuip;
  } else if (method == "rtn") {
    recipe.method = QuantMethod::kRtn;
  } else if (method == "gptq") {
    recipe.method = QuantMethod::kGptq;
  } else if (method == "quarot") {
    recipe.method = QuantMethod::kQuarot;
  } else {
    std::string message = absl::StrCat("must be one of quip, rtn, gptq, quarot, got '",
                                       Printable(method), "'");
    const std::string suggestion = ClosestWithin2(method, {"quip", "rtn", "gptq", "quarot"});
    if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
    return top.KeyError("method", message);
  }
  const bool is_quip = recipe.method == QuantMethod::kQuip;
  const bool is_quarot = recipe.method == QuantMethod::kQuarot;

  // --- weights (quarot): the rounding of the rotated weights ---
  if (is_quarot) {
    recipe.weights = "gptq";
    QCAL_RETURN_IF_ERROR(top.ReadString("weights", &recipe.weights));
    if (recipe.weights != "rtn" && recipe.weights != "gptq" && recipe.weights != "none") {
      std::string message = absl::StrCat("must be rtn, gptq or none, got '",
                                         Printable(recipe.weights), "'");
      const std::string suggestion = ClosestWithin2(recipe.weights, {"rtn", "gptq", "none"});
      if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
      return top.KeyError("weights", message);
    }
  } else {
    for (const char* key : {"weights", "rotation", "activations", "kv_cache"}) {
      if (top.Has(key)) {
        return top.KeyError(key, absl::StrCat("applies only to method quarot, not ", method));
      }
    }
  }
  const bool float_weights = is_quarot && recipe.weights == "none";

  // --- name ---
  recipe.name = FileStem(source);
  QCAL_RETURN_IF_ERROR(top.ReadString("name", &recipe.name));
  if (recipe.name.empty()) {
    if (top.Has("name")) return top.KeyError("name", "must not be empty");
    return top.Error("no 'name' given and the file name has no stem to default to");
  }

  // --- bits / codebook ---
  int64_t bits = 0;
  QCAL_RETURN_IF_ERROR(top.ReadInt("bits", &bits));
  const bool has_bits = top.Has("bits");
  if (is_quip) {
    if (has_bits && (bits < 2 || bits > 4)) {
      return top.KeyError("bits", absl::StrCat("must be 2, 3 or 4 for method quip, got ", bits));
    }
    if (top.Has("codebook")) {
      std::string codebook;
      QCAL_RETURN_IF_ERROR(top.ReadString("codebook", &codebook));
      const CodebookInfo* info = nullptr;
      std::vector<std::string> names;
      for (const CodebookInfo& c : kCodebooks) {
        names.push_back(c.name);
        if (codebook == c.name) info = &c;
      }
      if (!info) {
        std::string message = absl::StrCat("must be one of ", absl::StrJoin(names, ", "),
                                           ", got '", Printable(codebook), "'");
        const std::string suggestion = ClosestWithin2(codebook, names);
        if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
        return top.KeyError("codebook", message);
      }
      if (has_bits && bits != info->bits) {
        return top.KeyError(
            "bits", absl::StrCat("is ", bits, " but codebook '", info->name, "' (line ",
                                 top.Line("codebook"), ") is a ", info->bits, "-bit codebook"));
      }
      recipe.codebook = info->name;
      recipe.bits = info->bits;
    } else {
      recipe.bits = has_bits ? static_cast<int>(bits) : 2;
      recipe.codebook = DefaultCodebookForBits(recipe.bits);
    }
  } else if (float_weights) {
    if (top.Has("codebook")) {
      return top.KeyError("codebook", "applies only to method quip");
    }
    if (has_bits) {
      return top.KeyError("bits", absl::StrCat("does not apply with 'weights: none' (line ",
                                               top.Line("weights"),
                                               "): the weights stay in float"));
    }
    recipe.bits = 16;
    recipe.codebook.clear();
  } else {
    if (top.Has("codebook")) {
      return top.KeyError("codebook",
                          absl::StrCat("applies only to method quip, not ", method,
                                       " (rtn and gptq use the scalar grid in 'scalar')"));
    }
    if (has_bits && (bits < 2 || bits > 8)) {
      return top.KeyError("bits", absl::StrCat("must be in 2..8 for method ", method, ", got ",
                                               bits));
    }
    recipe.bits = has_bits ? static_cast<int>(bits) : 2;
    recipe.codebook.clear();
  }

  // --- incoherence ---
  if (is_quip) {
    QCAL_RETURN_IF_ERROR(top.ReadBool("incoherence", &recipe.incoherence));
  } else {
    bool incoherence = false;
    QCAL_RETURN_IF_ERROR(top.ReadBool("incoherence", &incoherence));
    if (incoherence) {
      return top.KeyError("incoherence",
                          absl::StrCat("applies only to method quip; method ", method,
                                       " quantizes the weights as they are (remove the key or "
                                       "set it to false)"));
    }
    recipe.incoherence = false;
  }

  // --- scale (quip) ---
  if (is_quip) {
    QCAL_RETURN_IF_ERROR(top.ReadString("scale", &recipe.scale_mode));
    if (recipe.scale_mode != "row" && recipe.scale_mode != "matrix") {
      std::string message = absl::StrCat("must be row or matrix, got '",
                                         Printable(recipe.scale_mode), "'");
      const std::string suggestion = ClosestWithin2(recipe.scale_mode, {"row", "matrix"});
      if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
      return top.KeyError("scale", message);
    }
  } else {
    if (top.Has("scale")) {
      return top.KeyError("scale", absl::StrCat("applies only to method quip, not ", method,
                                                " (rtn and gptq set their scales in 'scalar')"));
    }
    recipe.scale_mode.clear();
  }

  // --- seed, damp ---
  QCAL_RETURN_IF_ERROR(top.ReadUint("seed", &recipe.seed));
  if (recipe.method == QuantMethod::kRtn && top.Has("damp")) {
    return top.KeyError("damp", "does not apply to method rtn, which uses no Hessian");
  }
  if (is_quarot && recipe.weights != "gptq" && top.Has("damp")) {
    return top.KeyError("damp", absl::StrCat("does not apply with 'weights: ", recipe.weights,
                                             "', which uses no Hessian"));
  }
  QCAL_RETURN_IF_ERROR(top.ReadDouble("damp", &recipe.damp));
  QCAL_RETURN_IF_ERROR(top.RequireRange("damp", recipe.damp > 0 && recipe.damp <= 1, "in (0, 1]",
                                        FormatDouble(recipe.damp)));

  // --- scalar grid (rtn, gptq) ---
  if (is_quip && top.Has("scalar")) {
    return top.KeyError("scalar", "applies only to methods rtn and gptq; quip uses 'codebook'");
  }
  if (float_weights && top.Has("scalar")) {
    return top.KeyError("scalar", "does not apply with 'weights: none' (float weights)");
  }
  QCAL_ASSIGN_OR_RETURN(
      Section scalar,
      top.ReadSection("scalar",
                      {"group_size", "symmetric", "act_order", "clip_search", "per_tensor"}));
  QCAL_RETURN_IF_ERROR(scalar.ReadInt("group_size", &recipe.scalar.group_size));
  QCAL_RETURN_IF_ERROR(scalar.RequireRange(
      "group_size", recipe.scalar.group_size == -1 || recipe.scalar.group_size > 0,
      "-1 (per output channel) or a positive group size", std::to_string(recipe.scalar.group_size)));
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("symmetric", &recipe.scalar.symmetric));
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("act_order", &recipe.scalar.act_order));
  if (recipe.scalar.act_order && recipe.method != QuantMethod::kGptq &&
      !(is_quarot && recipe.weights == "gptq")) {
    return scalar.KeyError("act_order",
                           is_quarot ? absl::StrCat("applies only to 'weights: gptq', not ",
                                                    recipe.weights)
                                     : absl::StrCat("applies only to method gptq, not ", method));
  }
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("clip_search", &recipe.scalar.clip_search));
  QCAL_RETURN_IF_ERROR(scalar.ReadBool("per_tensor", &recipe.scalar.per_tensor));
  if (recipe.scalar.per_tensor && recipe.scalar.group_size != -1) {
    return scalar.KeyError("per_tensor", absl::StrCat("cannot be combined with group_size ",
                                                      recipe.scalar.group_size, " (line ",
                                                      scalar.Line("group_size"), ")"));
  }

  // --- calibration ---
  QCAL_ASSIGN_OR_RETURN(Section calibration,
                        top.ReadSection("calibration", {"files", "num_sequences", "seq_len", "seed"}));
  recipe.calibration.files = {kDefaultCalibrationFile};
  if (const Section::Entry* files = calibration.Find("files")) {
    if (!files->value.IsSequence()) {
      return calibration.TypeError("files", "a list of file paths", files->value);
    }
    if (files->value.size() == 0) {
      return calibration.KeyError("files", "must list at least one file");
    }
    recipe.calibration.files.clear();
    for (size_t i = 0; i < files->value.size(); ++i) {
      const YAML::Node item = files->value[i];
      if (!item.IsScalar() || item.Scalar().empty()) {
        return calibration.Error(absl::StrCat("key '", calibration.Path("files"), "' item ", i + 1,
                                              " (line ", LineOf(item),
                                              ") must be a non-empty file path, got ",
                                              Describe(item)));
      }
      recipe.calibration.files.push_back(item.Scalar());
    }
  }
  QCAL_RETURN_IF_ERROR(calibration.ReadInt("num_sequences", &recipe.calibration.num_sequences));
  QCAL_RETURN_IF_ERROR(calibration.RequireRange("num_sequences",
                                                recipe.calibration.num_sequences >= 1, "at least 1",
                                                std::to_string(recipe.calibration.num_sequences)));
  QCAL_RETURN_IF_ERROR(calibration.ReadInt("seq_len", &recipe.calibration.seq_len));
  QCAL_RETURN_IF_ERROR(calibration.RequireRange("seq_len", recipe.calibration.seq_len >= 2,
                                                "at least 2",
                                                std::to_string(recipe.calibration.seq_len)));
  QCAL_RETURN_IF_ERROR(calibration.ReadUint("seed", &recipe.calibration.seed));

  // --- finetune ---
  QCAL_ASSIGN_OR_RETURN(Section finetune,
                        top.ReadSection("finetune", {"enabled", "block", "end_to_end"}));
  QCAL_RETURN_IF_ERROR(finetune.ReadBool("enabled", &recipe.finetune.enabled));
  QCAL_ASSIGN_OR_RETURN(
      Section block,
      finetune.ReadSection("block", kStageKeys,
                           {{"enabled", "within-block fine-tuning is switched by 'finetune.enabled'"}}));
  QCAL_RETURN_IF_ERROR(ReadStage(block, &recipe.finetune.block));
  recipe.finetune.block.enabled = recipe.finetune.enabled;
  QCAL_ASSIGN_OR_RETURN(Section end_to_end, finetune.ReadSection("end_to_end", kEndToEndKeys));
  QCAL_RETURN_IF_ERROR(ReadStage(end_to_end, &recipe.finetune.end_to_end));

  if (is_quarot) {
    if (recipe.finetune.enabled) {
      return finetune.KeyError("enabled", "is not supported with method quarot");
    }
    if (recipe.finetune.end_to_end.enabled) {
      return end_to_end.KeyError("enabled", "is not supported with method quarot");
    }
    QCAL_RETURN_IF_ERROR(ReadQuarotSections(top, &recipe));
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

const char* QuantMethodName(QuantMethod method) {
  switch (method) {
    case QuantMethod::kQuip: return "quip";
    case QuantMethod::kRtn: return "rtn";
    case QuantMethod::kGptq: return "gptq";
    case QuantMethod::kQuarot: return "quarot";
  }
  return "unknown";
}

nlohmann::json Recipe::ToJson() const {
  // Every setting that applies to the method; settings that do not apply are left out, exactly
  // as ParseRecipe would reject them (codebook and scale for rtn/gptq, damp for rtn, scalar for
  // quip), so ParseRecipe(ToJson().dump()) gives back this recipe.
  json j = {
      {"name", name},
      {"method", QuantMethodName(method)},
      {"bits", bits},
      {"incoherence", incoherence},
      {"seed", seed},
  };
  if (method == QuantMethod::kQuip) {
    j["codebook"] = codebook;
    j["scale"] = scale_mode;
  }
  const bool quarot = method == QuantMethod::kQuarot;
  if (quarot) {
    j["weights"] = weights;
    if (weights == "none") j.erase("bits");
  }
  if (quarot ? weights == "gptq" : method != QuantMethod::kRtn) j["damp"] = damp;
  if (method != QuantMethod::kQuip && !(quarot && weights == "none")) {
    j["scalar"] = {{"group_size", scalar.group_size},
                   {"symmetric", scalar.symmetric},
                   {"act_order", scalar.act_order},
                   {"clip_search", scalar.clip_search}};
    if (scalar.per_tensor) j["scalar"]["per_tensor"] = true;  // left out when off (older JSON)
  }
  j["calibration"] = {{"files", calibration.files},
                      {"num_sequences", calibration.num_sequences},
                      {"seq_len", calibration.seq_len},
                      {"seed", calibration.seed}};
  j["finetune"] = {{"enabled", finetune.enabled},
                   {"block", StageJson(finetune.block, /*with_enabled=*/false)},
                   {"end_to_end", StageJson(finetune.end_to_end, /*with_enabled=*/true)}};
  if (quarot) {
    j["rotation"] = {{"enabled", rotation.enabled}, {"r1", rotation.r1}, {"r2", rotation.r2},
                     {"r3", rotation.r3},           {"r4", rotation.r4}, {"seed", rotation.seed}};
    j["activations"] = {{"bits", activations.bits},
                        {"clip", activations.clip},
                        {"granularity", activations.granularity},
                        {"static", activations.is_static},
                        {"symmetric", activations.symmetric}};
    json kv = {{"bits", kv_cache.bits}, {"format", kv_cache.format}, {"k_sort", kv_cache.k_sort}};
    if (kv_cache.format == "bfp" || kv_cache.granularity == "per_group") {
      kv["group"] = kv_cache.group;
    }
    if (kv_cache.format == "bfp") kv["key_point"] = kv_cache.key_point;
    if (kv_cache.format != "bfp") {
      kv["granularity"] = kv_cache.granularity;
      kv["clip"] = kv_cache.clip;
      kv["symmetric"] = kv_cache.symmetric;
      kv["static"] = kv_cache.is_static;
    }
    j["kv_cache"] = kv;
  }
  return j;
}

StatusOr<Recipe> ParseRecipe(const std::string& yaml_text, const std::string& source_in) {
  const std::string source = source_in.empty() ? "<recipe>" : source_in;
  YAML::Node root;
  int document_count = 0;
  YAML::Mark second_document;
  try {
    root = YAML::Load(yaml_text);
    // An empty first document is reported below; counting after one could meet the LoadAll bug's
    // endless empty documents, which would read as a second document.
    if (!root.IsNull()) document_count = CountDocuments(yaml_text, &second_document);
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
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the recipe is empty; 'method' (quip, rtn or gptq) is required"));
  }
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": a recipe must be a mapping of keys to values, got ", Describe(root)));
  }
  if (document_count > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": holds more than one YAML document (the second starts at line ",
                     second_document.line + 1, "); a recipe is one document"));
  }
  try {
    return ParseDocument(root, source);
  } catch (const std::exception& e) {
    // Node accessors throw only on misuse; keep the file name if one ever does.
    return absl::InternalError(absl::StrCat(source, ": reading the recipe: ", e.what()));
  }
}

StatusOr<Recipe> LoadRecipe(const std::string& path) {
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
  return ParseRecipe(text, path);
}

}  // namespace qcal
