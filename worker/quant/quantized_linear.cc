#include "worker/quant/quantized_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "kernels/scalar_quant.h"
#include "worker/quant/transforms_torch.h"

namespace qcal::quant {
namespace {

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The tensor `name` with its dtype among `allowed` and its shape `shape`. NotFound (from the
// reader, naming the tensor and the directory) or InvalidArgument naming the tensor.
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

// Reads an integer tensor (any signed/unsigned width) converted to int64.
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

// A float32 tensor's values (detached, on the CPU).
std::vector<float> ToVector(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// The weights in x's dtype and device (a no-op for float32 CPU inputs).
at::Tensor WeightLike(const at::Tensor& w, const at::Tensor& x) {
  if (w.scalar_type() == x.scalar_type() && w.device() == x.device()) return w;
  return w.to(x.device(), x.scalar_type());
}

Status CheckTransform(const kernels::RandomizedTransform& t, int64_t dim, const char* which) {
  if (t.dim() != dim) {
    return absl::InvalidArgumentError(absl::StrCat("QuipLinear: transform ", which, " has dimension ",
                                                   t.dim(), ", expected ", dim, " (the pad)"));
  }
  if (t.plan.IsHadamard()) {
    if (static_cast<int64_t>(t.signs.size()) != dim) {
      return absl::InvalidArgumentError(absl::StrCat("QuipLinear: transform ", which, " has ",
                                                     t.signs.size(), " signs, expected ", dim));
    }
    for (int8_t s : t.signs) {
      if (s != 1 && s != -1) {
        return absl::InvalidArgumentError(
            absl::StrCat("QuipLinear: transform ", which, " has a sign other than ±1"));
      }
    }
    return absl::OkStatus();
  }
  if (t.kind() == HadamardKind::kRfft) {
    if (static_cast<int64_t>(t.phases.size()) != dim / 2) {
      return absl::InvalidArgumentError(absl::StrCat("QuipLinear: transform ", which, " has ",
                                                     t.phases.size(), " phases, expected ",
                                                     dim / 2));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("QuipLinear: no orthogonal transform for ", which,
                                                 " of dimension ", dim, " (plan ",
                                                 HadamardKindName(t.kind()), ")"));
}

// ±1 signs of a (possibly fine-tuned, real-valued) sign vector; 0 maps to +1.
std::vector<int8_t> SignsOf(const std::vector<float>& v) {
  std::vector<int8_t> s(v.size());
  for (size_t i = 0; i < v.size(); ++i) s[i] = v[i] < 0 ? -1 : 1;
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// QuipLinear
// ---------------------------------------------------------------------------------------------

struct QuipLinear::Impl {
  QuipLinearData data;
  int dim = 0, code_words = 0;
  at::Tensor weight;  // S·Ŵ (float(scale) or row_scales[r] per row), [out_pad, in_pad] float32
  OrthogonalTransformOp tu, tv;
  at::Tensor su, sv;  // [out_pad], [in_pad] float32 leaves
};

StatusOr<std::unique_ptr<QuipLinear>> QuipLinear::Create(QuipLinearData data) {
  if (data.in_features <= 0 || data.out_features <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("QuipLinear: invalid shape ", data.out_features,
                                                   "x", data.in_features));
  }
  if (data.in_pad < data.in_features || data.out_pad < data.out_features) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuipLinear: pads ", data.out_pad, "x", data.in_pad,
                     " smaller than the features ", data.out_features, "x", data.in_features));
  }
  StatusOr<std::unique_ptr<kernels::VectorCodebook>> codebook = kernels::MakeCodebook(data.codebook);
  if (!codebook.ok()) return Annotate(codebook.status(), "QuipLinear");
  const int dim = (*codebook)->dim();
  const int words = (*codebook)->code_words();
  if (data.in_pad % dim != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuipLinear: in_pad ", data.in_pad, " is not a multiple of codebook '",
                     data.codebook, "' dimension ", dim));
  }
  const int64_t vectors = data.out_pad * (data.in_pad / dim);
  if (static_cast<int64_t>(data.codes.size()) != vectors * words) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuipLinear: ", data.codes.size(), " code words given, expected ", vectors * words,
        " (= ", data.out_pad, " x ", data.in_pad / dim, " x ", words, " for codebook '",
        data.codebook, "')"));
  }
  for (size_t i = 0; i < data.codes.size(); ++i) {
    if (data.codes[i] > 0xFFFFu) {
      return absl::InvalidArgumentError(absl::StrCat("QuipLinear: code word ", i, " = ",
                                                     data.codes[i], " does not fit 16 bits"));
    }
  }
  if (data.row_scales.empty()) {
    if (!(data.scale > 0) || !std::isfinite(data.scale) ||
        !std::isfinite(static_cast<float>(data.scale)) || static_cast<float>(data.scale) == 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("QuipLinear: scale ", data.scale, " is not a positive finite float"));
    }
  } else {
    if (static_cast<int64_t>(data.row_scales.size()) != data.out_pad) {
      return absl::InvalidArgumentError(absl::StrCat("QuipLinear: ", data.row_scales.size(),
                                                     " row scales given, expected ", data.out_pad,
                                                     " (out_pad)"));
    }
    for (size_t r = 0; r < data.row_scales.size(); ++r) {
      if (!(data.row_scales[r] > 0) || !std::isfinite(data.row_scales[r])) {
        return absl::InvalidArgumentError(absl::StrCat("QuipLinear: row scale ", r, " = ",
                                                       data.row_scales[r],
                                                       " is not a positive finite float"));
      }
    }
  }

  auto impl = std::make_shared<Impl>();
  impl->dim = dim;
  impl->code_words = words;
  if (data.incoherence) {
    QCAL_RETURN_IF_ERROR(CheckTransform(data.t_u, data.out_pad, "U"));
    QCAL_RETURN_IF_ERROR(CheckTransform(data.t_v, data.in_pad, "V"));
    QCAL_ASSIGN_OR_RETURN(impl->tu, OrthogonalTransformOp::FixedPart(data.t_u));
    QCAL_ASSIGN_OR_RETURN(impl->tv, OrthogonalTransformOp::FixedPart(data.t_v));
  } else {
    impl->tu = OrthogonalTransformOp::Identity(data.out_pad);
    impl->tv = OrthogonalTransformOp::Identity(data.in_pad);
  }
  auto init_signs = [](const kernels::RandomizedTransform& t, int64_t n, bool incoherence) {
    at::Tensor s = at::ones({n}, at::kFloat);
    if (incoherence && t.plan.IsHadamard()) {
      float* p = s.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(t.signs[i]);
    }
    return s;
  };
  impl->su = init_signs(data.t_u, data.out_pad, data.incoherence);
  impl->sv = init_signs(data.t_v, data.in_pad, data.incoherence);

  // Decode Ŵ: the codes of row r are in_pad/dim consecutive vectors of `dim` weights.
  impl->weight = at::empty({data.out_pad, data.in_pad}, at::kFloat);
  (*codebook)->Decode(data.codes.data(), vectors, impl->weight.data_ptr<float>());
  if (data.row_scales.empty()) {
    impl->weight.mul_(static_cast<float>(data.scale));
  } else {
    impl->weight.mul_(FloatTensor(data.row_scales).unsqueeze(1));
  }

  impl->data = std::move(data);
  std::unique_ptr<QuipLinear> layer(new QuipLinear());
  layer->impl_ = std::move(impl);
  return layer;
}

