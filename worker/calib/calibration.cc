#include "worker/calib/calibration.h"

#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <random>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/safetensors.h"
#include "common/text.h"

namespace qcal::calib {
namespace {

std::string Resolve(const std::string& data_root, const std::string& file) {
  if (!file.empty() && file[0] == '/') return file;
  return data_root + "/" + file;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

}  // namespace

StatusOr<at::Tensor> SampleCalibrationTokens(const Tokenizer& tokenizer,
                                             const CalibrationSpec& spec,
                                             const std::string& data_root, int64_t seq_len,
                                             int32_t bos_id) {
  if (spec.files.empty()) return absl::InvalidArgumentError("calibration: no files given");
  if (seq_len < 2) return absl::InvalidArgumentError("calibration: seq_len must be >= 2");
  std::string text;
  for (const std::string& f : spec.files) {
    QCAL_ASSIGN_OR_RETURN(std::string t, ReadTextFile(Resolve(data_root, f)));
    if (!text.empty()) text += "\n\n";
    text += t;
  }
  const std::vector<int32_t> ids = tokenizer.Encode(text);
  const int64_t window = seq_len - 1;
  if (static_cast<int64_t>(ids.size()) <= window) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: the files give ", ids.size(),
                                                   " tokens, fewer than one sequence of ",
                                                   seq_len));
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

std::string CalibrationKey(const std::string& model_dir, const LlamaConfig& config,
                           const CalibrationSpec& spec, const std::string& data_root,
                           int64_t seq_len) {
  std::string canon = LlamaConfigToJson(config).dump();
  for (const char* f : {"model.safetensors", "model.safetensors.index.json"}) {
    absl::StrAppend(&canon, "|", f, "=", FileSize(model_dir + "/" + f));
  }
  for (const std::string& f : spec.files) {
    absl::StrAppend(&canon, "|data:", f, "=", FileSize(Resolve(data_root, f)));
  }
  absl::StrAppend(&canon, "|n=", spec.num_sequences, "|len=", seq_len, "|seed=", spec.seed);
  return Fnv1aHex(canon);
}

Status SaveBlockHessians(const std::string& path, const BlockHessians& h, const std::string& key) {
  SafetensorsWriter writer;
  writer.SetMetadata("calibration_key", key);
  for (HessianKind k : kAllHessianKinds) {
    const HessianAccumulator& acc = h.at(k);
    at::Tensor sum = acc.sum().contiguous();
    QCAL_RETURN_IF_ERROR(writer.Add(std::string(HessianKindName(k)) + ".sum", DType::kF64,
                                    {acc.dim(), acc.dim()}, sum.data_ptr<double>(),
                                    sum.numel() * sizeof(double)));
    const int64_t count = acc.count();
    QCAL_RETURN_IF_ERROR(writer.Add(std::string(HessianKindName(k)) + ".count", DType::kI64, {},
                                    &count, sizeof(count)));
  }
  return writer.Write(path);
}

StatusOr<BlockHessians> LoadBlockHessians(const std::string& path, const std::string& key) {
  if (FileSize(path) < 0) return absl::NotFoundError(path + ": no cached Hessians");
  QCAL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  auto it = file->metadata().find("calibration_key");
  if (it == file->metadata().end() || it->second != key) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cached Hessians were computed for calibration key '",
                     it == file->metadata().end() ? "" : it->second, "', not '", key, "'"));
  }
  BlockHessians h;
  for (HessianKind k : kAllHessianKinds) {
    const std::string base = HessianKindName(k);
    const TensorInfo* sum = file->Find(base + ".sum");
    const TensorInfo* count = file->Find(base + ".count");
    if (!sum || !count || sum->dtype != DType::kF64 || sum->shape.size() != 2 ||
        sum->shape[0] != sum->shape[1] || count->dtype != DType::kI64) {
      return absl::DataLossError(absl::StrCat(path, ": missing or malformed '", base, "'"));
    }
    const int64_t n = sum->shape[0];
    int64_t c;
    std::memcpy(&c, file->Data(*count), sizeof(c));
    at::Tensor s = at::from_blob(const_cast<uint8_t*>(file->Data(*sum)), {n, n}, at::kDouble);
    h.at(k) = HessianAccumulator::FromSum(s.clone(), c);
  }
  return h;
}

StatusOr<CalibrationResult> CollectModelHessians(
    model::LlamaModel& model, const at::Tensor& tokens, const std::string& job_dir,
    const std::string& key, int64_t batch, const std::function<void(int64_t, int64_t)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  CalibrationResult result;
  const int64_t blocks = model.num_blocks();
  const std::string dir = job_dir + "/hessians";
  QCAL_RETURN_IF_ERROR(MakeDirs(dir));
  auto path = [&](int64_t l) { return absl::StrCat(dir, "/block_", l, ".safetensors"); };

  // All blocks cached with this key: no forward pass needed.
  bool all_cached = true;
  for (int64_t l = 0; l < blocks && all_cached; ++l) {
    auto h = LoadBlockHessians(path(l), key);
    if (!h.ok()) {
      all_cached = false;
      break;
    }
    result.hessians.push_back(std::move(*h));
  }
  if (all_cached) {
    result.from_cache = true;
    result.tokens = result.hessians.empty() ? 0 : result.hessians[0].at(HessianKind::kQkv).count();
    result.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
  }
  result.hessians.assign(blocks, BlockHessians{});
  at::NoGradGuard no_grad;
  at::Tensor x = model.Embed(tokens);
  for (int64_t l = 0; l < blocks; ++l) {
    QCAL_ASSIGN_OR_RETURN(x, ForwardCollectingHessians(model.mutable_block(l), x, model.rope(),
                                                       batch, &result.hessians[l]));
    QCAL_RETURN_IF_ERROR(SaveBlockHessians(path(l), result.hessians[l], key));
    if (progress) progress(l + 1, blocks);
  }
  result.tokens = tokens.numel();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace qcal::calib
