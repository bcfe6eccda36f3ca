#include "engine/calib/calibration.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/io_util.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "engine/calib/expert_parallel.h"
#include "engine/model/activation_store.h"
#include "engine/model/block_walk.h"
#include "engine/model/tensor_io.h"

namespace qcal::calib {
namespace {

// Which products the job directory already holds for this key: rank 0 looks, every rank learns,
// so every rank takes the same path.
struct CachedProducts {
  bool hessians = false;
  bool activations = false;
};

StatusOr<CachedProducts> AgreeOnCache(comm::Comm& comm, int64_t blocks,
                                      const CalibrationDirs& dirs, const std::string& key,
                                      const CalibrationOptions& options,
                                      const std::vector<int64_t>& act_shape) {
  int64_t cached[2] = {0, 0};  // hessians, activations
  Status local;
  if (comm.rank() == 0) {
    local = [&]() -> Status {
      QCAL_RETURN_IF_ERROR(MakeDirs(dirs.hessians));
      if (options.activations) QCAL_RETURN_IF_ERROR(MakeDirs(dirs.activations));
      bool h_ok = options.hessians;
      for (int64_t l = 0; l < blocks && h_ok; ++l) {
        auto h = LoadBlockHessians(HessianPath(dirs.hessians, l), key);
        h_ok = h.ok();
        if (!h.ok() && !absl::IsNotFound(h.status())) {
          QCAL_LOG_WARN("cached Hessians not reused: {}", std::string(h.status().message()));
        }
      }
      bool a_ok = options.activations;
      for (int64_t l = 0; l <= blocks && a_ok; ++l) {
        const Status a = CheckActivationCache(ActivationPath(dirs.activations, l), key, act_shape);
        a_ok = a.ok();
        if (!a.ok() && !absl::IsNotFound(a)) {
          QCAL_LOG_WARN("cached activations not reused: {}", std::string(a.message()));
        }
      }
      cached[0] = h_ok;
      cached[1] = a_ok;
      return absl::OkStatus();
    }();
  }
  QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, "calibration setup"));
  QCAL_RETURN_IF_ERROR(comm.Broadcast(cached, sizeof(cached), 0));
  return CachedProducts{cached[0] != 0, cached[1] != 0};
}

// One walk over the float model's blocks, on this rank's canonical chunks: the chunks' hidden
// states (embedded first) go through each block in turn; on the way each block's Hessian sums
// are gathered (replicated and reduced, or sharded into bands) and saved, and each block
// boundary's activations are written (every rank its own rows). Every call is collective.
class Walk {
 public:
  Walk(comm::Comm& comm, model::ModelSource& source, const at::Tensor& tokens,
       const CalibrationDirs& dirs, const std::string& key, const CalibrationOptions& options,
       bool hessians, bool activations, CalibrationResult* result)
      : comm_(comm),
        source_(source),
        tokens_(tokens),
        dirs_(dirs),
        key_(key),
        options_(options),
        hessians_(hessians),
        activations_(activations),
        sharded_(hessians && options.shard_hessians),
        result_(result),
        blocks_(source.config().num_hidden_layers),
        num_seqs_(tokens.size(0)),
        seq_len_(tokens.size(1)),
        hidden_(source.config().hidden_size),
        chunks_((num_seqs_ + options.batch - 1) / options.batch) {}