at::Tensor QuipLinear::Forward(const at::Tensor& x) const {
  const Impl& m = *impl_;
  const QuipLinearData& d = m.data;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == d.in_features, "QuipLinear: input of shape ",
              x.sizes(), " for in_features ", d.in_features);
  at::Tensor h = x;
  if (d.in_pad > d.in_features) h = at::constant_pad_nd(h, {0, d.in_pad - d.in_features}, 0);
  h = m.tv.Forward(h * WeightLike(m.sv, h));          // V x = T_v·diag(sv)·x
  at::Tensor y = at::matmul(h, WeightLike(m.weight, h).t());  // Ŵ (V x)
  y = m.tu.Inverse(y) * WeightLike(m.su, y);          // Uᵀ ŷ = diag(su)·T_uᵀ·ŷ
  if (d.out_pad > d.out_features) y = y.narrow(-1, 0, d.out_features);
  return y;
}

int64_t QuipLinear::in_features() const { return impl_->data.in_features; }
int64_t QuipLinear::out_features() const { return impl_->data.out_features; }

at::Tensor QuipLinear::DenseWeight() const {
  const Impl& m = *impl_;
  const QuipLinearData& d = m.data;
  at::Tensor w = m.tv.Inverse(m.weight);                        // rows: Ŵ·T_v
  w = m.tu.Inverse(w.t().contiguous()).t();                     // columns: T_uᵀ·(Ŵ·T_v)
  w = w * m.su.unsqueeze(1) * m.sv.unsqueeze(0);
  return w.narrow(0, 0, d.out_features).narrow(1, 0, d.in_features).contiguous();
}

