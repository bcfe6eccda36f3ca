#include "engine/qsim/ksort.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace qcal::qsim {
namespace {

Status CheckHeadWeight(const at::Tensor& w, int64_t kv_heads, int64_t head_dim, const char* what) {
  if (!w.defined() || w.dim() != 2 || w.size(0) != kv_heads * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": expected [", kv_heads * head_dim, ", hidden] (", kv_heads, " KV heads x ",
        head_dim, "), got ", w.defined() ? absl::StrCat(w.dim(), "-d") : std::string("nothing"),
        w.defined() && w.dim() == 2 ? absl::StrCat(" [", w.size(0), ", ", w.size(1), "]") : ""));
  }
  return absl::OkStatus();
}

// Row norms in double, [kv_heads, head_dim].
std::vector<double> RowNorms(const at::Tensor& w) {
  at::Tensor n = w.to(at::kDouble).pow(2).sum(1).sqrt().contiguous();
  return std::vector<double>(n.data_ptr<double>(), n.data_ptr<double>() + n.numel());
}

// Indices of `keys` sorted descending, ties by index.
std::vector<int64_t> ArgsortDescending(const std::vector<double>& keys) {
  std::vector<int64_t> idx(keys.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return keys[a] > keys[b]; });
  return idx;
}

at::Tensor ToPermTensor(const std::vector<int64_t>& v, int64_t rows, int64_t cols) {
  return at::from_blob(const_cast<int64_t*>(v.data()), {rows, cols}, at::kLong).clone();
}

// Global row indices for `heads` heads of width d where head h uses perm row h / rep.
at::Tensor ExpandHeadPerm(const at::Tensor& perm, int64_t heads, int64_t rep) {
  const int64_t d = perm.size(1);
  at::Tensor per_head = perm.repeat_interleave(rep, 0);  // [heads, d]
  at::Tensor base = (at::arange(heads, at::kLong) * d).unsqueeze(1);
  return (per_head + base).reshape({-1});
}

Status CheckPerm(const at::Tensor& p, int64_t kv_heads, int64_t d, const char* what) {
  if (!p.defined() || p.scalar_type() != at::kLong || p.dim() != 2 || p.size(0) != kv_heads ||
      p.size(1) != d) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected an int64 [", kv_heads, ", ", d, "] permutation"));
  }
  at::Tensor sorted = std::get<0>(p.sort(1));
  if (!sorted.equal(at::arange(d, at::kLong).expand({kv_heads, d}))) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a row is not a permutation of [0, ", d, ")"));
  }
  return absl::OkStatus();
}

StatusOr<at::Tensor> DenseOf(const model::BlockWeights& w, model::LinearKind kind) {
  const model::Linear& lin = w.linear(kind);
  if (dynamic_cast<const model::DenseLinear*>(&lin) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(model::LinearName(kind),
                     " is not a dense float linear: K-sort permutes the float model, before "
                     "weight quantization"));
  }
  return lin.DenseWeight();
}

}  // namespace

StatusOr<at::Tensor> KSortPermutation(const at::Tensor& w_k, int64_t kv_heads, int64_t d,
                                      KSortOrder order) {
  QCAL_RETURN_IF_ERROR(CheckHeadWeight(w_k, kv_heads, d, "k_proj"));
  if (d % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", d, " is odd: RoPE needs pairs"));
  }
  const std::vector<double> norms = RowNorms(w_k);
  const int64_t half = d / 2;
  std::vector<int64_t> perm(kv_heads * d);
  for (int64_t g = 0; g < kv_heads; ++g) {
    const double* n = norms.data() + g * d;
    int64_t* p = perm.data() + g * d;
    if (order == KSortOrder::kChannels) {
      std::vector<int64_t> idx = ArgsortDescending(std::vector<double>(n, n + d));
      std::copy(idx.begin(), idx.end(), p);
    } else {
      std::vector<double> pair(half);
      for (int64_t i = 0; i < half; ++i)
        pair[i] = std::sqrt(n[i] * n[i] + n[i + half] * n[i + half]);
      std::vector<int64_t> sigma = ArgsortDescending(pair);
      for (int64_t m = 0; m < half; ++m) {
        p[2 * m] = sigma[m];
        p[2 * m + 1] = sigma[m] + half;
      }
    }
  }
  return ToPermTensor(perm, kv_heads, d);
}

