#include "engine/model/tensor_io.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace qcal::model {

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> FindChecked(
    CheckpointReader& ckpt, const std::string& name, std::initializer_list<DType> allowed,
    const std::vector<int64_t>& shape) {
  QCAL_ASSIGN_OR_RETURN(auto found, ckpt.Find(name));
  const TensorInfo& info = *found.second;
  if (std::find(allowed.begin(), allowed.end(), info.dtype) == allowed.end()) {
    std::vector<std::string> names;
    for (DType d : allowed) names.emplace_back(DTypeName(d));
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has dtype ",
                                                   std::string(DTypeName(info.dtype)),
                                                   ", expected ", absl::StrJoin(names, " or ")));
  }
  if (info.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ",
                                                   ShapeStr(info.shape), ", expected ",
                                                   ShapeStr(shape)));
  }
  return found;
}

StatusOr<std::vector<int64_t>> ReadInts(CheckpointReader& ckpt, const std::string& name,
                                        std::initializer_list<DType> allowed,
                                        const std::vector<int64_t>& shape) {
  QCAL_ASSIGN_OR_RETURN(auto found, FindChecked(ckpt, name, allowed, shape));
  const TensorInfo& info = *found.second;
  const uint8_t* p = found.first->Data(info);
  const int64_t n = info.numel();
  std::vector<int64_t> out(n);
  auto read = [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, p + i * sizeof(T), sizeof(T));
      out[i] = static_cast<int64_t>(v);
    }
  };
  switch (info.dtype) {
    case DType::kU8: read(uint8_t{}); break;
    case DType::kU16: read(uint16_t{}); break;
    case DType::kU32: read(uint32_t{}); break;
    case DType::kI8: read(int8_t{}); break;
    case DType::kI16: read(int16_t{}); break;
    case DType::kI32: read(int32_t{}); break;
    case DType::kI64: read(int64_t{}); break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': not an integer dtype"));
  }
  return out;
}

StatusOr<std::vector<double>> ReadF64(CheckpointReader& ckpt, const std::string& name,
                                      const std::vector<int64_t>& shape) {
  QCAL_ASSIGN_OR_RETURN(auto found, FindChecked(ckpt, name, {DType::kF64}, shape));
  std::vector<double> out(found.second->numel());
  std::memcpy(out.data(), found.first->Data(*found.second), out.size() * sizeof(double));
  return out;
}

StatusOr<std::vector<float>> ReadF32Checked(CheckpointReader& ckpt, const std::string& name,
                                            const std::vector<int64_t>& shape) {
  QCAL_RETURN_IF_ERROR(FindChecked(ckpt, name, {DType::kF32}, shape).status());
  return ckpt.ReadF32(name);
}

at::Tensor FloatTensor(const std::vector<float>& v) {
  return at::from_blob(const_cast<float*>(v.data()), {static_cast<int64_t>(v.size())}, at::kFloat)
      .clone();
}

std::vector<float> ToVector(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

at::Tensor WeightLike(const at::Tensor& w, const at::Tensor& x) {
  if (w.scalar_type() == x.scalar_type() && w.device() == x.device()) return w;
  return w.to(x.device(), x.scalar_type());
}

Status AddF32Tensor(SafetensorsWriter* writer, const std::string& name, const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  return writer->AddF32(name, c.sizes().vec(), c.data_ptr<float>());
}

Status AddF64Tensor(SafetensorsWriter* writer, const std::string& name, const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return writer->Add(name, DType::kF64, c.sizes().vec(), c.data_ptr<double>(),
                     c.numel() * sizeof(double));
}

}  // namespace qcal::model