at::Tensor& QuipLinear::su() { return impl_->su; }
at::Tensor& QuipLinear::sv() { return impl_->sv; }
const QuipLinearData& QuipLinear::data() const { return impl_->data; }
const at::Tensor& QuipLinear::RotatedWeight() const { return impl_->weight; }

Status QuipLinear::AppendTensors(const std::string& prefix, SafetensorsWriter* writer) const {
  const Impl& m = *impl_;
  const QuipLinearData& d = m.data;
  const std::vector<int64_t> code_shape = {d.out_pad, d.in_pad / m.dim, m.code_words};
  const uint32_t max_code =
      d.codes.empty() ? 0 : *std::max_element(d.codes.begin(), d.codes.end());
  if (max_code > 0xFFu) {
    std::vector<uint16_t> c(d.codes.begin(), d.codes.end());
    QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".codes", DType::kU16, code_shape, c.data(),
                                     c.size() * sizeof(uint16_t)));
  } else {
    std::vector<uint8_t> c(d.codes.begin(), d.codes.end());
    QCAL_RETURN_IF_ERROR(
        writer->Add(prefix + ".codes", DType::kU8, code_shape, c.data(), c.size()));
  }
  const std::vector<float> su = ToVector(m.su), sv = ToVector(m.sv);
  if (static_cast<int64_t>(su.size()) != d.out_pad || static_cast<int64_t>(sv.size()) != d.in_pad) {
    return absl::FailedPreconditionError(
        absl::StrCat("QuipLinear ", prefix, ": su/sv were replaced by tensors of ", su.size(), "/",
                     sv.size(), " elements, expected ", d.out_pad, "/", d.in_pad));
  }
  QCAL_RETURN_IF_ERROR(writer->AddF32(prefix + ".su", {d.out_pad}, su.data()));
  QCAL_RETURN_IF_ERROR(writer->AddF32(prefix + ".sv", {d.in_pad}, sv.data()));
  if (d.row_scales.empty()) {
    const float scale = static_cast<float>(d.scale);
    QCAL_RETURN_IF_ERROR(writer->AddF32(prefix + ".scale", {}, &scale));
  } else {
    QCAL_RETURN_IF_ERROR(writer->AddF32(prefix + ".scale", {d.out_pad}, d.row_scales.data()));
  }
  auto add_phases = [&](const kernels::RandomizedTransform& t, const std::string& name) {
    if (!d.incoherence || t.kind() != HadamardKind::kRfft) return absl::OkStatus();
    std::vector<double> re_im(2 * t.phases.size());
    for (size_t k = 0; k < t.phases.size(); ++k) {
      re_im[2 * k] = t.phases[k].real();
      re_im[2 * k + 1] = t.phases[k].imag();
    }
    return writer->Add(name, DType::kF64, {static_cast<int64_t>(t.phases.size()), 2},
                       re_im.data(), re_im.size() * sizeof(double));
  };
  QCAL_RETURN_IF_ERROR(add_phases(d.t_u, prefix + ".phase_u"));
  QCAL_RETURN_IF_ERROR(add_phases(d.t_v, prefix + ".phase_v"));
  const int64_t shape[4] = {d.out_features, d.in_features, d.out_pad, d.in_pad};
  return writer->Add(prefix + ".shape", DType::kI64, {4}, shape, sizeof(shape));
}