  // This rank's chunks in the activation store (spilled to the job directory above the memory
  // budget), embedded; whether the Hessian sums are reduced on the devices.
  Status Start() {
    const comm::Range mine = comm::SliceForRank(chunks_, comm_.rank(), comm_.size());
    for (int64_t c = mine.begin; c < mine.end; ++c) {
      const int64_t a = c * options_.batch, b = std::min(num_seqs_, a + options_.batch);
      shapes_.push_back({b - a, seq_len_, hidden_});
      first_seq_.push_back(a);
    }
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, MakeDirs(dirs_.spill), "calibration"));
    std::vector<at::Tensor> ids;
    for (size_t i = 0; i < shapes_.size(); ++i) {
      ids.push_back(tokens_.narrow(0, first_seq_[i], shapes_[i][0]));
    }
    StatusOr<std::unique_ptr<model::BlockWalk>> walk = model::BlockWalk::Embed(
        source_, ids, options_.memory_budget_bytes,
        absl::StrCat(dirs_.spill, "/calibration-rank", comm_.rank(), ".f32"));
    QCAL_RETURN_IF_ERROR(
        AgreeOk(comm_, Annotate(walk.status(), "calibration, embedding"), "calibration"));
    walk_ = *std::move(walk);
    store_ = &walk_->store();
    if (store_->spilled()) {
      QCAL_LOG_INFO("calibration: {:.2f} GiB of activations on this rank over the {:.2f} GiB "
                    "budget: spilled to the job directory",
                    store_->total_bytes() / 1073741824.0,
                    options_.memory_budget_bytes / 1073741824.0);
    }
    if (hessians_ && options_.keep_hessians) result_->hessians.assign(blocks_, BlockHessians{});
    // GPU ranks reduce the sums on their devices when all of them can (every rank has a GPU
    // backend and a device reduction); otherwise every rank downloads and reduces on the host.
    if (hessians_ && !sharded_ && comm_.size() > 1) {
      int64_t can = options_.device_sum && options_.gpu != nullptr ? 1 : 0;
      QCAL_RETURN_IF_ERROR(comm_.AllReduceSum(&can, 1));
      reduce_on_device_ = can == comm_.size();
    }
    lap_ = std::chrono::steady_clock::now();
    return Status();
  }

  // Block l: its input boundary saved (activations), then its forward over the chunks with its
  // Hessians summed, reduced and saved.
  Status Block(int64_t l) {
    const std::string where = absl::StrCat("calibration, block ", l);
    Lap(&result_->forward_seconds);  // (the progress callback, if any)
    if (activations_) QCAL_RETURN_IF_ERROR(Annotate(SaveBoundary(l), where));
    Lap(&result_->save_seconds);
    // A MoE block's experts are summed on the ranks that own them (expert_parallel.h).
    if (source_.config().IsMoeLayer(l)) {
      return hessians_ ? ExpertParallelBlock(l, where) : ReplicatedBlock(l, where);
    }
    return sharded_ ? ShardedBlock(l, where) : ReplicatedBlock(l, where);
  }

  // The last block's outputs (activations).
  Status Finish() {
    if (!activations_) return Status();
    Lap(&result_->forward_seconds);
    QCAL_RETURN_IF_ERROR(Annotate(SaveBoundary(blocks_), "calibration, final activations"));
    Lap(&result_->save_seconds);
    return Status();
  }

 private:
  // Adds the seconds since the last lap to *into (CalibrationResult::read_seconds, ...).
  void Lap(double* into) {
    const auto now = std::chrono::steady_clock::now();
    *into += std::chrono::duration<double>(now - lap_).count();
    lap_ = now;
  }

  // Boundary l (the inputs of block l; l = blocks: the last block's outputs), every rank its rows.
  Status SaveBoundary(int64_t l) {
    const std::vector<int64_t> act_shape = {num_seqs_, seq_len_, hidden_};
    QCAL_ASSIGN_OR_RETURN(
        auto file, BeginActivationFile(comm_, ActivationPath(dirs_.activations, l), key_, act_shape));
    Status rows;
    for (int64_t i = 0; i < store_->chunks() && rows.ok(); ++i) {
      auto x = store_->Get(i);
      rows = x.ok() ? WriteActivationRows(*file, first_seq_[i], *x) : x.status();
    }
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, rows, ActivationPath(dirs_.activations, l)));
    return file->Finish(comm_);
  }

  // The starved-expert rule (CalibrationOptions::moe_min_tokens) for MoE block `block`: the
  // router's tokens per expert over every rank's chunks (attention and router only), and which
  // experts fall below the minimum and so calibrate on every token. Collective.
  Status StarvedExperts(model::DecoderBlock& block, int64_t l, const std::string& where,
                        std::vector<bool>* route_all) {
    const int64_t min_tokens =
        options_.moe_min_tokens < 0 ? hidden_ : options_.moe_min_tokens;
    const int64_t experts = source_.config().num_experts;
    std::vector<int64_t> tokens(experts, 0);
    Status local;
    for (int64_t i = 0; i < store_->chunks() && local.ok(); ++i) {
      StatusOr<at::Tensor> x = store_->Get(i);
      local = x.ok() ? CountRoutedTokens(block, *x, source_.rope(), options_.batch, &tokens)
                     : x.status();
    }
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(local, where), where));
    QCAL_RETURN_IF_ERROR(comm_.AllReduceSum(tokens.data(), tokens.size()));
    route_all->assign(experts, false);
    std::vector<int64_t> starved;
    for (int64_t e = 0; e < experts; ++e) {
      if (tokens[e] >= min_tokens) continue;
      (*route_all)[e] = true;
      starved.push_back(e);
      if (comm_.rank() == 0) {
        QCAL_LOG_WARN("calibration, block {}: the router sends expert {} {} of {} calibration "
                      "tokens, fewer than the minimum {} (calibration.moe_min_tokens): it is "
                      "calibrated on every token instead",
                      l, e, tokens[e], num_seqs_ * seq_len_, min_tokens);
      }
    }
    if (!starved.empty()) result_->starved_experts[l] = std::move(starved);
    return Status();
  }

  // Replicated sums: every rank sums its own chunks into whole accumulators (on a GPU they stay
  // on the device for the whole block), then the ranks reduce them and rank 0 saves them. (A MoE
  // block comes here only for its activations: its Hessians are ExpertParallelBlock's.)
  Status ReplicatedBlock(int64_t l, const std::string& where) {
    BlockHessians h;
    h.backend = options_.gpu;
    h.forward_precision = options_.precision;
    const bool reduce_on_device = reduce_on_device_;
    std::unique_ptr<model::DecoderBlock> block;
    const Status loaded = [&]() -> Status {
      QCAL_ASSIGN_OR_RETURN(block, source_.LoadBlock(l));
      Lap(&result_->read_seconds);
      return Status();
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(loaded, where), where));
    const Status forward = [&]() -> Status {
      if (hessians_ && options_.hessian_strip_rows != kHessianStripRows) {
        for (model::LinearKind k : model::kAllLinears) {
          if (!block->weights().has(k)) continue;
          const int64_t n = block->weights().linear(k).in_features();
          h.at(HessianKindOf(k)) = HessianAccumulator(n, options_.hessian_strip_rows);
        }
      }
      if (store_->chunks() == 0 && hessians_) {
        // A rank without sequences still reduces: its accumulators get the block's sizes.
        const at::Tensor none = at::empty({0, seq_len_, hidden_}, at::kFloat);
        QCAL_RETURN_IF_ERROR(
            ForwardCollectingHessians(*block, none, source_.rope(), options_.batch, &h).status());
      }
      QCAL_RETURN_IF_ERROR(walk_->Map([&](const at::Tensor& x) {
        return ForwardCollectingHessians(*block, x, source_.rope(), options_.batch,
                                         hessians_ ? &h : nullptr, /*flush_device=*/false);
      }));
      return reduce_on_device ? Status() : FlushDeviceHessians(&h);
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(forward, where), where));
    Lap(&result_->forward_seconds);
    if (!hessians_) return Status();
    if (reduce_on_device) {
      QCAL_RETURN_IF_ERROR(Annotate(
          AllReduceDeviceHessians(comm_, options_.device_sum,
                                  comm_.rank() == 0 || options_.keep_hessians, &h,
                                  &result_->tokens),
          where));
    } else {
      QCAL_RETURN_IF_ERROR(Annotate(AllReduceHessians(comm_, &h), where));
      result_->tokens = h.at(HessianKind::kQkv).count();
    }
    Lap(&result_->reduce_seconds);
    Status saved;
    if (comm_.rank() == 0) {
      saved = Annotate(SaveBlockHessians(HessianPath(dirs_.hessians, l), h, key_), where);
    }
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, saved, where));
    Lap(&result_->save_seconds);
    if (options_.keep_hessians) result_->hessians[l] = std::move(h);
    return Status();
  }

  // A MoE block's Hessians, expert-parallel (expert_parallel.h): each rank loads the block's
  // attention, router and shared expert with only its own experts, and all ranks step through
  // their chunks together (a rank past its last chunk still runs its experts for the others).
  // Each step's forward sends every routed row to its expert's owner and back; the owner sums
  // the row products. The dense inputs' sums (attention, the shared expert) are each rank's own
  // chunks', reduced as in ReplicatedBlock. The file is written in place: rank 0 the dense sums
  // and the routing tables, each owner its experts' sums; its bytes are one process's.
  Status ExpertParallelBlock(int64_t l, const std::string& where) {
    const int64_t experts = source_.config().num_experts;
    const comm::Range mine = ExpertsOfRank(experts, comm_.rank(), comm_.size());
    BlockHessians h;
    std::unique_ptr<model::DecoderBlock> block;
    const Status loaded = [&]() -> Status {
      model::BlockSelection select;
      select.expert_begin = mine.begin;
      select.expert_end = mine.end;
      select.experts_as_stored = true;  // bf16 experts at half the memory, the same products
      QCAL_ASSIGN_OR_RETURN(block, source_.LoadBlockPart(l, select));
      Lap(&result_->read_seconds);
      return Status();
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(loaded, where), where));
    if (options_.moe_route_all) {
      h.route_all.assign(experts, true);
    } else if (options_.moe_min_tokens != 0) {
      QCAL_RETURN_IF_ERROR(StarvedExperts(*block, l, where, &h.route_all));  // collective
    }
    {
      ExpertExchange exchange(comm_, *block, &h);
      // Every rank's accumulators sized (its experts' and the dense ones), chunks or not.
      const at::Tensor none = at::empty({0, seq_len_, hidden_}, at::kFloat);
      Status local = ForwardCollectingMoeHessians(*block, none, source_.rope(), options_.batch,
                                                  &h, &exchange)
                         .status();
      QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(local, where), where));
      const int64_t steps = comm::SliceForRank(chunks_, 0, comm_.size()).size();
      for (int64_t step = 0; step < steps; ++step) {
        local = Status();
        if (step < store_->chunks()) {
          local = walk_->MapChunk(step, [&](const at::Tensor& x) {
            return ForwardCollectingMoeHessians(*block, x, source_.rope(), options_.batch, &h,
                                                &exchange);
          });
        }
        const Status exchanged = exchange.FinishStep();  // collective
        if (local.ok()) local = exchanged;
        QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(local, where), where));
      }
    }
    Lap(&result_->forward_seconds);
    // The dense sums over the ranks (the experts' stay with their owners), and every expert's
    // routed tokens (each owner counted its own).
    std::vector<ExpertHessians> owned = std::move(h.experts);
    h.experts.clear();
    QCAL_RETURN_IF_ERROR(Annotate(AllReduceHessians(comm_, &h), where));
    h.experts = std::move(owned);
    std::vector<int64_t> tokens(experts, 0);
    for (int64_t e = mine.begin; e < mine.end; ++e) tokens[e] = h.experts[e].routed_tokens;
    QCAL_RETURN_IF_ERROR(comm_.AllReduceSum(tokens.data(), tokens.size()));
    for (int64_t e = 0; e < experts; ++e) {
      h.experts[e].routed_tokens = tokens[e];
      h.experts[e].route_all = !h.route_all.empty() && h.route_all[e];
    }
    result_->tokens = h.at(HessianKind::kQkv).count();
    Lap(&result_->reduce_seconds);
    block.reset();
    result_->expert_tokens[l] = tokens;
    return SaveInPlace(l, where, std::move(h));
  }

  // Writes a block's sums spread over the ranks into its file (SaveShardedBlockHessians) and,
  // with keep_hessians, reads the whole sums back for the result.
  Status SaveInPlace(int64_t l, const std::string& where, BlockHessians h) {
    QCAL_RETURN_IF_ERROR(
        Annotate(SaveShardedBlockHessians(comm_, HessianPath(dirs_.hessians, l), h, key_), where));
    Lap(&result_->save_seconds);
    h = BlockHessians{};  // the sums are in the file
    if (options_.keep_hessians) {
      StatusOr<BlockHessians> whole = LoadBlockHessians(HessianPath(dirs_.hessians, l), key_);
      QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(whole.status(), where), where));
      result_->hessians[l] = std::move(*whole);
    }
    return Status();
  }

  // Sharded sums: each rank sums every rank's inputs into its band of each triangle (all ranks
  // step through their chunks together; a rank past its last chunk contributes none), and the
  // bands are written in place into the block's file.
  Status ShardedBlock(int64_t l, const std::string& where) {
    BlockHessians h;
    h.backend = options_.gpu;
    h.forward_precision = options_.precision;
    std::unique_ptr<model::DecoderBlock> block;
    Status local = [&]() -> Status {
      QCAL_ASSIGN_OR_RETURN(block, source_.LoadBlock(l));
      for (model::LinearKind k : model::kAllLinears) {
        const int64_t n = block->weights().linear(k).in_features();
        const HessianRows band =
            HessianBandForRank(n, comm_.rank(), comm_.size(), options_.hessian_strip_rows);
        QCAL_ASSIGN_OR_RETURN(h.at(HessianKindOf(k)),
                              HessianAccumulator::Band(n, band, options_.hessian_strip_rows));
      }
      return Status();
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(local, where), where));
    const int64_t steps = comm::SliceForRank(chunks_, 0, comm_.size()).size();
    for (int64_t step = 0; step < steps; ++step) {
      std::array<at::Tensor, 4> inputs;
      local = [&]() -> Status {
        if (step >= store_->chunks()) {
          for (HessianKind k : kAllHessianKinds) {
            inputs[static_cast<int>(k)] = at::empty({0, seq_len_, h.at(k).dim()}, at::kFloat);
          }
          return Status();
        }
        return walk_->MapChunk(step, [&](const at::Tensor& x) {
          return ForwardCapturingInputs(*block, x, source_.rope(), options_.batch, &inputs);
        });
      }();
      QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(local, where), where));
      for (HessianKind k : kAllHessianKinds) {
        at::Tensor& mine = inputs[static_cast<int>(k)];
        QCAL_ASSIGN_OR_RETURN(at::Tensor all, GatherSequences(comm_, mine));
        mine = at::Tensor();
        local = all.size(0) > 0 ? h.at(k).Add(all) : Status();
        const std::string input = absl::StrCat(where, ", ", HessianKindName(k), " input");
        QCAL_RETURN_IF_ERROR(AgreeOk(comm_, Annotate(local, input), input));
      }
    }
    Lap(&result_->forward_seconds);  // sharded: the gathers of the inputs included
    result_->tokens = h.at(HessianKind::kQkv).count();
    return SaveInPlace(l, where, std::move(h));
  }

  comm::Comm& comm_;
  model::ModelSource& source_;
  const at::Tensor& tokens_;
  const CalibrationDirs& dirs_;
  const std::string& key_;
  const CalibrationOptions& options_;
  const bool hessians_, activations_, sharded_;
  CalibrationResult* result_;
  const int64_t blocks_, num_seqs_, seq_len_, hidden_, chunks_;
  std::vector<std::vector<int64_t>> shapes_;  // this rank's chunks
  std::vector<int64_t> first_seq_;
  std::unique_ptr<model::BlockWalk> walk_;  // this rank's chunks; each block's step over them is
                                            // calibration's forward (it collects Hessians)
  model::ActivationStore* store_ = nullptr;  // walk_'s
  bool reduce_on_device_ = false;
  std::chrono::steady_clock::time_point lap_;
};

}  // namespace

