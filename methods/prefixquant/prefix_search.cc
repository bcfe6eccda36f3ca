#include "methods/prefixquant/prefix_search.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "methods/prefixquant/static_quant.h"
#include "engine/qsim/token_outliers.h"

namespace qcal::methods::prefixquant {
namespace {

// Block `layer` of the float model as the method prepares it, with its online rotations.
StatusOr<std::unique_ptr<model::DecoderBlock>> PreparedBlock(const ModelTransform& method,
                                                             const qsim::RotationPlan& plan,
                                                             model::ModelSource& source,
                                                             int64_t layer) {
  QCAL_ASSIGN_OR_RETURN(model::BlockWeights w, source.LoadBlockWeights(layer));
  QCAL_RETURN_IF_ERROR(method.PrepareBlock(layer, &w));
  auto block = std::make_unique<model::DecoderBlock>(source.config(), std::move(w));
  QCAL_RETURN_IF_ERROR(qsim::InstallOnlineRotations(*block, plan));
  return block;
}

}  // namespace

StatusOr<PhaseProducts> RunPrefixSearch(const ModelTransform& method, const PrefixquantConfig& q,
                                        const qsim::RotationPlan& plan,
                                        const GlobalPhaseInputs& in) {
  if (in.comm == nullptr || in.source == nullptr || in.tokens == nullptr ||
      !in.tokens->defined() || in.tokens->dim() != 2) {
    return absl::InvalidArgumentError("prefix search: no calibration tokens");
  }
  model::ModelSource& source = *in.source;
  const LlamaConfig& config = source.config();
  const int64_t layers = config.num_hidden_layers;
  const at::Tensor& tokens = *in.tokens;
  const int64_t n = tokens.size(0), s = tokens.size(1);
  const int64_t batch = std::max<int64_t>(1, in.batch);
  const int64_t chunks = (n + batch - 1) / batch;
  const comm::Range mine = comm::SliceForRank(chunks, in.comm->rank(), in.comm->size());
  const int64_t first = std::min(n, mine.begin * batch), last = std::min(n, mine.end * batch);
  at::NoGradGuard no_grad;
  qsim::TokenOutlierReport report = qsim::NewTokenOutlierReport(layers, q.threshold);
  const at::Tensor ids32 = tokens.to(at::kInt).contiguous();
  try {
    // ---- 1. Outlier statistics of this rank's sequences.
    at::Tensor h;
    if (last > first) {
      QCAL_ASSIGN_OR_RETURN(at::Tensor rows, source.Embed(tokens.narrow(0, first, last - first)));
      QCAL_ASSIGN_OR_RETURN(h, method.PrepareEmbeddingRows(rows));
    }
    for (int64_t l = 0; l < layers && last > first; ++l) {
      QCAL_ASSIGN_OR_RETURN(auto block, PreparedBlock(method, plan, source, l));
      at::Tensor token_max;
      auto& down = block->mutable_weights().linears[static_cast<int>(model::LinearKind::kDown)];
      // Observes the down_proj input before R4 (the reference hooks it there).
      down = std::make_unique<StaticActLinear>(
          std::move(down), nullptr, nullptr, 16,
          [&token_max](const at::Tensor& x) {
            token_max = std::get<0>(x.abs().max(-1)).to(at::kDouble).contiguous();
          });
      std::vector<at::Tensor> outs;
      for (int64_t c = first; c < last; c += batch) {
        const int64_t b = std::min(batch, last - c);
        outs.push_back(block->Forward(h.narrow(0, c - first, b), source.rope()));
        for (int64_t i = 0; i < b; ++i) {
          qsim::AddTokenOutliers(&report, l, token_max[i].data_ptr<double>(),
                                 ids32[c + i].data_ptr<int32_t>(), s);
        }
      }
      h = at::cat(outs, 0);
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("prefix search: ", e.what()));
  }

  // ---- Exact sums over the ranks.
  const int64_t vocab = config.vocab_size;
  std::vector<int64_t> sums(layers + 1 + vocab, 0);
  for (int64_t l = 0; l < layers; ++l) sums[l] = report.layers[l].count;
  sums[layers] = report.sequences;
  for (const auto& [id, count] : report.outlier_id_counts) {
    if (id >= 0 && id < vocab) sums[layers + 1 + id] = count;
  }
  QCAL_RETURN_IF_ERROR(in.comm->AllReduceSum(sums.data(), sums.size()));
  qsim::TokenOutlierReport total = qsim::NewTokenOutlierReport(layers, q.threshold);
  for (int64_t l = 0; l < layers; ++l) total.layers[l].count = sums[l];
  total.sequences = sums[layers];
  for (int64_t id = 0; id < vocab; ++id) {
    if (sums[layers + 1 + id] > 0) total.outlier_id_counts[static_cast<int32_t>(id)] = sums[layers + 1 + id];
  }
  qsim::FinishTokenOutliers(&total);
  std::vector<int32_t> prefix = qsim::PrefixTokens(total, in.bos_id);
  if (static_cast<int64_t>(prefix.size()) > model::kMaxPrefixTokens) {
    QCAL_LOG_WARN("prefix search: {} prefix tokens; keeping the {} most frequent and BOS",
                  prefix.size(), model::kMaxPrefixTokens - 1);
    prefix.erase(prefix.begin() + (model::kMaxPrefixTokens - 1), prefix.end() - 1);
  }
  if (in.comm->rank() == 0) {
    std::vector<std::string> counts;
    for (int64_t l = 0; l < layers; ++l) {
      counts.push_back(absl::StrCat(total.layers[l].mean_count));
    }
    QCAL_LOG_INFO("prefix search: {} sequences, η {}, outliers per sequence by layer [{}], o = "
                  "{}; prefix [{}] (local max ratio {:.1f})",
                  total.sequences, q.threshold, absl::StrJoin(counts, ", "), total.o,
                  absl::StrJoin(prefix, ", "), report.MaxRatio());
  }

  // ---- 2. The prefix's K/V.
  const int64_t p = static_cast<int64_t>(prefix.size());
  PhaseProducts out;
  try {
    std::vector<int64_t> ids(prefix.begin(), prefix.end());
    QCAL_ASSIGN_OR_RETURN(at::Tensor rows,
                          source.Embed(at::from_blob(ids.data(), {1, p}, at::kLong).clone()));
    QCAL_ASSIGN_OR_RETURN(at::Tensor h, method.PrepareEmbeddingRows(rows));
    std::vector<at::Tensor> ks, vs;
    for (int64_t l = 0; l < layers; ++l) {
      QCAL_ASSIGN_OR_RETURN(auto block, PreparedBlock(method, plan, source, l));
      auto [k, v] = block->KeysValues(h, source.rope(), 0);
      ks.push_back(k[0].contiguous());
      vs.push_back(v[0].contiguous());
      h = block->Forward(h, source.rope());
    }
    std::vector<double> tok(prefix.begin(), prefix.end());
    out["tokens"] = at::from_blob(tok.data(), {p}, at::kDouble).clone();
    out["k"] = at::stack(ks, 0);
    out["v"] = at::stack(vs, 0);
    at::Tensor outliers = at::empty({layers}, at::kDouble);
    for (int64_t l = 0; l < layers; ++l) outliers[l] = static_cast<double>(sums[l]);
    out["outliers"] = outliers;
    out["sequences"] = at::full({1}, static_cast<double>(total.sequences), at::kDouble);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("prefix K/V: ", e.what()));
  }
  return out;
}