StatusOr<std::unique_ptr<QuipLinear>> QuipLinear::Load(CheckpointReader& ckpt,
                                                       const std::string& prefix,
                                                       const std::string& codebook_name,
                                                       bool incoherence) {
  auto fail = [&](const Status& s) {
    return Annotate(s, absl::StrCat("QuipLinear '", prefix, "' in ", ckpt.dir()));
  };
  StatusOr<std::vector<int64_t>> shape = ReadInts(ckpt, prefix + ".shape", {DType::kI64}, {4});
  if (!shape.ok()) return fail(shape.status());
  QuipLinearData d;
  d.out_features = (*shape)[0];
  d.in_features = (*shape)[1];
  d.out_pad = (*shape)[2];
  d.in_pad = (*shape)[3];
  d.codebook = codebook_name;
  d.incoherence = incoherence;
  if (d.out_features <= 0 || d.in_features <= 0 || d.out_pad < d.out_features ||
      d.in_pad < d.in_features) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("invalid shape tensor {", absl::StrJoin(*shape, ", "), "}")));
  }
  StatusOr<std::unique_ptr<kernels::VectorCodebook>> codebook = kernels::MakeCodebook(codebook_name);
  if (!codebook.ok()) return fail(codebook.status());
  const int dim = (*codebook)->dim();
  if (d.in_pad % dim != 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "in_pad ", d.in_pad, " is not a multiple of codebook '", codebook_name, "' dimension ",
        dim)));
  }
  StatusOr<std::vector<int64_t>> codes =
      ReadInts(ckpt, prefix + ".codes", {DType::kU8, DType::kU16},
               {d.out_pad, d.in_pad / dim, (*codebook)->code_words()});
  if (!codes.ok()) return fail(codes.status());
  d.codes.assign(codes->begin(), codes->end());
  StatusOr<std::vector<float>> su = ReadF32Checked(ckpt, prefix + ".su", {d.out_pad});
  if (!su.ok()) return fail(su.status());
  StatusOr<std::vector<float>> sv = ReadF32Checked(ckpt, prefix + ".sv", {d.in_pad});
  if (!sv.ok()) return fail(sv.status());
  // prefix.scale: [] (one scale per matrix) or [out_pad] (one per row).
  StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> scale_info =
      ckpt.Find(prefix + ".scale");
  if (!scale_info.ok()) return fail(scale_info.status());
  const bool row_scales = !scale_info->second->shape.empty();
  StatusOr<std::vector<float>> scale =
      ReadF32Checked(ckpt, prefix + ".scale",
                     row_scales ? std::vector<int64_t>{d.out_pad} : std::vector<int64_t>{});
  if (!scale.ok()) return fail(scale.status());
  if (row_scales) {
    d.row_scales = *std::move(scale);
  } else {
    d.scale = (*scale)[0];
  }
  if (incoherence) {
    auto rebuild = [&](int64_t n, const std::vector<float>& signs,
                       const std::string& phase_name) -> StatusOr<kernels::RandomizedTransform> {
      const HadamardPlan plan = PlanHadamard(n);
      if (plan.IsHadamard()) return kernels::RandomizedTransformFromSigns(SignsOf(signs));
      if (plan.kind != HadamardKind::kRfft) {
        return absl::InvalidArgumentError(
            absl::StrCat("no orthogonal transform of dimension ", n));
      }
      QCAL_ASSIGN_OR_RETURN(std::vector<double> re_im, ReadF64(ckpt, phase_name, {n / 2, 2}));
      std::vector<std::complex<double>> phases(n / 2);
      for (int64_t k = 0; k < n / 2; ++k) phases[k] = {re_im[2 * k], re_im[2 * k + 1]};
      return kernels::RandomizedTransformFromPhases(n, std::move(phases));
    };
    StatusOr<kernels::RandomizedTransform> u = rebuild(d.out_pad, *su, prefix + ".phase_u");
    if (!u.ok()) return fail(u.status());
    StatusOr<kernels::RandomizedTransform> v = rebuild(d.in_pad, *sv, prefix + ".phase_v");
    if (!v.ok()) return fail(v.status());
    d.t_u = *std::move(u);
    d.t_v = *std::move(v);
  }
  StatusOr<std::unique_ptr<QuipLinear>> layer = Create(std::move(d));
  if (!layer.ok()) return fail(layer.status());
  (*layer)->impl_->su = FloatTensor(*su);
  (*layer)->impl_->sv = FloatTensor(*sv);
  return layer;
}