kernels::BlockForwardPrecision ForwardPrecision(const CalibrationSpec& spec) {
  return spec.precision == "bf16" ? kernels::BlockForwardPrecision::kBf16
                                  : kernels::BlockForwardPrecision::kFloat32;
}

StatusOr<std::vector<bool>> ExpertsOnEveryToken(model::DecoderBlock& block, const at::Tensor& x,
                                                const model::Rope& rope, int64_t batch,
                                                const CalibrationSpec& spec, int64_t layer) {
  std::vector<bool> flags;
  if (!block.is_moe()) return flags;
  const int64_t experts = static_cast<int64_t>(block.weights().moe->experts.size());
  if (spec.moe_route_all) {
    flags.assign(experts, true);
    return flags;
  }
  if (spec.moe_min_tokens == 0) return flags;
  const int64_t min_tokens =
      spec.moe_min_tokens < 0 ? block.weights().moe->router.size(1) : spec.moe_min_tokens;
  std::vector<int64_t> tokens;
  QCAL_RETURN_IF_ERROR(Annotate(CountRoutedTokens(block, x, rope, batch, &tokens),
                                absl::StrCat("block ", layer, ": counting tokens per expert")));
  flags.assign(experts, false);
  for (int64_t e = 0; e < experts; ++e) {
    if (tokens[e] >= min_tokens) continue;
    flags[e] = true;
    QCAL_LOG_WARN("block {}: the router sends expert {} {} of {} calibration tokens, fewer than "
                  "the minimum {} (calibration.moe_min_tokens): it is calibrated on every token "
                  "instead", layer, e, tokens[e], x.size(0) * x.size(1), min_tokens);
  }
  return flags;
}

