#include "engine/qsim/rotate.h"

#include <algorithm>
#include <array>
#include <functional>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/seed.h"
#include "engine/model/linear_slots.h"
#include "kernels/hadamard.h"
#include "engine/qsim/act_quant.h"

namespace qcal::qsim {
namespace {

using model::LinearKind;

// The orthogonal transform of one rotation: a plain normalized Hadamard (R2), a randomized
// Hadamard (R1), or, for sizes without a Hadamard matrix, the seeded randomized FFT.
struct Ortho {
  int64_t n = 0;
  bool randomized = false;
  uint64_t seed = 0;
  at::Tensor matrix;  // a learned T [n, n] float64, instead of the above
};

// Applies T along `axis` of a row-major [rows, cols] double matrix (kRows: A ← A·Tᵀ; kColumns:
// A ← T·A).
Status ApplyOrtho(double* a, int64_t rows, int64_t cols, MatrixAxis axis, const Ortho& t) {
  if (t.matrix.defined()) {
    at::Tensor view = at::from_blob(a, {rows, cols}, at::kDouble);
    const at::Tensor out = axis == MatrixAxis::kRows
                               ? at::matmul(view.view({-1, t.n}), t.matrix.t()).view({rows, cols})
                               : at::matmul(t.matrix, view.view({t.n, -1})).view({rows, cols});
    view.copy_(out);
    return Status();
  }
  const bool hadamard = PlanHadamard(t.n).IsHadamard();
  if (hadamard && !t.randomized) return HadamardTransformMatrix(a, rows, cols, axis, false);
  return RandomizedOrthogonalTransformMatrix(a, rows, cols, axis, t.seed,
                                             TransformDirection::kForward);
}

// w [rows, cols] float -> transformed copy (computed in double).
StatusOr<at::Tensor> Transformed(const at::Tensor& w, int64_t rows, int64_t cols, MatrixAxis axis,
                                 const Ortho& t) {
  at::Tensor d = w.to(at::kDouble).contiguous().clone();
  QCAL_RETURN_IF_ERROR(ApplyOrtho(d.data_ptr<double>(), rows, cols, axis, t));
  return d.to(at::kFloat);
}

Ortho R1Transform(const RotationPlan& plan) {
  return {plan.hidden, true, plan.seed, plan.r1_matrix};
}
StatusOr<Ortho> R2Transform(const RotationPlan& plan, int64_t layer) {
  Ortho t{plan.head_dim, false, SplitMix64(plan.seed ^ 2), at::Tensor()};
  if (plan.r2_matrices.defined()) {
    if (layer < 0 || layer >= plan.r2_matrices.size(0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "R2: the plan has learned rotations for ", plan.r2_matrices.size(0),
          " blocks; block ", layer, " has none"));
    }
    t.matrix = plan.r2_matrices[layer];
  }
  return t;
}

at::Tensor Weight(const model::BlockWeights& w, LinearKind k) {
  return w.linear(k).DenseWeight().to(at::kFloat).contiguous();
}

}  // namespace

std::string RotationPlan::Describe() const {
  std::vector<std::string> on;
  if (r1) on.push_back("R1");
  if (r2) on.push_back("R2");
  if (r3) on.push_back("R3");
  if (r4) on.push_back(r4_block > 0 ? absl::StrCat("R4 (blocks of ", r4_block, ")") : "R4");
  std::string s = on.empty() ? "none" : absl::StrJoin(on, " ");
  if (r1_matrix.defined() || r2_matrices.defined()) {
    absl::StrAppend(&s, " (learned", r1_matrix.defined() ? " R1" : "",
                    r2_matrices.defined() ? " R2" : "", ")");
  }
  if (!warnings.empty()) absl::StrAppend(&s, " (", absl::StrJoin(warnings, "; "), ")");
  return s;
}