// ---------------------------------------------------------------------------------------------
// ScalarQuantLinear
// ---------------------------------------------------------------------------------------------

namespace {

int64_t NumGroups(const ScalarLinearData& d) {
  return d.group_size == -1 ? 1 : (d.in_features + d.group_size - 1) / d.group_size;
}

// Packs `count` values of `bits` bits into a little-endian bit stream of 32-bit words.
void PackBitStream(const uint32_t* values, int64_t count, int bits, uint32_t* words) {
  const int64_t nwords = count * bits / 32;
  std::fill(words, words + nwords, 0u);
  for (int64_t j = 0; j < count; ++j) {
    const uint64_t v = values[j];
    const int64_t bit = j * bits;
    const int64_t w = bit / 32, shift = bit % 32;
    const uint64_t placed = v << shift;
    words[w] |= static_cast<uint32_t>(placed);
    if (shift + bits > 32) words[w + 1] |= static_cast<uint32_t>(placed >> 32);
  }
}

}  // namespace

struct ScalarQuantLinear::Impl {
  ScalarLinearData data;
  at::Tensor weight;  // [out, in] float32
};

StatusOr<std::unique_ptr<ScalarQuantLinear>> ScalarQuantLinear::Create(ScalarLinearData data) {
  auto invalid = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("ScalarQuantLinear: ", what));
  };
  if (data.in_features <= 0 || data.out_features <= 0) {
    return invalid(absl::StrCat("invalid shape ", data.out_features, "x", data.in_features));
  }
  const int min_bits = data.symmetric ? 2 : 1;
  if (data.bits < min_bits || data.bits > 16) {
    return invalid(absl::StrCat("bits = ", data.bits, " outside [", min_bits, ", 16] for a ",
                                data.symmetric ? "symmetric" : "asymmetric", " grid"));
  }
  if (data.group_size != -1 && data.group_size <= 0) {
    return invalid(absl::StrCat("group_size = ", data.group_size, " (expected -1 or > 0)"));
  }
  if (data.pack_int4 && data.bits > 4) {
    return invalid(absl::StrCat("pack_int4 with ", data.bits, " bits (at most 4)"));
  }
  const int64_t in = data.in_features, out = data.out_features, groups = NumGroups(data);
  if (static_cast<int64_t>(data.codes.size()) != out * in) {
    return invalid(absl::StrCat(data.codes.size(), " codes given, expected ", out * in, " (= ",
                                out, " x ", in, ")"));
  }
  if (static_cast<int64_t>(data.scales.size()) != out * groups ||
      static_cast<int64_t>(data.zeros.size()) != out * groups) {
    return invalid(absl::StrCat(data.scales.size(), " scales and ", data.zeros.size(),
                                " zeros given, expected ", out * groups, " (= ", out, " x ",
                                groups, " groups)"));
  }
  if (data.g_idx.empty()) {
    data.g_idx.resize(in);
    for (int64_t j = 0; j < in; ++j) {
      data.g_idx[j] = static_cast<int32_t>(data.group_size == -1 ? 0 : j / data.group_size);
    }
  }
  if (static_cast<int64_t>(data.g_idx.size()) != in) {
    return invalid(absl::StrCat("g_idx has ", data.g_idx.size(), " entries, expected ", in));
  }
  for (int64_t j = 0; j < in; ++j) {
    if (data.g_idx[j] < 0 || data.g_idx[j] >= groups) {
      return invalid(absl::StrCat("g_idx[", j, "] = ", data.g_idx[j], " outside [0, ", groups,
                                  ")"));
    }
  }
  kernels::ScalarQuantConfig grid;
  grid.bits = data.bits;
  grid.symmetric = data.symmetric;
  const int32_t cmin = kernels::ScalarCodeMin(grid), cmax = kernels::ScalarCodeMax(grid);
  for (size_t i = 0; i < data.codes.size(); ++i) {
    if (data.codes[i] < cmin || data.codes[i] > cmax) {
      return invalid(absl::StrCat("code ", i, " = ", data.codes[i], " outside the ", data.bits,
                                  "-bit grid [", cmin, ", ", cmax, "]"));
    }
  }
  for (size_t i = 0; i < data.scales.size(); ++i) {
    if (!(data.scales[i] > 0) || !std::isfinite(data.scales[i])) {
      return invalid(absl::StrCat("scale ", i, " = ", data.scales[i], " is not positive and finite"));
    }
    if (data.symmetric && data.zeros[i] != 0) {
      return invalid(absl::StrCat("zero ", i, " = ", data.zeros[i], " on a symmetric grid"));
    }
    if (!data.symmetric && (data.zeros[i] < 0 || data.zeros[i] > cmax)) {
      return invalid(absl::StrCat("zero ", i, " = ", data.zeros[i], " outside [0, ", cmax, "]"));
    }
  }

  auto impl = std::make_shared<Impl>();
  impl->weight = at::empty({out, in}, at::kFloat);
  float* w = impl->weight.data_ptr<float>();
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t j = 0; j < in; ++j) {
      const int64_t k = r * groups + data.g_idx[j];
      w[r * in + j] = static_cast<float>(data.codes[r * in + j] - data.zeros[k]) * data.scales[k];
    }
  }
  impl->data = std::move(data);
  std::unique_ptr<ScalarQuantLinear> layer(new ScalarQuantLinear());
  layer->impl_ = std::move(impl);
  return layer;
}

