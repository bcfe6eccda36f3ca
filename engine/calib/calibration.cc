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
#include "engine/model/activation_store.h"
#include "engine/model/tensor_io.h"

namespace qcal::calib {

StatusOr<CalibrationResult> Calibrate(comm::Comm& comm, model::ModelSource& source,
                                      const at::Tensor& tokens, const std::string& job_dir,
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
  const int64_t num_seqs = tokens.size(0), seq_len = tokens.size(1);
  const std::vector<int64_t> act_shape = {num_seqs, seq_len, config.hidden_size};
  const bool root = comm.rank() == 0;

  // Rank 0 looks at the caches and tells everybody, so every rank takes the same path.
  int64_t cached[2] = {0, 0};  // hessians, activations
  Status local;
  if (root) {
    local = [&]() -> Status {
      QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/hessians"));
      if (options.activations) QCAL_RETURN_IF_ERROR(MakeDirs(job_dir + "/activations"));
      bool h_ok = options.hessians;
      for (int64_t l = 0; l < blocks && h_ok; ++l) {
        auto h = LoadBlockHessians(HessianPath(job_dir, l), key);
        h_ok = h.ok();
        if (!h.ok() && !absl::IsNotFound(h.status())) {
          QCAL_LOG_WARN("cached Hessians not reused: {}", std::string(h.status().message()));
        }
      }
      bool a_ok = options.activations;
      for (int64_t l = 0; l <= blocks && a_ok; ++l) {
        const Status a = CheckActivationCache(ActivationPath(job_dir, l), key, act_shape);
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
  const bool walk_hessians = options.hessians && !cached[0];
  const bool walk_activations = options.activations && !cached[1];
  result.from_cache = options.hessians && cached[0];
  result.activations_from_cache = options.activations && cached[1];

  if (walk_hessians || walk_activations) {
    // This rank's canonical chunks: sequences [s0, s1) in chunks of options.batch.
    const int64_t chunks = (num_seqs + options.batch - 1) / options.batch;
    const comm::Range mine = comm::SliceForRank(chunks, comm.rank(), comm.size());
    std::vector<std::vector<int64_t>> shapes;
    std::vector<int64_t> first_seq;
    for (int64_t c = mine.begin; c < mine.end; ++c) {
      const int64_t a = c * options.batch, b = std::min(num_seqs, a + options.batch);
      shapes.push_back({b - a, seq_len, config.hidden_size});
      first_seq.push_back(a);
    }
    // The walk's activations: this rank's chunks, spilled to the job directory above the budget.
    local = MakeDirs(job_dir + "/spill");
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, "calibration"));
    auto store_or = model::ActivationStore::Create(
        shapes, options.memory_budget_bytes,
        absl::StrCat(job_dir, "/spill/calibration-rank", comm.rank(), ".f32"));
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, store_or.status(), "calibration"));
    model::ActivationStore& store = **store_or;
    if (store.spilled()) {
      QCAL_LOG_INFO("calibration: {:.2f} GiB of activations on this rank over the {:.2f} GiB "
                    "budget: spilled to the job directory",
                    store.total_bytes() / 1073741824.0,
                    options.memory_budget_bytes / 1073741824.0);
    }
    at::NoGradGuard no_grad;
    local = [&]() -> Status {
      for (int64_t i = 0; i < store.chunks(); ++i) {
        QCAL_ASSIGN_OR_RETURN(at::Tensor x,
                              source.Embed(tokens.narrow(0, first_seq[i], shapes[i][0])));
        QCAL_RETURN_IF_ERROR(store.Put(i, x));
      }
      return Status();
    }();
    QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, "calibration, embedding"), "calibration"));
    if (walk_hessians && options.keep_hessians) result.hessians.assign(blocks, BlockHessians{});
    // Saves boundary l (the inputs of block l; l = blocks: the last block's outputs).
    auto save_boundary = [&](int64_t l) -> Status {
      QCAL_ASSIGN_OR_RETURN(auto file,
                            BeginActivationFile(comm, ActivationPath(job_dir, l), key, act_shape));
      Status rows;
      for (int64_t i = 0; i < store.chunks() && rows.ok(); ++i) {
        auto x = store.Get(i);
        rows = x.ok() ? WriteActivationRows(*file, first_seq[i], *x) : x.status();
      }
      QCAL_RETURN_IF_ERROR(AgreeOk(comm, rows, ActivationPath(job_dir, l)));
      return file->Finish(comm);
    };
    // Sharded Hessians: each rank sums every rank's inputs into its band of each triangle (all
    // ranks step through their chunks together; a rank past its last chunk contributes none).
    const bool sharded = walk_hessians && options.shard_hessians;
    const int64_t steps = comm::SliceForRank(chunks, 0, comm.size()).size();
    auto walk_block_sharded = [&](int64_t l, const std::string& where,
                                  BlockHessians* h) -> Status {
      std::unique_ptr<model::DecoderBlock> block;
      local = [&]() -> Status {
        QCAL_ASSIGN_OR_RETURN(block, source.LoadBlock(l));
        for (model::LinearKind k : model::kAllLinears) {
          const int64_t n = block->weights().linear(k).in_features();
          const HessianRows band =
              HessianBandForRank(n, comm.rank(), comm.size(), options.hessian_strip_rows);
          QCAL_ASSIGN_OR_RETURN(h->at(HessianKindOf(k)),
                                HessianAccumulator::Band(n, band, options.hessian_strip_rows));
        }
        return Status();
      }();
      QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, where), where));
      for (int64_t step = 0; step < steps; ++step) {
        std::array<at::Tensor, 4> inputs;
        local = [&]() -> Status {
          if (step >= store.chunks()) {
            for (HessianKind k : kAllHessianKinds) {
              inputs[static_cast<int>(k)] = at::empty({0, seq_len, h->at(k).dim()}, at::kFloat);
            }
            return Status();
          }
          QCAL_ASSIGN_OR_RETURN(at::Tensor x, store.Get(step));
          QCAL_ASSIGN_OR_RETURN(at::Tensor y, ForwardCapturingInputs(*block, x, source.rope(),
                                                                     options.batch, &inputs));
          return store.Put(step, y);
        }();
        QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, where), where));
        for (HessianKind k : kAllHessianKinds) {
          at::Tensor& mine = inputs[static_cast<int>(k)];
          QCAL_ASSIGN_OR_RETURN(at::Tensor all, GatherSequences(comm, mine));
          mine = at::Tensor();
          local = all.size(0) > 0 ? h->at(k).Add(all) : Status();
          const std::string input = absl::StrCat(where, ", ", HessianKindName(k), " input");
          QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, input), input));
        }
      }
      return Status();
    };
    // GPU ranks reduce the sums on their devices when all of them can (every rank has a GPU
    // backend and a device reduction); otherwise every rank downloads and reduces on the host.
    bool reduce_on_device = false;
    if (walk_hessians && !sharded && comm.size() > 1) {
      int64_t can = options.device_sum && options.gpu != nullptr ? 1 : 0;
      QCAL_RETURN_IF_ERROR(comm.AllReduceSum(&can, 1));
      reduce_on_device = can == comm.size();
    }
    // Where the walk's time goes (CalibrationResult::read_seconds, ...).
    auto t = std::chrono::steady_clock::now();
    auto lap = [&t](double* into) {
      const auto now = std::chrono::steady_clock::now();
      *into += std::chrono::duration<double>(now - t).count();
      t = now;
    };
    for (int64_t l = 0; l < blocks; ++l) {
      const std::string where = absl::StrCat("calibration, block ", l);
      lap(&result.forward_seconds);  // (the progress callback, if any)
      if (walk_activations) QCAL_RETURN_IF_ERROR(Annotate(save_boundary(l), where));
      lap(&result.save_seconds);
      BlockHessians h;
      h.backend = options.gpu;
      if (sharded) {
        QCAL_RETURN_IF_ERROR(walk_block_sharded(l, where, &h));
        lap(&result.forward_seconds);  // sharded: the gathers of the inputs included
        QCAL_RETURN_IF_ERROR(
            Annotate(SaveShardedBlockHessians(comm, HessianPath(job_dir, l), h, key), where));
        lap(&result.save_seconds);
        result.tokens = h.at(HessianKind::kQkv).count();
        h = BlockHessians{};  // the bands are in the file
        if (options.keep_hessians) {
          StatusOr<BlockHessians> whole = LoadBlockHessians(HessianPath(job_dir, l), key);
          QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(whole.status(), where), where));
          result.hessians[l] = std::move(*whole);
        }
        if (progress) progress(l + 1, blocks);
        continue;
      }
      local = [&]() -> Status {
        QCAL_ASSIGN_OR_RETURN(std::unique_ptr<model::DecoderBlock> block, source.LoadBlock(l));
        lap(&result.read_seconds);
        if (walk_hessians && options.hessian_strip_rows != kHessianStripRows) {
          for (model::LinearKind k : model::kAllLinears) {
            const int64_t n = block->weights().linear(k).in_features();
            h.at(HessianKindOf(k)) = HessianAccumulator(n, options.hessian_strip_rows);
          }
        }
        if (store.chunks() == 0 && walk_hessians) {
          // A rank without sequences still reduces: its accumulators get the block's sizes.
          const at::Tensor none = at::empty({0, seq_len, config.hidden_size}, at::kFloat);
          QCAL_RETURN_IF_ERROR(
              ForwardCollectingHessians(*block, none, source.rope(), options.batch, &h).status());
        }
        // On a GPU the sums stay on the device for the whole block (flushed once below).
        for (int64_t i = 0; i < store.chunks(); ++i) {
          QCAL_ASSIGN_OR_RETURN(at::Tensor x, store.Get(i));
          QCAL_ASSIGN_OR_RETURN(at::Tensor y,
                                ForwardCollectingHessians(*block, x, source.rope(), options.batch,
                                                          walk_hessians ? &h : nullptr,
                                                          /*flush_device=*/false));
          QCAL_RETURN_IF_ERROR(store.Put(i, y));
        }
        return reduce_on_device ? Status() : FlushDeviceHessians(&h);
      }();
      QCAL_RETURN_IF_ERROR(AgreeOk(comm, Annotate(local, where), where));
      lap(&result.forward_seconds);
      if (walk_hessians) {
        if (reduce_on_device) {
          QCAL_RETURN_IF_ERROR(Annotate(
              AllReduceDeviceHessians(comm, options.device_sum, root || options.keep_hessians,
                                      &h, &result.tokens),
              where));
        } else {
          QCAL_RETURN_IF_ERROR(Annotate(AllReduceHessians(comm, &h), where));
          result.tokens = h.at(HessianKind::kQkv).count();
        }
        lap(&result.reduce_seconds);
        if (root) local = Annotate(SaveBlockHessians(HessianPath(job_dir, l), h, key), where);
        QCAL_RETURN_IF_ERROR(AgreeOk(comm, local, where));
        lap(&result.save_seconds);
        if (options.keep_hessians) result.hessians[l] = std::move(h);
      }
      if (progress) progress(l + 1, blocks);
    }
    if (walk_activations) {
      lap(&result.forward_seconds);
      QCAL_RETURN_IF_ERROR(Annotate(save_boundary(blocks), "calibration, final activations"));
      lap(&result.save_seconds);
    }
  }
  if (result.from_cache && options.keep_hessians) {
    for (int64_t l = 0; l < blocks; ++l) {
      QCAL_ASSIGN_OR_RETURN(BlockHessians h, LoadBlockHessians(HessianPath(job_dir, l), key));
      result.hessians.push_back(std::move(h));
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
