#include "tools/plant_outliers.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "tools/model_dir.h"

namespace qcal::tools {
namespace {

// `count` distinct values of [0, n), sorted: a partial Fisher–Yates shuffle driven by
// mt19937_64 (whose output sequence the standard fixes, so plans agree across platforms).
std::vector<int64_t> DrawDistinct(std::mt19937_64& rng, int64_t n, int64_t count) {
  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = i + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - i));
    std::swap(all[i], all[j]);
  }
  std::vector<int64_t> out(all.begin(), all.begin() + count);
  std::sort(out.begin(), out.end());
  return out;
}

Status CheckShape(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  if (!t.defined() || t.dim() != 2 || t.size(0) != rows || t.size(1) != cols ||
      t.scalar_type() != at::kFloat) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected a float32 [", rows, ", ", cols, "] weight, got ",
        t.defined()
            ? absl::StrCat(t.dim(), "-d ", std::string(at::toString(t.scalar_type())), " [",
                           t.dim() > 0 ? t.size(0) : 0, ", ", t.dim() > 1 ? t.size(1) : 0, "]")
            : std::string("nothing")));
  }
  return absl::OkStatus();
}

}  // namespace

Status ValidatePlantOutliersOptions(const LlamaConfig& c, const PlantOutliersOptions& o) {
  if (!(std::isfinite(o.alpha) && o.alpha > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--alpha ", o.alpha, ": must be finite, > 0"));
  }
  if (!(std::isfinite(o.beta) && o.beta > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--beta ", o.beta, ": must be finite, > 0"));
  }
  if (c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", c.head_dim, " is odd: RoPE needs channel pairs"));
  }
  struct Count {
    const char* name;
    int64_t value, limit;
  };
  for (const Count& n : {Count{"--down-channels", o.down_channels, c.intermediate_size},
                         Count{"--v-channels", o.v_channels, c.kv_dim()},
                         Count{"--k-pairs", o.k_pairs, c.head_dim / 2}}) {
    if (n.value < 0 || n.value > n.limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(n.name, " ", n.value, ": must be in [0, ", n.limit, "] for this model"));
    }
  }
  return absl::OkStatus();
}

StatusOr<std::vector<LayerOutlierPlan>> PlanOutliers(const LlamaConfig& c,
                                                     const PlantOutliersOptions& o) {
  QCAL_RETURN_IF_ERROR(ValidatePlantOutliersOptions(c, o));
  std::mt19937_64 rng(o.seed);
  const int64_t half = c.head_dim / 2;
  std::vector<LayerOutlierPlan> plan(c.num_hidden_layers);
  for (LayerOutlierPlan& layer : plan) {
    layer.down = DrawDistinct(rng, c.intermediate_size, o.down_channels);
    layer.v = DrawDistinct(rng, c.kv_dim(), o.v_channels);
    for (int64_t g = 0; g < c.num_key_value_heads; ++g) {
      for (int64_t i : DrawDistinct(rng, half, o.k_pairs)) layer.k_pairs.push_back(g * half + i);
    }
  }
  return plan;
}

Status PlantOutliersInLayer(const LlamaConfig& c, const LayerOutlierPlan& plan,
                            const PlantOutliersOptions& o, at::Tensor& q, at::Tensor& k,
                            at::Tensor& v, at::Tensor& out, at::Tensor& up, at::Tensor& down) {
  const int64_t hid = c.hidden_size, inter = c.intermediate_size, d = c.head_dim;
  QCAL_RETURN_IF_ERROR(CheckShape(q, "q_proj", c.q_dim(), hid));
  QCAL_RETURN_IF_ERROR(CheckShape(k, "k_proj", c.kv_dim(), hid));
  QCAL_RETURN_IF_ERROR(CheckShape(v, "v_proj", c.kv_dim(), hid));
  QCAL_RETURN_IF_ERROR(CheckShape(out, "o_proj", hid, c.q_dim()));
  QCAL_RETURN_IF_ERROR(CheckShape(up, "up_proj", inter, hid));
  QCAL_RETURN_IF_ERROR(CheckShape(down, "down_proj", hid, inter));
  const int64_t rep = c.gqa_groups(), half = d / 2;
  const float alpha = static_cast<float>(o.alpha), beta = static_cast<float>(o.beta);
  at::NoGradGuard no_grad;
  for (int64_t j : plan.down) {
    if (j < 0 || j >= inter) return absl::InvalidArgumentError(absl::StrCat("down channel ", j));
    up[j].mul_(alpha);
    down.select(1, j).div_(alpha);
  }
  for (int64_t row : plan.v) {
    if (row < 0 || row >= c.kv_dim())
      return absl::InvalidArgumentError(absl::StrCat("v row ", row));
    const int64_t g = row / d, ch = row % d;
    v[row].mul_(alpha);
    // Query heads g·rep .. g·rep+rep-1 read KV head g (GQA): each one's o_proj column.
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h) out.select(1, h * d + ch).div_(alpha);
  }
  for (int64_t p : plan.k_pairs) {
    if (p < 0 || p >= c.num_key_value_heads * half) {
      return absl::InvalidArgumentError(absl::StrCat("k pair ", p));
    }
    const int64_t g = p / half, i = p % half;
    for (int64_t ch : {i, i + half}) {
      k[g * d + ch].mul_(beta);
      for (int64_t h = g * rep; h < (g + 1) * rep; ++h) q[h * d + ch].div_(beta);
    }
  }
  return absl::OkStatus();
}