StatusOr<at::Tensor> RowNormPermutation(const at::Tensor& w, int64_t kv_heads, int64_t d) {
  QCAL_RETURN_IF_ERROR(CheckHeadWeight(w, kv_heads, d, "v_proj"));
  const std::vector<double> norms = RowNorms(w);
  std::vector<int64_t> perm(kv_heads * d);
  for (int64_t g = 0; g < kv_heads; ++g) {
    std::vector<int64_t> idx =
        ArgsortDescending(std::vector<double>(norms.begin() + g * d, norms.begin() + (g + 1) * d));
    std::copy(idx.begin(), idx.end(), perm.begin() + g * d);
  }
  return ToPermTensor(perm, kv_heads, d);
}

Status PermuteBlockHeads(const LlamaConfig& c, model::BlockWeights& w, const at::Tensor& key_perm,
                         const at::Tensor& value_perm) {
  using model::LinearKind;
  const int64_t kv = c.num_key_value_heads, heads = c.num_attention_heads, d = c.head_dim;
  const int64_t rep = c.gqa_groups();
  at::NoGradGuard no_grad;
  if (key_perm.defined()) {
    QCAL_RETURN_IF_ERROR(CheckPerm(key_perm, kv, d, "key permutation"));
    QCAL_ASSIGN_OR_RETURN(at::Tensor wq, DenseOf(w, LinearKind::kQ));
    QCAL_ASSIGN_OR_RETURN(at::Tensor wk, DenseOf(w, LinearKind::kK));
    w.linears[static_cast<int>(LinearKind::kK)] =
        std::make_unique<model::DenseLinear>(wk.index_select(0, ExpandHeadPerm(key_perm, kv, 1)));
    w.linears[static_cast<int>(LinearKind::kQ)] = std::make_unique<model::DenseLinear>(
        wq.index_select(0, ExpandHeadPerm(key_perm, heads, rep)));
    // New channel j holds what channel key_perm[j] held, which was half-split channel
    // rope_perm[key_perm[j]] (or key_perm[j] itself without a previous permutation).
    w.rope_perm = w.rope_perm.defined() ? w.rope_perm.gather(1, key_perm) : key_perm.clone();
  }
  if (value_perm.defined()) {
    QCAL_RETURN_IF_ERROR(CheckPerm(value_perm, kv, d, "value permutation"));
    QCAL_ASSIGN_OR_RETURN(at::Tensor wv, DenseOf(w, LinearKind::kV));
    QCAL_ASSIGN_OR_RETURN(at::Tensor wo, DenseOf(w, LinearKind::kO));
    w.linears[static_cast<int>(LinearKind::kV)] =
        std::make_unique<model::DenseLinear>(wv.index_select(0, ExpandHeadPerm(value_perm, kv, 1)));
    w.linears[static_cast<int>(LinearKind::kO)] = std::make_unique<model::DenseLinear>(
        wo.index_select(1, ExpandHeadPerm(value_perm, heads, rep)));
  }
  return absl::OkStatus();
}

StatusOr<at::Tensor> KSortBlock(const LlamaConfig& c, model::BlockWeights& w,
                                const KSortOptions& o) {
  QCAL_ASSIGN_OR_RETURN(at::Tensor wk, DenseOf(w, model::LinearKind::kK));
  QCAL_ASSIGN_OR_RETURN(at::Tensor kp,
                        KSortPermutation(wk, c.num_key_value_heads, c.head_dim, o.order));
  at::Tensor vp;
  if (o.sort_values) {
    QCAL_ASSIGN_OR_RETURN(at::Tensor wv, DenseOf(w, model::LinearKind::kV));
    QCAL_ASSIGN_OR_RETURN(vp, RowNormPermutation(wv, c.num_key_value_heads, c.head_dim));
  }
  QCAL_RETURN_IF_ERROR(PermuteBlockHeads(c, w, kp, vp));
  return kp;
}

StatusOr<std::vector<at::Tensor>> ApplyKSort(model::LlamaModel& m, const KSortOptions& o) {
  std::vector<at::Tensor> perms;
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    auto kp = KSortBlock(m.config(), m.mutable_block(l).mutable_weights(), o);
    if (!kp.ok()) return Annotate(kp.status(), absl::StrCat("K-sort, block ", l));
    perms.push_back(*kp);
  }
  return perms;
}

}  // namespace qcal::qsim