at::Tensor ScalarQuantLinear::Forward(const at::Tensor& x) const {
  return at::matmul(x, WeightLike(impl_->weight, x).t());
}
int64_t ScalarQuantLinear::in_features() const { return impl_->data.in_features; }
int64_t ScalarQuantLinear::out_features() const { return impl_->data.out_features; }
at::Tensor ScalarQuantLinear::DenseWeight() const { return impl_->weight; }
const ScalarLinearData& ScalarQuantLinear::data() const { return impl_->data; }

bool ScalarQuantLinear::GptqExportable() const {
  const ScalarLinearData& d = impl_->data;
  if (d.pack_int4) return false;
  const int b = d.bits;
  return (b == 2 || b == 3 || b == 4 || b == 8) && (d.in_features * b) % 32 == 0 &&
         (d.out_features * b) % 32 == 0;
}

StatusOr<GptqTensors> ScalarQuantLinear::ExportGptq() const {
  const ScalarLinearData& d = impl_->data;
  const int b = d.bits;
  if (b != 2 && b != 3 && b != 4 && b != 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPTQ export supports 2, 3, 4 and 8 bits (AutoGPTQ's packings), not ", b));
  }
  if ((d.in_features * b) % 32 != 0 || (d.out_features * b) % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPTQ export of a ", d.out_features, "x", d.in_features, " layer at ", b,
        " bits: in_features·bits and out_features·bits must be multiples of 32"));
  }
  const int64_t in = d.in_features, out = d.out_features, groups = NumGroups(d);
  const uint32_t mask = (1u << b) - 1;
  const int32_t offset = d.symmetric ? (1 << (b - 1)) : 0;
  GptqTensors g;
  g.bits = b;
  g.in_features = in;
  g.out_features = out;
  g.groups = groups;
  const int64_t wrows = in * b / 32, zcols = out * b / 32;
  g.qweight.assign(wrows * out, 0);
  std::vector<uint32_t> vals(std::max(in, out)), words(std::max(wrows, zcols));
  for (int64_t c = 0; c < out; ++c) {
    for (int64_t j = 0; j < in; ++j) vals[j] = static_cast<uint32_t>(d.codes[c * in + j] + offset);
    PackBitStream(vals.data(), in, b, words.data());
    for (int64_t w = 0; w < wrows; ++w) g.qweight[w * out + c] = static_cast<int32_t>(words[w]);
  }
  g.qzeros.assign(groups * zcols, 0);
  g.scales.resize(groups * out);
  for (int64_t k = 0; k < groups; ++k) {
    for (int64_t c = 0; c < out; ++c) {
      const int32_t zero = d.symmetric ? offset : d.zeros[c * groups + k];
      vals[c] = static_cast<uint32_t>(zero - 1) & mask;
      g.scales[k * out + c] = FloatToHalf(d.scales[c * groups + k]);
    }
    PackBitStream(vals.data(), out, b, words.data());
    for (int64_t w = 0; w < zcols; ++w) g.qzeros[k * zcols + w] = static_cast<int32_t>(words[w]);
  }
  g.g_idx = d.g_idx;
  return g;
}