StatusOr<RotationPlan> PlanRotations(const RotationSpec& spec, const LlamaConfig& config) {
  RotationPlan plan;
  plan.seed = spec.seed;
  plan.hidden = config.hidden_size;
  plan.head_dim = config.head_dim;
  plan.intermediate = config.intermediate_size;
  if (!spec.enabled) return plan;
  auto offline = [&](bool wanted, int64_t n, const char* name, const char* what) -> Status {
    if (!wanted) return Status();
    const HadamardPlan p = PlanHadamard(n);
    if (p.kind == HadamardKind::kNone) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": no orthogonal transform of ", what,
                                                     " ", n, " (odd size)"));
    }
    if (!p.IsHadamard()) {
      plan.warnings.push_back(absl::StrCat(name, ": no Hadamard matrix of ", what, " ", n,
                                           ", randomized FFT used instead (offline, exact)"));
    }
    return Status();
  };
  QCAL_RETURN_IF_ERROR(offline(spec.r1, plan.hidden, "R1", "hidden size"));
  QCAL_RETURN_IF_ERROR(offline(spec.r2, plan.head_dim, "R2", "head_dim"));
  plan.r1 = spec.r1;
  plan.r2 = spec.r2;
  auto online = [&](bool wanted, int64_t n, const char* name, const char* what) {
    if (!wanted) return false;
    const HadamardPlan p = PlanHadamard(n);
    if (p.IsHadamard()) return true;
    plan.warnings.push_back(absl::StrCat(name, " skipped: no Hadamard matrix of ", what, " ", n,
                                         " (", DescribeHadamardPlan(p),
                                         "); the other rotations are kept"));
    return false;
  };
  plan.r3 = online(spec.r3, plan.head_dim, "R3", "head_dim");
  // R4 acts on every down_proj input: the dense MLPs' and, in a mixture of experts, each routed
  // expert's (Llama 4's dense layers are intermediate_size_mlp wide, its experts
  // intermediate_size). One rule for all of them: every size must have its transform.
  std::vector<int64_t> sizes = {plan.intermediate};
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (std::find(sizes.begin(), sizes.end(), config.MlpSize(l)) == sizes.end()) {
      sizes.push_back(config.MlpSize(l));
    }
  }
  if (spec.r4 && spec.r4_block != 0) {
    // The block-diagonal Sylvester R4 exists whenever the block divides the size.
    int64_t b = spec.r4_block;
    auto divides_all = [&](int64_t block) {
      for (int64_t n : sizes) {
        if (n % block != 0) return false;
      }
      return true;
    };
    if (b == RotationSpec::kR4BlockAuto) {
      b = 1;
      while (divides_all(2 * b) && 2 * b <= OnlineHadamard::kDenseLimit) b *= 2;
    }
    if (b < 2 || !divides_all(b)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rotation.r4_block ", spec.r4_block == RotationSpec::kR4BlockAuto ? "auto" : "",
          b >= 2 ? absl::StrCat(b) : "", ": no block of a power of two >= 2 divides the "
          "intermediate size", sizes.size() > 1 ? "s " : " ", absl::StrJoin(sizes, " and ")));
    }
    plan.r4 = true;
    plan.r4_block = b;
  } else {
    plan.r4 = spec.r4;
    for (int64_t n : sizes) plan.r4 = plan.r4 && online(true, n, "R4", "intermediate size");
  }
  for (const std::string& w : plan.warnings) QCAL_LOG_WARN("rotation plan: {}", w);
  return plan;
}

StatusOr<std::pair<at::Tensor, at::Tensor>> DenseRotations(const RotationPlan& plan,
                                                           int64_t layers) {
  // T = T·I: each rotation applied to the columns of the identity.
  at::Tensor t1 = at::eye(plan.hidden, at::kDouble).contiguous();
  QCAL_RETURN_IF_ERROR(
      ApplyOrtho(t1.data_ptr<double>(), plan.hidden, plan.hidden, MatrixAxis::kColumns,
                 R1Transform(plan)));
  std::vector<at::Tensor> t2;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor t = at::eye(plan.head_dim, at::kDouble).contiguous();
    QCAL_ASSIGN_OR_RETURN(const Ortho o, R2Transform(plan, l));
    QCAL_RETURN_IF_ERROR(ApplyOrtho(t.data_ptr<double>(), plan.head_dim, plan.head_dim,
                                    MatrixAxis::kColumns, o));
    t2.push_back(t);
  }
  return std::make_pair(t1, at::stack(t2, 0));
}

