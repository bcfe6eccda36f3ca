#include "engine/calib/tokens.h"

#include <algorithm>
#include <random>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/text.h"

namespace qcal::calib {
namespace {

std::string Resolve(const std::string& data_root, const std::string& file) {
  if (!file.empty() && file[0] == '/') return file;
  return data_root + "/" + file;
}

}  // namespace

StatusOr<at::Tensor> SampleCalibrationTokens(const Tokenizer& tokenizer,
                                             const CalibrationSpec& spec,
                                             const std::string& data_root, int64_t seq_len,
                                             int32_t bos_id) {
  if (spec.files.empty()) return absl::InvalidArgumentError("calibration: no files given");
  if (seq_len < 2) return absl::InvalidArgumentError("calibration: seq_len must be >= 2");
  std::string text;
  std::vector<std::string> paths;
  for (const std::string& f : spec.files) {
    paths.push_back(Resolve(data_root, f));
    QCAL_ASSIGN_OR_RETURN(std::string t, ReadTextFile(paths.back()));
    QCAL_RETURN_IF_ERROR(CheckLooksLikeText(paths.back(), t));
    if (!text.empty()) text += "\n\n";
    text += t;
  }
  const std::string files = absl::StrJoin(paths, ", ");
  const std::vector<int32_t> ids = tokenizer.Encode(text);
  const int64_t window = seq_len - 1;
  if (static_cast<int64_t>(ids.size()) <= window) {
    return absl::InvalidArgumentError(absl::StrCat("calibration text (", files, ") gives ",
                                                   ids.size(),
                                                   " tokens, fewer than one sequence of ",
                                                   seq_len));
  }
  // Text of a handful of distinct tokens (a repeated line, a wrong file) calibrates nothing
  // useful; it is not an error, but the user should know.
  const std::unordered_set<int32_t> distinct(ids.begin(), ids.end());
  const int64_t expected = std::min<int64_t>(100, tokenizer.vocab_size() / 4);
  if (static_cast<int64_t>(distinct.size()) < expected) {
    QCAL_LOG_WARN("calibration text ({}) uses only {} distinct tokens of a vocabulary of {}: "
                  "Hessians from it will not represent real inputs",
                  files, distinct.size(), tokenizer.vocab_size());
  }
  std::mt19937_64 rng(spec.seed);
  std::uniform_int_distribution<int64_t> offset(0, static_cast<int64_t>(ids.size()) - window - 1);
  at::Tensor tokens = at::empty({spec.num_sequences, seq_len}, at::kLong);
  auto acc = tokens.accessor<int64_t, 2>();
  for (int64_t s = 0; s < spec.num_sequences; ++s) {
    const int64_t start = offset(rng);
    acc[s][0] = bos_id;
    for (int64_t j = 0; j < window; ++j) acc[s][j + 1] = ids[start + j];
  }
  return tokens;
}

}  // namespace qcal::calib