StatusOr<std::shared_ptr<const model::PrefixKv>> PrefixOfLayer(const PhaseProducts& products,
                                                               const LlamaConfig& config,
                                                               int64_t layer) {
  auto find = [&](const char* name) -> StatusOr<at::Tensor> {
    auto it = products.find(name);
    if (it == products.end()) {
      return absl::InvalidArgumentError(absl::StrCat("prefix products: no '", name, "'"));
    }
    return it->second;
  };
  QCAL_ASSIGN_OR_RETURN(at::Tensor tokens, find("tokens"));
  QCAL_ASSIGN_OR_RETURN(at::Tensor k, find("k"));
  QCAL_ASSIGN_OR_RETURN(at::Tensor v, find("v"));
  const int64_t p = tokens.numel();
  const std::vector<int64_t> shape = {config.num_hidden_layers, config.num_key_value_heads, p,
                                      config.head_dim};
  if (tokens.dim() != 1 || p < 1 || p > model::kMaxPrefixTokens || k.sizes().vec() != shape ||
      v.sizes().vec() != shape) {
    return absl::InvalidArgumentError("prefix products: tokens / k / v of inconsistent shapes");
  }
  auto out = std::make_shared<model::PrefixKv>();
  for (int64_t i = 0; i < p; ++i) {
    const double t = tokens[i].item<double>();
    if (t != std::floor(t) || t < 0 || t >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prefix products: token ", t, " is not an id"));
    }
    out->tokens.push_back(static_cast<int32_t>(t));
  }
  out->k = k[layer].to(at::kFloat).contiguous();
  out->v = v[layer].to(at::kFloat).contiguous();
  return std::shared_ptr<const model::PrefixKv>(std::move(out));
}

}  // namespace qcal::methods::prefixquant