Status SetLearnedRotations(RotationPlan* plan, const at::Tensor& r1, const at::Tensor& r2,
                           int64_t layers) {
  auto check = [](const at::Tensor& t, const std::vector<int64_t>& shape, bool applied,
                  const char* name) -> Status {
    if (!t.defined()) return Status();
    if (!applied) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": a learned rotation for a plan that does not apply ", name));
    }
    if (t.sizes().vec() != shape) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": learned rotation [",
                                                     absl::StrJoin(t.sizes(), ", "),
                                                     "], expected [",
                                                     absl::StrJoin(shape, ", "), "]"));
    }
    const at::Tensor d = t.to(at::kDouble).reshape({-1, shape.back(), shape.back()});
    const at::Tensor eye = at::eye(shape.back(), at::kDouble);
    const double err = (at::matmul(d, d.transpose(1, 2)) - eye).abs().max().item<double>();
    if (!(err <= 1e-6)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": learned rotation is not orthogonal (|T·Tᵀ − I| = ", err, ")"));
    }
    return Status();
  };
  QCAL_RETURN_IF_ERROR(check(r1, {plan->hidden, plan->hidden}, plan->r1, "R1"));
  QCAL_RETURN_IF_ERROR(check(r2, {layers, plan->head_dim, plan->head_dim}, plan->r2, "R2"));
  plan->r1_matrix = r1.defined() ? r1.to(at::kDouble).contiguous() : at::Tensor();
  plan->r2_matrices = r2.defined() ? r2.to(at::kDouble).contiguous() : at::Tensor();
  return Status();
}

