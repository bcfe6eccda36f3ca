#include "engine/qsim/kv_quantizer.h"

#include "absl/strings/str_cat.h"
#include "engine/qsim/act_quant.h"
#include "engine/qsim/bfp_kv.h"
#include "engine/qsim/fp8_kv.h"

namespace qcal::qsim {


StatusOr<std::shared_ptr<const KvQuantizer>> MakeKvQuantizer(const KvCacheSpec& spec,
                                                             const LlamaConfig& config,
                                                             int64_t layer,
                                                             const KvStaticRanges* ranges) {
  if (!spec.enabled()) return std::shared_ptr<const KvQuantizer>();
  const std::string where = absl::StrCat("block ", layer, " KV cache: ");
  if (spec.format == "bfp") return MakeBfpKvQuantizer(spec, config, layer);
  if (spec.format == "fp8") {
    if (ranges == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(where, "FP8 scales were not calibrated"));
    }
    StatusOr<std::shared_ptr<const Fp8KvQuantizer>> q = Fp8KvQuantizer::FromRanges(*ranges);
    if (!q.ok()) return Annotate(q.status(), absl::StrCat("block ", layer));
    return std::shared_ptr<const KvQuantizer>(*std::move(q));
  }
  if (spec.format != "int") {
    return absl::InvalidArgumentError(absl::StrCat(where, "unknown format '", spec.format, "'"));
  }
  IntKvQuantizer::Options o;
  o.grid = {spec.bits, spec.symmetric, spec.clip};
  o.group = spec.group;
  if (spec.granularity == "per_group") {
    o.granularity = IntKvQuantizer::Granularity::kPerGroup;
  } else if (spec.granularity == "per_token") {
    o.granularity = IntKvQuantizer::Granularity::kPerToken;
  } else if (spec.granularity == "per_tensor") {
    if (!spec.is_static) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "per_tensor KV quantization must be static (a dynamic per-tensor scale would "
                 "let later tokens change earlier cache entries)"));
    }
    if (ranges == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(where, "static ranges were not calibrated"));
    }
    o.granularity = IntKvQuantizer::Granularity::kPerTensor;
    o.ranges = *ranges;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "unknown granularity '", spec.granularity, "'"));
  }
  StatusOr<std::shared_ptr<const IntKvQuantizer>> q = IntKvQuantizer::Create(o, config.head_dim);
  if (!q.ok()) return Annotate(q.status(), absl::StrCat("block ", layer));
  return std::shared_ptr<const KvQuantizer>(*std::move(q));
}

}  // namespace qcal::qsim
