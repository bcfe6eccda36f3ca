#include "engine/model/block_walk.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace qcal::model {

StatusOr<std::unique_ptr<BlockWalk>> BlockWalk::Embed(ModelSource& source,
                                                      const std::vector<at::Tensor>& ids,
                                                      int64_t budget_bytes,
                                                      const std::string& spill_path) {
  std::vector<std::vector<int64_t>> shapes;
  for (const at::Tensor& chunk : ids) {
    if (chunk.dim() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("BlockWalk: chunk ", shapes.size(), " of token ids is not [batch, seq]"));
    }
    shapes.push_back({chunk.size(0), chunk.size(1), source.config().hidden_size});
  }
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<ActivationStore> store,
                        ActivationStore::Create(std::move(shapes), budget_bytes, spill_path));
  std::unique_ptr<BlockWalk> walk(new BlockWalk(std::move(store)));
  for (size_t i = 0; i < ids.size(); ++i) {
    QCAL_ASSIGN_OR_RETURN(at::Tensor x, source.Embed(ids[i]));
    QCAL_RETURN_IF_ERROR(walk->store_->Put(static_cast<int64_t>(i), x));
  }
  return walk;
}

Status BlockWalk::Forward(const DecoderBlock& block, const Rope& rope, const at::Device& device) {
  return Map([&](const at::Tensor& x) -> StatusOr<at::Tensor> {
    if (device.is_cpu()) return block.Forward(x, rope);
    return block.Forward(x.to(device), rope).to(at::kCPU);
  });
}

Status BlockWalk::Map(const ChunkStep& step) {
  for (int64_t i = 0; i < store_->chunks(); ++i) QCAL_RETURN_IF_ERROR(MapChunk(i, step));
  return Status();
}

Status BlockWalk::MapChunk(int64_t i, const ChunkStep& step) {
  QCAL_ASSIGN_OR_RETURN(at::Tensor x, store_->Get(i));
  QCAL_ASSIGN_OR_RETURN(at::Tensor y, step(x));
  return store_->Put(i, y);
}

}  // namespace qcal::model