Status ScalarQuantLinear::AppendTensors(const std::string& prefix,
                                        SafetensorsWriter* writer) const {
  const ScalarLinearData& d = impl_->data;
  const int64_t in = d.in_features, out = d.out_features, groups = NumGroups(d);
  const std::vector<int64_t> code_shape = {out, in};
  if (d.pack_int4) {
    const int64_t half = (in + 1) / 2;
    std::vector<uint8_t> packed(out * half, 0);
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t j = 0; j < in; ++j) {
        const uint8_t nibble = static_cast<uint8_t>(d.codes[r * in + j]) & 0xF;  // two's compl.
        packed[r * half + j / 2] |= static_cast<uint8_t>(j % 2 == 0 ? nibble : nibble << 4);
      }
    }
    QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".codes_int4", DType::kU8, {out, half},
                                     packed.data(), packed.size()));
  } else if (d.bits <= 8) {
    std::vector<uint8_t> c(d.codes.size());
    for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint8_t>(d.codes[i]);  // two's compl.
    QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".codes", d.symmetric ? DType::kI8 : DType::kU8,
                                     code_shape, c.data(), c.size()));
  } else {
    std::vector<uint16_t> c(d.codes.size());
    for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint16_t>(d.codes[i]);
    QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".codes", d.symmetric ? DType::kI16 : DType::kU16,
                                     code_shape, c.data(), c.size() * sizeof(uint16_t)));
  }
  QCAL_RETURN_IF_ERROR(writer->AddF32(prefix + ".scales", {out, groups}, d.scales.data()));
  QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".zeros", DType::kI32, {out, groups}, d.zeros.data(),
                                   d.zeros.size() * sizeof(int32_t)));
  QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".g_idx", DType::kI32, {in}, d.g_idx.data(),
                                   d.g_idx.size() * sizeof(int32_t)));
  const int64_t qconfig[5] = {out, in, d.bits, d.group_size, d.symmetric ? 1 : 0};
  QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".qconfig", DType::kI64, {5}, qconfig, sizeof(qconfig)));
  if (!GptqExportable()) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(GptqTensors g, ExportGptq());
  QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".qweight", DType::kI32, {in * d.bits / 32, out},
                                   g.qweight.data(), g.qweight.size() * sizeof(int32_t)));
  QCAL_RETURN_IF_ERROR(writer->Add(prefix + ".qzeros", DType::kI32, {groups, out * d.bits / 32},
                                   g.qzeros.data(), g.qzeros.size() * sizeof(int32_t)));
  return writer->Add(prefix + ".scales_gptq", DType::kF16, {groups, out}, g.scales.data(),
                     g.scales.size() * sizeof(uint16_t));
}

