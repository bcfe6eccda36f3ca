#include "methods/quip/quip_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "methods/quip/transforms_torch.h"
#include "engine/model/llama.h"
#include "engine/model/tensor_io.h"

namespace qcal::methods::quip {
namespace {

using model::FindChecked;
using model::FloatTensor;
using model::ReadF32Checked;
using model::ReadF64;
using model::ReadInts;
using model::ShapeStr;
using model::ToVector;
using model::WeightLike;

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

  // Decode Ŵ: the codes of row r are in_pad/dim consecutive vectors of `dim` weights (for a
  // trellis, each tile of up to 32 rows × 8 columns is one code stream).
  impl->weight = at::empty({data.out_pad, data.in_pad}, at::kFloat);
  QCAL_RETURN_IF_ERROR(Annotate((*codebook)->CheckRows(data.out_pad), "QuipLinear"));
  kernels::DecodeMatrix(**codebook, data.codes.data(), data.out_pad, data.in_pad,
                        impl->weight.data_ptr<float>());
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
  at::Tensor y = model::LinearRows(h, WeightLike(m.weight, h));  // Ŵ (V x)
  y = m.tu.Inverse(y) * WeightLike(m.su, y);          // Uᵀ ŷ = diag(su)·T_uᵀ·ŷ
  if (d.out_pad > d.out_features) y = y.narrow(-1, 0, d.out_features);
  return y;
}

Status QuipLinear::MoveTo(const at::Device& device) {
  Impl& m = *impl_;
  if (m.weight.device() != device) m.weight = m.weight.to(device);
  if (m.su.device() != device) m.su = m.su.detach().to(device);
  if (m.sv.device() != device) m.sv = m.sv.detach().to(device);
  return Status();
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

}  // namespace qcal::methods::quip
