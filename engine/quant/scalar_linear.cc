#include "engine/quant/scalar_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "kernels/scalar_quant.h"
#include "engine/model/llama.h"
#include "engine/model/tensor_io.h"

namespace qcal::quant {

using model::FindChecked;
using model::ReadF32Checked;
using model::ReadInts;
using model::ShapeStr;
using model::WeightLike;

namespace {

int64_t NumGroups(const ScalarLinearData& d) {
  return d.group_size == -1 ? 1 : (d.in_features + d.group_size - 1) / d.group_size;
}

// Packs `count` values of `bits` bits into a little-endian bit stream of 32-bit words.
// Words of a packed run of `count` values (the last one zero-padded when partial).
int64_t PackedWords(int64_t count, int bits) { return (count * bits + 31) / 32; }

void PackBitStream(const uint32_t* values, int64_t count, int bits, uint32_t* words) {
  const int64_t nwords = PackedWords(count, bits);
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

Status CheckScalarLinearData(ScalarLinearData* data_out) {
  ScalarLinearData& data = *data_out;
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

  return Status();
}

StatusOr<std::unique_ptr<ScalarQuantLinear>> ScalarQuantLinear::Create(ScalarLinearData data) {
  QCAL_RETURN_IF_ERROR(CheckScalarLinearData(&data));
  const int64_t in = data.in_features, out = data.out_features, groups = NumGroups(data);
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
  return model::LinearRows(x, WeightLike(impl_->weight, x));
}
Status ScalarQuantLinear::MoveTo(const at::Device& device) {
  if (impl_->weight.device() != device) impl_->weight = impl_->weight.to(device);
  return Status();
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

StatusOr<GptqTensors> ScalarQuantLinear::ExportGptq(bool pad_words) const {
  return PackGptq(impl_->data, pad_words);
}

StatusOr<GptqTensors> PackGptq(const ScalarLinearData& d, bool pad_words) {
  const int b = d.bits;
  if (b != 2 && b != 3 && b != 4 && b != 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPTQ export supports 2, 3, 4 and 8 bits (AutoGPTQ's packings), not ", b));
  }
  if (!pad_words && ((d.in_features * b) % 32 != 0 || (d.out_features * b) % 32 != 0)) {
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
  const int64_t wrows = PackedWords(in, b), zcols = PackedWords(out, b);
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

StatusOr<ScalarLinearData> ScalarQuantLinear::ReadGrid(CheckpointReader& ckpt,
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
  return d;
}

namespace {

std::string LayerIn(const CheckpointReader& ckpt, const std::string& prefix) {
  return absl::StrCat("ScalarQuantLinear '", prefix, "' in ", ckpt.dir());
}

// The stored tensors of layer `prefix`, not yet checked (ReadScalarLinear checks them; Load
// leaves that to Create, which checks once).
StatusOr<ScalarLinearData> ReadStored(CheckpointReader& ckpt, const std::string& prefix) {
  auto fail = [&](const Status& s) { return Annotate(s, LayerIn(ckpt, prefix)); };
  QCAL_ASSIGN_OR_RETURN(ScalarLinearData d, ScalarQuantLinear::ReadGrid(ckpt, prefix));
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
  return d;
}

}  // namespace

StatusOr<ScalarLinearData> ReadScalarLinear(CheckpointReader& ckpt, const std::string& prefix) {
  QCAL_ASSIGN_OR_RETURN(ScalarLinearData d, ReadStored(ckpt, prefix));
  if (Status checked = CheckScalarLinearData(&d); !checked.ok()) {
    return Annotate(checked, LayerIn(ckpt, prefix));
  }
  return d;
}

StatusOr<std::unique_ptr<ScalarQuantLinear>> ScalarQuantLinear::Load(CheckpointReader& ckpt,
                                                                     const std::string& prefix) {
  QCAL_ASSIGN_OR_RETURN(ScalarLinearData d, ReadStored(ckpt, prefix));
  StatusOr<std::unique_ptr<ScalarQuantLinear>> layer = Create(std::move(d));
  if (!layer.ok()) return Annotate(layer.status(), LayerIn(ckpt, prefix));
  return layer;
}

}  // namespace qcal::quant