StatusOr<std::unique_ptr<ScalarQuantLinear>> ScalarQuantLinear::Load(CheckpointReader& ckpt,
                                                                     const std::string& prefix) {
  auto fail = [&](const Status& s) {
    return Annotate(s, absl::StrCat("ScalarQuantLinear '", prefix, "' in ", ckpt.dir()));
  };
  StatusOr<std::vector<int64_t>> cfg = ReadInts(ckpt, prefix + ".qconfig", {DType::kI64}, {5});
  if (!cfg.ok()) return fail(cfg.status());
  ScalarLinearData d;
  d.out_features = (*cfg)[0];
  d.in_features = (*cfg)[1];
  d.bits = static_cast<int>((*cfg)[2]);
  d.group_size = (*cfg)[3];
  d.symmetric = (*cfg)[4] != 0;
  if (d.out_features <= 0 || d.in_features <= 0 || (d.group_size != -1 && d.group_size <= 0) ||
      d.bits < 1 || d.bits > 16) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("invalid qconfig {", absl::StrJoin(*cfg, ", "), "}")));
  }
  const int64_t groups = NumGroups(d);
  const bool wide = d.bits > 8;
  const DType code_dtype =
      d.symmetric ? (wide ? DType::kI16 : DType::kI8) : (wide ? DType::kU16 : DType::kU8);
  if (ckpt.Has(prefix + ".codes_int4")) {
    const int64_t in = d.in_features, half = (in + 1) / 2;
    StatusOr<std::vector<int64_t>> packed =
        ReadInts(ckpt, prefix + ".codes_int4", {DType::kU8}, {d.out_features, half});
    if (!packed.ok()) return fail(packed.status());
    d.pack_int4 = true;
    d.codes.resize(d.out_features * in);
    for (int64_t r = 0; r < d.out_features; ++r) {
      for (int64_t j = 0; j < in; ++j) {
        int32_t v = static_cast<int32_t>(((*packed)[r * half + j / 2] >> (j % 2 ? 4 : 0)) & 0xF);
        if (d.symmetric && v >= 8) v -= 16;  // sign-extend the nibble
        d.codes[r * in + j] = v;
      }
    }
  } else {
    StatusOr<std::vector<int64_t>> codes =
        ReadInts(ckpt, prefix + ".codes", {code_dtype}, {d.out_features, d.in_features});
    if (!codes.ok()) return fail(codes.status());
    d.codes.assign(codes->begin(), codes->end());
  }
  StatusOr<std::vector<float>> scales =
      ReadF32Checked(ckpt, prefix + ".scales", {d.out_features, groups});
  if (!scales.ok()) return fail(scales.status());
  d.scales = *std::move(scales);
  StatusOr<std::vector<int64_t>> zeros =
      ReadInts(ckpt, prefix + ".zeros", {DType::kI32}, {d.out_features, groups});
  if (!zeros.ok()) return fail(zeros.status());
  d.zeros.assign(zeros->begin(), zeros->end());
  StatusOr<std::vector<int64_t>> g_idx =
      ReadInts(ckpt, prefix + ".g_idx", {DType::kI32}, {d.in_features});
  if (!g_idx.ok()) return fail(g_idx.status());
  d.g_idx.assign(g_idx->begin(), g_idx->end());
  StatusOr<std::unique_ptr<ScalarQuantLinear>> layer = Create(std::move(d));
  if (!layer.ok()) return fail(layer.status());
  return layer;
}

}  // namespace qcal::quant