Status RotateBlockWeights(model::BlockWeights& w, const LlamaConfig& config,
                          const RotationPlan& plan, int64_t layer) {
  const int64_t hid = config.hidden_size, d = config.head_dim;
  // The float weights of every linear the block has (a Mixtral MoE block has no dense MLP), and
  // of its routed experts (gate, up, down each), transformed below and installed at the end.
  at::Tensor weights[7];
  for (LinearKind k : model::kAllLinears) {
    if (w.has(k)) weights[static_cast<int>(k)] = Weight(w, k);
  }
  auto at_kind = [&](LinearKind k) -> at::Tensor& { return weights[static_cast<int>(k)]; };
  std::vector<std::array<at::Tensor, 3>> experts;
  if (w.moe != nullptr) {
    for (const model::ExpertWeights& ex : w.moe->experts) {
      std::array<at::Tensor, 3> e;
      for (model::ExpertLinear k : model::kExpertLinears) {
        e[static_cast<int>(k)] = ex.linear(k).DenseWeight().to(at::kFloat).contiguous();
      }
      experts.push_back(std::move(e));
    }
  }
  // Visits the weights that read the normalised residual after attention (the MLP's or shared
  // expert's gate/up, the router, every expert's gate/up), and those that write the residual
  // from the feed-forward (down_proj, every expert's down_proj).
  auto ffn_readers = [&](const std::function<Status(at::Tensor&)>& fn) -> Status {
    for (LinearKind k : {LinearKind::kGate, LinearKind::kUp}) {
      if (at_kind(k).defined()) QCAL_RETURN_IF_ERROR(fn(at_kind(k)));
    }
    if (w.moe != nullptr) QCAL_RETURN_IF_ERROR(fn(w.moe->router));
    for (auto& e : experts) {
      QCAL_RETURN_IF_ERROR(fn(e[static_cast<int>(model::ExpertLinear::kGate)]));
      QCAL_RETURN_IF_ERROR(fn(e[static_cast<int>(model::ExpertLinear::kUp)]));
    }
    return Status();
  };
  auto ffn_writers = [&](const std::function<Status(at::Tensor&)>& fn) -> Status {
    if (at_kind(LinearKind::kDown).defined()) QCAL_RETURN_IF_ERROR(fn(at_kind(LinearKind::kDown)));
    for (auto& e : experts) QCAL_RETURN_IF_ERROR(fn(e[static_cast<int>(model::ExpertLinear::kDown)]));
    return Status();
  };
  if (plan.fuse_norms()) {
    const at::Tensor a_in = w.input_norm.to(at::kDouble), a_post = w.post_norm.to(at::kDouble);
    for (LinearKind k : {LinearKind::kQ, LinearKind::kK, LinearKind::kV}) {
      at_kind(k) = (at_kind(k).to(at::kDouble) * a_in).to(at::kFloat);
    }
    QCAL_RETURN_IF_ERROR(ffn_readers([&](at::Tensor& x) {
      x = (x.to(at::kDouble) * a_post).to(at::kFloat);
      return Status();
    }));
    w.input_norm = at::ones_like(w.input_norm);
    w.post_norm = at::ones_like(w.post_norm);
  }
  if (plan.r1) {
    const Ortho t1 = R1Transform(plan);
    auto input_side = [&](at::Tensor& x) -> Status {
      QCAL_ASSIGN_OR_RETURN(x, Transformed(x, x.size(0), hid, MatrixAxis::kRows, t1));
      return Status();
    };
    auto output_side = [&](at::Tensor& x) -> Status {
      QCAL_ASSIGN_OR_RETURN(x, Transformed(x, hid, x.size(1), MatrixAxis::kColumns, t1));
      return Status();
    };
    for (LinearKind k : {LinearKind::kQ, LinearKind::kK, LinearKind::kV}) {
      QCAL_RETURN_IF_ERROR(input_side(at_kind(k)));
    }
    QCAL_RETURN_IF_ERROR(ffn_readers(input_side));
    QCAL_RETURN_IF_ERROR(output_side(at_kind(LinearKind::kO)));
    QCAL_RETURN_IF_ERROR(ffn_writers(output_side));
  }
  if (plan.r2) {
    QCAL_ASSIGN_OR_RETURN(const Ortho t2, R2Transform(plan, layer));
    // v_proj [kv_heads·d, hid]: each head's d rows as [d, hid] (contiguous): T2·W_v^(h).
    at::Tensor& v = at_kind(LinearKind::kV);
    at::Tensor vd = v.to(at::kDouble).contiguous().clone();
    for (int64_t h = 0; h < config.num_key_value_heads; ++h) {
      QCAL_RETURN_IF_ERROR(ApplyOrtho(vd.data_ptr<double>() + h * d * hid, d, hid,
                                      MatrixAxis::kColumns, t2));
    }
    v = vd.to(at::kFloat);
    // o_proj [hid, heads·d]: every row is heads segments of d: viewed as [hid·heads, d], each
    // segment becomes segment·T2ᵀ.
    at::Tensor& o = at_kind(LinearKind::kO);
    QCAL_ASSIGN_OR_RETURN(at::Tensor od, Transformed(o.reshape({-1, d}), o.numel() / d, d,
                                                     MatrixAxis::kRows, t2));
    o = od.view(o.sizes());
  }
  if (plan.r4) {
    // W_down ← W_down·T4ᵀ with the T4 of OnlineHadamard (HadamardTransform, no transpose);
    // block-diagonal: each run of r4_block inputs of a row alone.
    QCAL_RETURN_IF_ERROR(ffn_writers([&](at::Tensor& down) -> Status {
      at::Tensor dd = down.to(at::kDouble).contiguous().clone();
      const int64_t b = plan.r4_block > 0 ? plan.r4_block : dd.size(1);
      QCAL_RETURN_IF_ERROR(HadamardTransformMatrix(dd.data_ptr<double>(), dd.numel() / b, b,
                                                   MatrixAxis::kRows, false));
      down = dd.to(at::kFloat);
      return Status();
    }));
  }
  for (LinearKind k : model::kAllLinears) {
    if (!at_kind(k).defined()) continue;
    w.linears[static_cast<int>(k)] =
        std::make_unique<model::DenseLinear>(at_kind(k).contiguous());
  }
  for (size_t e = 0; e < experts.size(); ++e) {
    for (model::ExpertLinear k : model::kExpertLinears) {
      w.moe->experts[e].linears[static_cast<int>(k)] =
          std::make_unique<model::DenseLinear>(experts[e][static_cast<int>(k)].contiguous());
    }
  }
  if (w.moe != nullptr) w.moe->router = w.moe->router.contiguous();
  return Status();
}

StatusOr<std::shared_ptr<const OnlineHadamard>> R4Transform(const RotationPlan& plan) {
  return R4Transform(plan, plan.intermediate);
}

StatusOr<std::shared_ptr<const OnlineHadamard>> R4Transform(const RotationPlan& plan, int64_t n) {
  if (plan.r4_block > 0) return OnlineHadamard::CreateBlockDiagonal(n, plan.r4_block);
  return OnlineHadamard::Create(n);
}

StatusOr<R4Transforms> R4Transforms::Create(const RotationPlan& plan) {
  R4Transforms t;
  t.plan_ = &plan;
  return t;
}

StatusOr<std::shared_ptr<const OnlineHadamard>> R4Transforms::For(int64_t n) {
  auto it = by_size_.find(n);
  if (it != by_size_.end()) return it->second;
  QCAL_ASSIGN_OR_RETURN(std::shared_ptr<const OnlineHadamard> t, R4Transform(*plan_, n));
  by_size_[n] = t;
  return t;
}

