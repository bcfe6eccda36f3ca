#include "common/recipe_section.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace qcal {
namespace {

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

// A plain (unquoted, untagged-as-string) scalar: the only form numbers and booleans take.
bool IsPlainScalar(const YAML::Node& value) {
  return value.IsScalar() && value.Tag() != "!" && value.Tag() != "tag:yaml.org,2002:str";
}

}  // namespace

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

std::string Printable(const std::string& text, size_t max_len) {
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

std::string DescribeYaml(const YAML::Node& value) {
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
  if (value.Tag() == "!") {
    return absl::StrCat("the quoted string \"", Printable(value.Scalar()), "\"");
  }
  return absl::StrCat("'", Printable(value.Scalar()), "'");
}

std::string FormatDouble(double value) {
  std::ostringstream out;
  out.precision(std::numeric_limits<double>::max_digits10);
  out << value;
  return out.str();
}

std::string FileStem(const std::string& path) {
  std::string base = path;
  const size_t slash = base.find_last_of('/');
  if (slash != std::string::npos) base = base.substr(slash + 1);
  const size_t dot = base.find_last_of('.');
  if (dot != std::string::npos && dot > 0) base = base.substr(0, dot);
  return base;
}

Status RecipeSection::Load(const YAML::Node& map, const std::vector<std::string>& known,
                           const std::vector<std::pair<std::string, std::string>>& hints) {
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node key = it->first;
    if (!key.IsScalar()) {
      return Error(absl::StrCat("a key at line ", LineOf(key), Where(), " is ", DescribeYaml(key),
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

const RecipeSection::Entry* RecipeSection::Find(const std::string& name) const {
  for (const Entry& entry : entries_) {
    if (entry.key.Scalar() == name) return &entry;
  }
  return nullptr;
}

int RecipeSection::Line(const std::string& name) const {
  const Entry* entry = Find(name);
  return entry ? LineOf(entry->key) : 0;
}

std::vector<std::string> RecipeSection::Keys() const {
  std::vector<std::string> keys;
  for (const Entry& entry : entries_) keys.push_back(entry.key.Scalar());
  return keys;
}

std::string RecipeSection::Path(const std::string& name) const {
  return path_.empty() ? name : absl::StrCat(path_, ".", name);
}

std::string RecipeSection::KeyRef(const std::string& name) const {
  return absl::StrCat("key '", Path(name), "' (line ", Line(name), ")");
}

Status RecipeSection::Error(const std::string& message) const {
  return absl::InvalidArgumentError(absl::StrCat(source_, ": ", message));
}

Status RecipeSection::KeyError(const std::string& name, const std::string& message) const {
  return Error(absl::StrCat(KeyRef(name), " ", message));
}

Status RecipeSection::TypeError(const std::string& name, const char* expected,
                                const YAML::Node& got) const {
  return KeyError(name, absl::StrCat("must be ", expected, ", got ", DescribeYaml(got)));
}

Status RecipeSection::ReadInt(const std::string& name, int64_t* out) const {
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

Status RecipeSection::ReadUint(const std::string& name, uint64_t* out) const {
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

Status RecipeSection::ReadDouble(const std::string& name, double* out) const {
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

Status RecipeSection::ReadBool(const std::string& name, bool* out) const {
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

Status RecipeSection::ReadString(const std::string& name, std::string* out) const {
  const Entry* entry = Find(name);
  if (!entry) return Status();
  if (!entry->value.IsScalar()) return TypeError(name, "a string", entry->value);
  *out = entry->value.Scalar();
  return Status();
}

Status RecipeSection::ReadChoice(const std::string& name, const std::vector<std::string>& allowed,
                                 std::string* out) const {
  QCAL_RETURN_IF_ERROR(ReadString(name, out));
  for (const std::string& a : allowed) {
    if (*out == a) return Status();
  }
  std::string message = absl::StrCat("must be ", absl::StrJoin(allowed, " or "), ", got '",
                                     Printable(*out), "'");
  const std::string suggestion = ClosestWithin2(*out, allowed);
  if (!suggestion.empty()) absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
  return KeyError(name, message);
}

StatusOr<RecipeSection> RecipeSection::ReadSection(
    const std::string& name, const std::vector<std::string>& known,
    const std::vector<std::pair<std::string, std::string>>& hints) const {
  RecipeSection section(source_, Path(name));
  const Entry* entry = Find(name);
  if (!entry) return section;
  if (!entry->value.IsMap()) return TypeError(name, "a mapping", entry->value);
  QCAL_RETURN_IF_ERROR(section.Load(entry->value, known, hints));
  return section;
}

Status RecipeSection::RequireRange(const std::string& name, bool ok, const std::string& rule,
                                   const std::string& got) const {
  if (ok || !Has(name)) return Status();
  return KeyError(name, absl::StrCat("must be ", rule, ", got ", got));
}

std::string RecipeSection::Where() const {
  return path_.empty() ? "" : absl::StrCat(" in '", path_, "'");
}

}  // namespace qcal