nlohmann::json PlanToJson(const PlantOutliersOptions& o,
                          const std::vector<LayerOutlierPlan>& plan) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerOutlierPlan& l : plan) {
    layers.push_back(
        {{"down_proj_input_channels", l.down}, {"v_proj_rows", l.v}, {"k_rope_pairs", l.k_pairs}});
  }
  return {{"alpha", o.alpha},
          {"beta", o.beta},
          {"down_channels", o.down_channels},
          {"v_channels", o.v_channels},
          {"k_pairs", o.k_pairs},
          {"seed", o.seed},
          {"note",
           "function-preserving rescaling (qcal tool plant-outliers): up_proj rows x alpha / "
           "down_proj columns / alpha; v_proj rows x alpha / o_proj columns / alpha (every query "
           "head of the KV head); W_k RoPE pair (i, i+head_dim/2) x beta / W_q same pair / beta. "
           "k_rope_pairs entries are kv_head * head_dim/2 + i."},
          {"layers", layers}};
}

StatusOr<PlantOutliersResult> PlantOutliers(const std::string& model_dir,
                                            const std::string& out_dir,
                                            const PlantOutliersOptions& options) {
  QCAL_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(model_dir));
  QCAL_RETURN_IF_ERROR(CheckDerivedModelDirs("plant-outliers", model_dir, config, out_dir));
  QCAL_ASSIGN_OR_RETURN(std::vector<LayerOutlierPlan> plan, PlanOutliers(config, options));
  QCAL_ASSIGN_OR_RETURN(auto ckpt, CheckpointReader::Open(model_dir));

  // Every tensor as float32, by name.
  std::map<std::string, at::Tensor> tensors;
  for (const std::string& name : ckpt->TensorNames()) {
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt->Find(name));
    QCAL_ASSIGN_OR_RETURN(std::vector<float> data, ckpt->ReadF32(name));
    tensors[name] = at::from_blob(data.data(), found.second->shape, at::kFloat).clone();
  }
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    at::Tensor* w[6];
    const char* names[6] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "self_attn.o_proj", "mlp.up_proj",      "mlp.down_proj"};
    for (int i = 0; i < 6; ++i) {
      auto it = tensors.find(p + names[i] + ".weight");
      if (it == tensors.end()) {
        return absl::NotFoundError(absl::StrCat(model_dir, ": no tensor ", p, names[i], ".weight"));
      }
      w[i] = &it->second;
    }
    QCAL_RETURN_IF_ERROR(Annotate(
        PlantOutliersInLayer(config, plan[l], options, *w[0], *w[1], *w[2], *w[3], *w[4], *w[5]),
        absl::StrCat(model_dir, " layer ", l)));
  }

  QCAL_RETURN_IF_ERROR(WriteDerivedModelDir(model_dir, out_dir, tensors, config,
                                            "planted_outliers.json", PlanToJson(options, plan)));

  config.torch_dtype = "float32";
  PlantOutliersResult result;
  result.out_dir = out_dir;
  result.config = std::move(config);
  result.plan = std::move(plan);
  result.tensors = static_cast<int64_t>(tensors.size());
  return result;
}

}  // namespace qcal::tools
