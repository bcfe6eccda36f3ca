// One mapping of a recipe YAML file with strict, line-numbered error messages: the reader the
// recipe core (common/recipe.cc) and every method's recipe section (methods/*/*_spec.cc) use, so
// all of them report errors the same way:
//
//   jobs/x.yaml: unknown key 'bitz' (line 3); did you mean 'bits'?
//   jobs/x.yaml: key 'calibration.seq_len' (line 7) must be an integer, got 'long'
//
// Every error is InvalidArgument and starts with the file (`source`). Readers leave the output
// untouched when the key is absent, so a default stays a default; an empty value (`bits:`) is an
// error, never "use the default". Numbers and booleans must be plain scalars (`"2"` is a string).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "common/status.h"

namespace qcal {

// Scalars from the file, made safe to echo in an error message (control bytes and non-ASCII
// become '?', long values are cut).
std::string Printable(const std::string& text, size_t max_len = 60);
// The closest candidate within edit distance 2 (case-folded, transpositions count one), or "".
std::string ClosestWithin2(const std::string& word, const std::vector<std::string>& candidates);
// Shortest text that reads back as the same double.
std::string FormatDouble(double value);
// "jobs/quip-e8p-2bit.yaml" -> "quip-e8p-2bit".
std::string FileStem(const std::string& path);
// How a YAML value appears in "got ..." messages.
std::string DescribeYaml(const YAML::Node& value);
int LineOf(const YAML::Node& node);

class RecipeSection {
 public:
  struct Entry {
    YAML::Node key;
    YAML::Node value;
  };

  // `path` is the dotted path of this mapping ("" for the top level, "scalar", ...).
  RecipeSection(std::string source, std::string path)
      : source_(std::move(source)), path_(std::move(path)) {}

  // Checks `map`'s keys against `known` (unknown: an error with the closest known key, or the
  // list of known keys; repeated: an error with both lines). `hints` maps a key that is wrong
  // here to advice shown instead of a suggestion.
  Status Load(const YAML::Node& map, const std::vector<std::string>& known,
              const std::vector<std::pair<std::string, std::string>>& hints = {});

  const Entry* Find(const std::string& name) const;
  bool Has(const std::string& name) const { return Find(name) != nullptr; }
  int Line(const std::string& name) const;  // 0 when absent
  // The keys present, in file order.
  std::vector<std::string> Keys() const;

  std::string Path(const std::string& name) const;
  // "key 'calibration.seq_len' (line 7)"
  std::string KeyRef(const std::string& name) const;
  Status Error(const std::string& message) const;
  Status KeyError(const std::string& name, const std::string& message) const;
  Status TypeError(const std::string& name, const char* expected, const YAML::Node& got) const;

  // Readers: leave *out untouched when the key is absent.
  Status ReadInt(const std::string& name, int64_t* out) const;
  Status ReadUint(const std::string& name, uint64_t* out) const;
  Status ReadDouble(const std::string& name, double* out) const;  // finite decimal numbers only
  Status ReadBool(const std::string& name, bool* out) const;      // true/false (YAML 1.2 core)
  Status ReadString(const std::string& name, std::string* out) const;
  // A string restricted to `allowed`, with a suggestion for near misses.
  Status ReadChoice(const std::string& name, const std::vector<std::string>& allowed,
                    std::string* out) const;
  // A nested mapping with its own known keys; absent gives an empty section.
  StatusOr<RecipeSection> ReadSection(
      const std::string& name, const std::vector<std::string>& known,
      const std::vector<std::pair<std::string, std::string>>& hints = {}) const;
  // KeyError "must be <rule>, got <got>" when the key is present and !ok.
  Status RequireRange(const std::string& name, bool ok, const std::string& rule,
                      const std::string& got) const;

  const std::string& source() const { return source_; }

 private:
  std::string Where() const;

  std::string source_;
  std::string path_;
  std::vector<Entry> entries_;
};

}  // namespace qcal
