#include "engine/qsim/bfp_kv.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::qsim {

at::Tensor BfpFakeQuantizeLastDim(const at::Tensor& x, const kernels::BfpFormat& f) {
  const int64_t n = x.size(-1), bs = f.block_size, p = f.mantissa_bits;
  const int64_t blocks = (n + bs - 1) / bs;
  // Work in double: every step below is then exact (x / 2^k, rounding of a value < 2^7, M · 2^k),
  // which is what makes the result bit-identical to the kernel's.
  at::Tensor xd = x.to(at::kDouble).contiguous();
  if (blocks * bs != n) xd = at::constant_pad_nd(xd, {0, blocks * bs - n});  // zeros: max unchanged
  at::Tensor b = xd.view({-1, blocks, bs});
  at::Tensor amax = b.abs().amax(-1, /*keepdim=*/true);
  // frexp: amax = f·2^e with f ∈ [0.5, 1), so floor(log2 amax) = e - 1 (amax = 0 gives e = 0,
  // and then every mantissa is 0 whatever the scale).
  at::Tensor e = std::get<1>(at::frexp(amax)).to(at::kLong);
  at::Tensor shift = (e - 1).clamp(-127, 127) - (p - 2);  // log2 of the element scale
  // 2^shift built from its IEEE-754 bits (always a normal double here): exact.
  at::Tensor scale = at::bitwise_left_shift(shift + 1023, 52).view(at::kDouble);
  const double mmax = static_cast<double>((1 << (p - 1)) - 1);
  at::Tensor q = at::round(b / scale).clamp(-mmax, mmax) * scale;  // round: half to even
  q = q.view({-1, blocks * bs});
  if (blocks * bs != n) q = q.narrow(1, 0, n);
  return q.to(at::kFloat).reshape(x.sizes());
}

BfpKvQuantizer::BfpKvQuantizer(std::optional<kernels::BfpFormat> key_format,
                               std::optional<kernels::BfpFormat> query_format)
    : key_format_(key_format), query_format_(query_format) {}

at::Tensor BfpKvQuantizer::Apply(const at::Tensor& x, KvRole role) const {
  if (role == KvRole::kKey && key_format_) return BfpFakeQuantizeLastDim(x, *key_format_);
  if (role == KvRole::kQuery && query_format_) return BfpFakeQuantizeLastDim(x, *query_format_);
  return x;  // values, and roles without a format: unchanged
}

namespace {
std::string FormatName(const std::optional<kernels::BfpFormat>& f) {
  if (!f) return "float";
  return absl::StrCat("BFP", f->mantissa_bits + 8, " (", f->mantissa_bits, "-bit mantissas, block ",
                      f->block_size, ")");
}
}  // namespace

std::string BfpKvQuantizer::Describe() const {
  return absl::StrCat("keys after RoPE ", FormatName(key_format_), ", queries ",
                      FormatName(query_format_), ", values float");
}

BfpKeyProjection::BfpKeyProjection(std::unique_ptr<model::Linear> k_proj, int64_t head_dim,
                                   kernels::BfpFormat format)
    : inner_(std::move(k_proj)), head_dim_(head_dim), format_(format) {}

at::Tensor BfpKeyProjection::Forward(const at::Tensor& x) const {
  at::Tensor y = inner_->Forward(x);
  std::vector<int64_t> heads(y.sizes().begin(), y.sizes().end());
  heads.back() = y.size(-1) / head_dim_;
  heads.push_back(head_dim_);
  return BfpFakeQuantizeLastDim(y.reshape(heads), format_).view(y.sizes());
}

StatusOr<std::string> InstallBfpKeyCache(model::LlamaModel& m, const BfpKeyCacheOptions& o) {
  const int64_t d = m.config().head_dim;
  const int64_t block = o.block == 0 ? d : o.block;
  if (block < 1 || block > d) {
    return absl::InvalidArgumentError(absl::StrCat("BFP block size ", o.block, ": must be in [1, ",
                                                   "head_dim ", d, "] (0 = head_dim)"));
  }
  std::optional<kernels::BfpFormat> kf, qf;
  if (o.key_bits < 16) kf = kernels::BfpFormat{static_cast<int>(block), o.key_bits};
  if (o.query_bits < 16) qf = kernels::BfpFormat{static_cast<int>(block), o.query_bits};
  if (kf) QCAL_RETURN_IF_ERROR(Annotate(kernels::ValidateBfpFormat(*kf), "BFP keys"));
  if (qf) QCAL_RETURN_IF_ERROR(Annotate(kernels::ValidateBfpFormat(*qf), "BFP queries"));
  const bool pre = o.point == KeyQuantPoint::kPreRope;
  auto hook = std::make_shared<BfpKvQuantizer>(pre ? std::optional<kernels::BfpFormat>() : kf, qf);
  constexpr int kK = static_cast<int>(model::LinearKind::kK);
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    if (dynamic_cast<const BfpKeyProjection*>(m.block(l).weights().linears[kK].get())) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", l, " already has a BFP key projection"));
    }
  }
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    model::DecoderBlock& b = m.mutable_block(l);
    if (pre && kf) {
      auto& slot = b.mutable_weights().linears[kK];
      slot = std::make_unique<BfpKeyProjection>(std::move(slot), d, *kf);
    }
    if ((!pre && kf) || qf) {
      model::BlockHooks h = b.hooks();
      h.kv_cache = hook;
      b.set_hooks(std::move(h));
    }
  }
  return absl::StrCat("keys ", pre ? "before" : "after", " RoPE ", FormatName(kf), ", queries ",
                      FormatName(qf), ", values float");
}

StatusOr<kernels::BfpFormat> BfpKeyFormat(const KvCacheSpec& spec, const LlamaConfig& config,
                                          int64_t layer) {
  if (spec.format != "bfp") {
    return absl::InvalidArgumentError(
        absl::StrCat("BfpKeyFormat: kv_cache.format is '", spec.format, "', not bfp"));
  }
  if (spec.group < 0 || spec.group > config.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_cache.group ", spec.group, ": the BFP block size must be in [1, head_dim ",
                     config.head_dim, "] (0 = head_dim), layer ", layer));
  }
  kernels::BfpFormat f{static_cast<int>(spec.group == 0 ? config.head_dim : spec.group), spec.bits};
  QCAL_RETURN_IF_ERROR(Annotate(kernels::ValidateBfpFormat(f), "kv_cache (format bfp)"));
  return f;
}

StatusOr<std::shared_ptr<const KvQuantizer>> MakeBfpKvQuantizer(const KvCacheSpec& spec,
                                                                const LlamaConfig& config,
                                                                int64_t layer) {
  QCAL_ASSIGN_OR_RETURN(kernels::BfpFormat f, BfpKeyFormat(spec, config, layer));
  std::optional<kernels::BfpFormat> keys;
  if (spec.key_point == "post_rope") keys = f;
  return std::shared_ptr<const KvQuantizer>(
      std::make_shared<BfpKvQuantizer>(keys, kernels::BfpFormat::Bfp16(f.block_size)));
}

}  // namespace qcal::qsim