StatusOr<CalibrationResult> Calibrate(comm::Comm& comm, model::ModelSource& source,
                                      const at::Tensor& tokens, const CalibrationDirs& dirs,
                                      const std::string& key, const CalibrationOptions& options,
                                      const std::function<void(int64_t, int64_t)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options.batch < 1) return absl::InvalidArgumentError("calibration batch must be >= 1");
  if (tokens.dim() != 2) {
    return absl::InvalidArgumentError("calibration tokens must be [sequences, seq_len]");
  }
  CalibrationResult result;
  const LlamaConfig& config = source.config();
  const int64_t blocks = config.num_hidden_layers;
  const std::vector<int64_t> act_shape = {tokens.size(0), tokens.size(1), config.hidden_size};
  QCAL_ASSIGN_OR_RETURN(const CachedProducts cached,
                        AgreeOnCache(comm, blocks, dirs, key, options, act_shape));
  const bool walk_hessians = options.hessians && !cached.hessians;
  const bool walk_activations = options.activations && !cached.activations;
  result.from_cache = options.hessians && cached.hessians;
  result.activations_from_cache = options.activations && cached.activations;

  if (walk_hessians || walk_activations) {
    at::NoGradGuard no_grad;
    Walk walk(comm, source, tokens, dirs, key, options, walk_hessians, walk_activations,
              &result);
    QCAL_RETURN_IF_ERROR(walk.Start());
    for (int64_t l = 0; l < blocks; ++l) {
      QCAL_RETURN_IF_ERROR(walk.Block(l));
      if (progress) progress(l + 1, blocks);
    }
    QCAL_RETURN_IF_ERROR(walk.Finish());
  }
  if (result.from_cache && (options.keep_hessians || config.is_moe())) {
    // Reused Hessians: kept when asked for; a MoE block's routing (tokens per expert, the
    // experts the starved-expert rule moved) read back either way (mapped: no sums read).
    for (int64_t l = 0; l < blocks; ++l) {
      if (!options.keep_hessians && !config.IsMoeLayer(l)) continue;
      QCAL_ASSIGN_OR_RETURN(BlockHessians h, LoadBlockHessians(HessianPath(dirs.hessians, l), key,
                                                               /*mapped=*/!options.keep_hessians));
      for (size_t e = 0; e < h.experts.size(); ++e) {
        result.expert_tokens[l].push_back(h.experts[e].routed_tokens);
        if (h.experts[e].route_all && !options.moe_route_all) {
          result.starved_experts[l].push_back(static_cast<int64_t>(e));
        }
      }
      if (options.keep_hessians) result.hessians.push_back(std::move(h));
    }
  }
  if (result.tokens == 0 && !result.hessians.empty()) {
    result.tokens = result.hessians[0].at(HessianKind::kQkv).count();
  }
  if (result.tokens == 0) result.tokens = tokens.numel();
  QCAL_RETURN_IF_ERROR(comm.Barrier());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace qcal::calib