Status InstallOnlineRotations(model::DecoderBlock& block, const RotationPlan& plan) {
  model::BlockHooks hooks = block.hooks();
  if (plan.r3) {
    QCAL_ASSIGN_OR_RETURN(auto t3, OnlineHadamard::Create(plan.head_dim));
    hooks.qk_rotation = t3->transposed_matrix();
  }
  block.set_hooks(std::move(hooks));
  if (!plan.r4) return Status();
  QCAL_ASSIGN_OR_RETURN(R4Transforms t4, R4Transforms::Create(plan));
  Status status;
  model::ForEachLinearSlot(block.mutable_weights(),
                           [&](LinearKind role, int64_t, std::unique_ptr<model::Linear>& slot) {
                             if (role != LinearKind::kDown || !status.ok()) return;
                             auto t = t4.For(slot->in_features());
                             if (!t.ok()) {
                               status = t.status();
                               return;
                             }
                             slot = std::make_unique<ActQuantLinear>(std::move(slot), *t, nullptr);
                           });
  return status;
}

Status RotateNonBlockWeights(model::NonBlockWeights& w, const RotationPlan& plan) {
  if (!plan.r1) return Status();
  QCAL_ASSIGN_OR_RETURN(at::Tensor head, RotateHeadRows(w.head, w.final_norm, plan));
  QCAL_ASSIGN_OR_RETURN(at::Tensor embed, RotateEmbeddingRows(w.embed, plan));
  w.embed = embed;
  w.final_norm = FusedFinalNorm(w.final_norm, plan);
  w.head = head;
  w.head_tied = false;
  return Status();
}

StatusOr<at::Tensor> RotateEmbeddingRows(const at::Tensor& rows, const RotationPlan& plan) {
  if (!plan.r1) return rows;
  const int64_t hid = plan.hidden;
  if (rows.size(-1) != hid) {
    return absl::InvalidArgumentError(absl::StrCat("R1: embedding rows have ", rows.size(-1),
                                                   " columns, expected the hidden size ", hid));
  }
  const at::Tensor flat = rows.reshape({-1, hid});
  QCAL_ASSIGN_OR_RETURN(at::Tensor rotated, Transformed(flat, flat.size(0), hid,
                                                        MatrixAxis::kRows, R1Transform(plan)));
  return rotated.view(rows.sizes());
}

StatusOr<at::Tensor> RotateHeadRows(const at::Tensor& rows, const at::Tensor& final_norm,
                                    const RotationPlan& plan) {
  if (!plan.r1) return rows;
  const int64_t hid = plan.hidden;
  if (rows.dim() != 2 || rows.size(1) != hid || final_norm.numel() != hid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "R1: head rows [", absl::StrJoin(rows.sizes(), ", "), "] and final norm [",
        final_norm.numel(), "] do not match the hidden size ", hid));
  }
  // The final norm fused into the head (in double), then the head rotated on its input side.
  const at::Tensor fused =
      (rows.to(at::kDouble) * final_norm.to(at::kDouble)).to(at::kFloat).contiguous();
  return Transformed(fused, fused.size(0), hid, MatrixAxis::kRows, R1Transform(plan));
}

at::Tensor FusedFinalNorm(const at::Tensor& final_norm, const RotationPlan& plan) {
  return plan.r1 ? at::ones_like(final_norm) : final_norm;
}

Status RotateNonBlockWeights(model::LlamaModel& m, const RotationPlan& plan) {
  if (!plan.r1) return Status();
  model::NonBlockWeights w;
  w.embed = m.embed_weight();
  w.final_norm = m.final_norm();
  w.head = m.head().DenseWeight();
  QCAL_RETURN_IF_ERROR(RotateNonBlockWeights(w, plan));
  m.set_embed_weight(w.embed);
  m.set_final_norm(w.final_norm);
  m.set_head(std::make_unique<model::DenseLinear>(w.head));
  return Status();
}

Status RotateModel(model::LlamaModel& m, const RotationPlan& plan) {
  for (int64_t l = 0; l < m.num_blocks(); ++l) {
    model::DecoderBlock& block = m.mutable_block(l);
    QCAL_RETURN_IF_ERROR(RotateBlockWeights(block.mutable_weights(), m.config(), plan, l));
    QCAL_RETURN_IF_ERROR(InstallOnlineRotations(block, plan));
  }
  return RotateNonBlockWeights(m, plan);
}

}  // namespace qcal::qsim
