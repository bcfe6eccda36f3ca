#include "export/export.h"

#include <sys/stat.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/atomic_file.h"
#include "common/dtype.h"
#include "common/hf_config.h"
#include "common/io_util.h"
#include "common/checkpoint_layout.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "methods/method_factory.h"
#include "engine/model/llama.h"
#include "engine/model/model_source.h"
#include "engine/model/tensor_io.h"
#include "engine/quant/scalar_linear.h"

namespace qcal::exporter {
namespace {

using model::LinearKind;
using Sink = SafetensorsWriter::ByteSink;

constexpr char kEmbed[] = "model.embed_tokens.weight";
constexpr char kNorm[] = "model.norm.weight";
constexpr char kHead[] = "lm_head.weight";

std::string LinearPrefix(int64_t layer, LinearKind k) {
  return absl::StrCat("model.layers.", layer, ".", model::LinearName(k));
}

// The model's dtype (config.json torch_dtype): what the unquantized tensors of a GPTQ export are
// stored in. Absent: float32, as Hugging Face assumes.
StatusOr<DType> ModelDType(const LlamaConfig& config, const std::string& dir) {
  const nlohmann::json& raw = config.raw;
  if (!raw.contains("torch_dtype") || raw["torch_dtype"].is_null()) return DType::kF32;
  if (!raw["torch_dtype"].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: torch_dtype is not a string"));
  }
  const std::string t = raw["torch_dtype"].get<std::string>();
  if (t == "float16" || t == "half") return DType::kF16;
  if (t == "bfloat16") return DType::kBF16;
  if (t == "float32" || t == "float") return DType::kF32;
  return absl::InvalidArgumentError(absl::StrCat(
      dir, "/config.json: torch_dtype '", t, "' (expected float16, bfloat16 or float32)"));
}

// Hands float32 values to `sink` as `dtype`, in pieces.
Status SinkAs(DType dtype, const float* data, size_t n, const Sink& sink) {
  if (dtype == DType::kF32) return sink(data, n * sizeof(float));
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<uint8_t> buf(std::min(n, kPiece) * DTypeSize(dtype));
  for (size_t at = 0; at < n; at += kPiece) {
    const size_t m = std::min(kPiece, n - at);
    ConvertFromF32(dtype, data + at, m, buf.data());
    QCAL_RETURN_IF_ERROR(sink(buf.data(), m * DTypeSize(dtype)));
  }
  return absl::OkStatus();
}

// One tensor of the output: its place, and how its bytes are made when its shard is written.
struct Planned {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  SafetensorsWriter::Producer produce;
};

// What a quantized linear becomes in the GPTQ layout, from its stored grid alone.
struct GptqShape {
  int bits = 0;
  int64_t in = 0, out = 0, groups = 0, group_size = -1;
  bool symmetric = true;
};

// The block being exported: loaded through the checkpoint's method once, when the first of its
// tensors is written (tensors are written in order, so each block is loaded once).
class BlockCache {
 public:
  BlockCache(const methods::Method* method, CheckpointReader* ckpt, bool gptq)
      : method_(method), ckpt_(ckpt), gptq_(gptq) {}

  struct Block {
    model::BlockWeights weights;
    quant::GptqTensors gptq[7];
  };

  StatusOr<const Block*> Get(int64_t layer) {
    if (layer == layer_) return &block_;
    layer_ = -1;
    block_ = Block();
    QCAL_ASSIGN_OR_RETURN(block_.weights, method_->block_format().LoadBlock(*ckpt_, layer));
    if (gptq_) {
      for (LinearKind k : model::kAllLinears) {
        const std::string prefix = LinearPrefix(layer, k);
        const auto* s = dynamic_cast<const quant::ScalarQuantLinear*>(&block_.weights.linear(k));
        if (s == nullptr) return NotOnAGrid(prefix);
        StatusOr<quant::GptqTensors> g = s->ExportGptq(/*pad_words=*/true);
        if (!g.ok()) return Annotate(g.status(), prefix);
        block_.gptq[static_cast<int>(k)] = std::move(*g);
      }
    }
    layer_ = layer;
    return &block_;
  }

  Status NotOnAGrid(const std::string& prefix) const {
    return absl::FailedPreconditionError(absl::StrCat(
        ckpt_->dir(), ": ", prefix, " is stored in method ", method_->recipe().method,
        "'s own layer format, not on a scalar integer grid: the GPTQ and compressed-tensors "
        "formats hold integer codes with per-group scales and zero points, and cannot express "
        "lattice or trellis codebook codes or incoherence transforms (try --format dense)"));
  }

 private:
  const methods::Method* method_;
  CheckpointReader* ckpt_;
  const bool gptq_;
  int64_t layer_ = -1;
  Block block_;
};

class Exporter {
 public:
  Exporter(ExportOptions options) : o_(std::move(options)) {}

  StatusOr<ExportResult> Run() {
    QCAL_RETURN_IF_ERROR(Open());
    QCAL_RETURN_IF_ERROR(Plan());
    const std::string partial = o_.out_dir + ".partial";
    std::error_code ec;
    std::filesystem::remove_all(partial, ec);  // a previous export's leftovers (ours by name)
    QCAL_RETURN_IF_ERROR(MakeDirs(partial));
    StatusOr<ExportResult> result = WriteInto(partial);
    if (result.ok()) {
      std::filesystem::remove(o_.out_dir, ec);  // an empty directory, checked in Open
      if (Status renamed = RenameNoFollow(partial, o_.out_dir); !renamed.ok()) {
        result = renamed;
      } else if (Status synced = SyncParentDir(o_.out_dir); !synced.ok()) {
        result = synced;
      }
    }
    if (!result.ok()) std::filesystem::remove_all(partial, ec);
    if (io::IsOutOfSpace(result.status())) {
      // The quantize job's advice (resume from the journal) does not apply: an export keeps
      // nothing of a failed run.
      std::string message(result.status().message());
      const std::string advice = io::kOutOfSpaceAdvice;
      message.replace(message.find(advice), advice.size(),
                      "free space on that filesystem and run the export again (it starts over; "
                      "the partial export was removed, the input checkpoint is unchanged)");
      return absl::FailedPreconditionError(message);
    }
    return result;
  }

 private:
  Status Open() {
    if (o_.format != "gptq" && o_.format != "dense" && o_.format != "compressed-tensors") {
      return absl::InvalidArgumentError(absl::StrCat(
          "export format '", o_.format, "' (supported: gptq, compressed-tensors, dense)"));
    }
    if (o_.max_shard_bytes <= 0) {
      return absl::InvalidArgumentError("--max-shard-size must be positive");
    }
    gptq_ = o_.format == "gptq";
    ct_ = o_.format == "compressed-tensors";
    // config.json is written last (common/checkpoint_layout.h): without it the directory is no
    // finished checkpoint (`qcal export` first asks the job directory whether a job is still
    // writing it: runner/job_dir.h CheckJobFinished).
    std::error_code exists_ec;
    if (!std::filesystem::exists(o_.in_dir + "/config.json", exists_ec)) {
      return absl::FailedPreconditionError(absl::StrCat(
          o_.in_dir, ": no config.json, so not a finished checkpoint (a quantization job writes "
          "it last)"));
    }
    QCAL_ASSIGN_OR_RETURN(config_, LoadLlamaConfig(o_.in_dir));
    if (!config_.raw.contains("quantization_config")) {
      return absl::InvalidArgumentError(absl::StrCat(
          o_.in_dir, "/config.json: a float model (no quantization_config): nothing to export"));
    }
    QCAL_ASSIGN_OR_RETURN(method_, methods::CheckpointMethod(config_, o_.in_dir));
    const methods::Inference& inference = method_->inference();
    QCAL_RETURN_IF_ERROR(Annotate(ct_ ? inference.CheckPlainForwardWithQuantizedInputs()
                                      : inference.CheckPlainForward(),
                                  absl::StrCat(o_.in_dir, ": cannot export to ", o_.format)));
    if (ct_) {
      act_ = inference.LinearInputQuantization();
      if (act_) QCAL_RETURN_IF_ERROR(CheckInputActivations(*act_));
    }
    QCAL_ASSIGN_OR_RETURN(dtype_, ModelDType(config_, o_.in_dir));
    QCAL_ASSIGN_OR_RETURN(ckpt_, CheckpointReader::Open(o_.in_dir));
    // The output: a new directory (or an empty one), not inside the input.
    const std::filesystem::path in = std::filesystem::weakly_canonical(o_.in_dir);
    const std::filesystem::path out = std::filesystem::weakly_canonical(o_.out_dir);
    auto [a, b] = std::mismatch(in.begin(), in.end(), out.begin(), out.end());
    if (a == in.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          o_.out_dir, ": the export's directory is the input checkpoint or inside it (",
          o_.in_dir, ")"));
    }
    struct stat st;
    if (::stat(o_.out_dir.c_str(), &st) == 0) {
      std::error_code ec;
      if (!S_ISDIR(st.st_mode) || !std::filesystem::is_empty(o_.out_dir, ec)) {
        return absl::AlreadyExistsError(absl::StrCat(
            o_.out_dir, ": exists and is not an empty directory; the export writes a new one"));
      }
    }
    cache_ = std::make_unique<BlockCache>(method_.get(), ckpt_.get(), gptq_);
    return absl::OkStatus();
  }

  // A table (embedding, head) stored in the qcal checkpoint, converted to `dtype` in row chunks.
  Status PlanTable(const std::string& name, DType dtype) {
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(name));
    const SafetensorsFile* file = found.first;
    const TensorInfo* info = found.second;
    if (!IsFloatingDType(info->dtype) || info->shape.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(file->path(), ": tensor '", name,
                                                     "' is not a 2-D floating table"));
    }
    Planned p{name, dtype, info->shape, 0, nullptr};
    p.bytes = static_cast<uint64_t>(info->numel()) * DTypeSize(dtype);
    p.produce = [file, info, dtype](const Sink& sink) -> Status {
      if (info->dtype == dtype) return SinkStoredBytes(*file, *info, sink);
      const int64_t rows = info->shape[0], cols = info->shape[1];
      const int64_t step = model::TableChunkRows(cols);
      const size_t row_bytes = static_cast<size_t>(cols) * DTypeSize(info->dtype);
      std::vector<float> chunk;
      for (int64_t r = 0; r < rows; r += step) {
        const int64_t n = std::min(step, rows - r);
        chunk.resize(static_cast<size_t>(n * cols));
        ConvertToF32(info->dtype, file->Data(*info) + r * row_bytes, chunk.size(), chunk.data());
        QCAL_RETURN_IF_ERROR(SinkAs(dtype, chunk.data(), chunk.size(), sink));
        file->ReleasePages(*info, r * row_bytes, (r + n) * row_bytes);
      }
      return absl::OkStatus();
    };
    plan_.push_back(std::move(p));
    return absl::OkStatus();
  }

  // A float tensor of the checkpoint read whole (the final norm), in `dtype`.
  Status PlanSmall(const std::string& name, DType dtype) {
    QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(name));
    const TensorInfo* info = found.second;
    CheckpointReader* ckpt = ckpt_.get();
    Planned p{name, dtype, info->shape, static_cast<uint64_t>(info->numel()) * DTypeSize(dtype),
              nullptr};
    p.produce = [ckpt, name, dtype](const Sink& sink) -> Status {
      QCAL_ASSIGN_OR_RETURN(std::vector<float> v, ckpt->ReadF32(name));
      return SinkAs(dtype, v.data(), v.size(), sink);
    };
    plan_.push_back(std::move(p));
    return absl::OkStatus();
  }

  // Tensor `name` of block `layer`, made from the loaded block by `make`.
  void PlanBlockTensor(
      std::string name, DType dtype, std::vector<int64_t> shape, int64_t layer,
      std::function<Status(const BlockCache::Block&, const Sink&)> make) {
    uint64_t n = DTypeSize(dtype);
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    BlockCache* cache = cache_.get();
    plan_.push_back({std::move(name), dtype, std::move(shape), n,
                     [cache, layer, make = std::move(make)](const Sink& sink) -> Status {
                       QCAL_ASSIGN_OR_RETURN(const BlockCache::Block* b, cache->Get(layer));
                       return make(*b, sink);
                     }});
  }

  StatusOr<GptqShape> GridOf(int64_t layer, LinearKind k) {
    const std::string prefix = LinearPrefix(layer, k);
    StatusOr<quant::ScalarLinearData> grid = quant::ScalarQuantLinear::ReadGrid(*ckpt_, prefix);
    if (!grid.ok()) {
      if (absl::IsNotFound(grid.status())) return cache_->NotOnAGrid(prefix);
      return grid.status();
    }
    GptqShape g;
    g.bits = grid->bits;
    g.in = grid->in_features;
    g.out = grid->out_features;
    g.group_size = grid->group_size;
    g.symmetric = grid->symmetric;
    g.groups = g.group_size == -1 ? 1 : (g.in + g.group_size - 1) / g.group_size;
    if (ct_) {
      if (g.bits < 2 || g.bits > 8) {
        return absl::FailedPreconditionError(absl::StrCat(
            o_.in_dir, ": ", prefix, " has ", g.bits,
            "-bit codes; compressed-tensors' pack-quantized format packs 2 to 8 bits"));
      }
      QCAL_RETURN_IF_ERROR(CheckScalesExact(prefix, g));
    } else {
      if (g.bits != 2 && g.bits != 3 && g.bits != 4 && g.bits != 8) {
        return absl::FailedPreconditionError(absl::StrCat(
            o_.in_dir, ": ", prefix, " has ", g.bits,
            "-bit codes; the GPTQ format packs 2, 3, 4 or 8 bits"));
      }
      if ((g.in * g.bits) % 32 != 0 || (g.out * g.bits) % 32 != 0) {
        padded_.push_back(absl::StrCat(prefix, " (", g.out, " x ", g.in, ")"));
      }
      QCAL_RETURN_IF_ERROR(CheckGptqExpressible(prefix, g));
    }
    if (!grid_) {
      grid_ = g;
    } else if (grid_->bits != g.bits || grid_->group_size != g.group_size ||
               grid_->symmetric != g.symmetric) {
      return absl::FailedPreconditionError(absl::StrCat(
          o_.in_dir, ": ", prefix, " has ", g.bits, " bits, group size ", g.group_size,
          g.symmetric ? ", symmetric" : ", asymmetric", "; the first linear has ", grid_->bits,
          " bits, group size ", grid_->group_size,
          grid_->symmetric ? ", symmetric" : ", asymmetric",
          ": one ", o_.format, " quantization_config cannot describe both"));
    }
    return g;
  }

  // compressed-tensors stores the scales in the model's dtype (vLLM and transformers load them
  // into parameters of that dtype): each must be exact there.
  Status CheckScalesExact(const std::string& prefix, const GptqShape& g) {
    if (dtype_ == DType::kF32) return absl::OkStatus();
    QCAL_ASSIGN_OR_RETURN(std::vector<float> scales,
                          model::ReadF32Checked(*ckpt_, prefix + ".scales", {g.out, g.groups}));
    std::vector<uint8_t> narrow(scales.size() * DTypeSize(dtype_));
    std::vector<float> back(scales.size());
    ConvertFromF32(dtype_, scales.data(), scales.size(), narrow.data());
    ConvertToF32(dtype_, narrow.data(), scales.size(), back.data());
    for (size_t i = 0; i < scales.size(); ++i) {
      if (back[i] != scales[i]) {
        return absl::FailedPreconditionError(absl::StrCat(
            o_.in_dir, ": ", prefix, ": scale of output ", i / g.groups, " group ",
            i % g.groups, " (", scales[i], ") is not exact in ", std::string(DTypeName(dtype_)),
            ", the model's dtype, which compressed-tensors stores scales in"));
      }
    }
    return absl::OkStatus();
  }

  // Whether `prefix`'s stored g_idx assigns any column to a group other than column / group
  // size (activation order): compressed-tensors' "actorder": "group" then carries it.
  StatusOr<bool> HasActOrder(const std::string& prefix, const GptqShape& g) {
    if (!ckpt_->Has(prefix + ".g_idx")) return false;
    QCAL_ASSIGN_OR_RETURN(std::vector<int64_t> g_idx,
                          model::ReadInts(*ckpt_, prefix + ".g_idx", {DType::kI32}, {g.in}));
    for (int64_t j = 0; j < g.in; ++j) {
      if (g_idx[j] != (g.group_size == -1 ? 0 : j / g.group_size)) return true;
    }
    return false;
  }

  // What compressed-tensors' input_activations (and the engines that load them) compute must be
  // what qcal's activation quantizer computes (engine/qsim/act_quant.h):
  //  * dynamic per token, symmetric, clip 1: scale = max|x| / 127 per token, codes clamped to
  //    [-128, 127] (vLLM's dynamic int8 quantization; strategy "token");
  //  * static per tensor: the calibrated scale (clip folded in) and, asymmetric, zero point,
  //    stored per linear as input_scale / input_zero_point (strategy "tensor").
  Status CheckInputActivations(const ActivationQuantSpec& a) const {
    auto refuse = [&](const std::string& why) {
      return absl::FailedPreconditionError(absl::StrCat(
          o_.in_dir, ": cannot export to compressed-tensors: the recipe's activation quantizer (",
          a.bits, "-bit, ", a.granularity, a.is_static ? ", static" : ", dynamic",
          a.symmetric ? ", symmetric" : ", asymmetric", ", clip ", a.clip, ") ", why));
    };
    if (a.bits != 8) {
      return refuse("is not 8-bit: the export writes int8 activations (W8A8), the integer "
                    "activations vLLM's compressed-tensors kernels run");
    }
    if (a.is_static) {
      if (a.granularity != "per_tensor") return refuse("is static but not per tensor");
      return absl::OkStatus();
    }
    if (a.granularity != "per_token") {
      return refuse("takes one scale per sequence, which the format's dynamic per-tensor "
                    "strategy (one scale per forward call's tensor) computes only at batch 1");
    }
    if (!a.symmetric) {
      return refuse("is asymmetric and dynamic: the format's dynamic asymmetric range is the "
                    "token's [min, max], qcal's includes 0");
    }
    if (a.clip != 1.0) {
      return refuse("clips the dynamic range: the format's dynamic scale is max|x| / 127, with "
                    "no clipping ratio");
    }
    return absl::OkStatus();
  }

  // A static recipe's input_scale (float32, the dtype vLLM loads it in: a calibrated scale is
  // not exact in 16 bits) and, asymmetric, input_zero_point (int8: zero - 128) of one linear.
  void PlanStaticInput(const std::string& prefix, int64_t layer, LinearKind k) {
    const methods::Inference* inference = &method_->inference();
    auto params = [inference, layer, k](const BlockCache::Block& b) {
      return inference->StaticLinearInputParams(b.weights, layer, k);
    };
    PlanBlockTensor(prefix + ".input_scale", DType::kF32, {1}, layer,
                    [params](const BlockCache::Block& b, const Sink& sink) -> Status {
                      QCAL_ASSIGN_OR_RETURN(const methods::StaticInputParams p, params(b));
                      return sink(&p.scale, sizeof(float));
                    });
    if (!act_->symmetric) {
      PlanBlockTensor(prefix + ".input_zero_point", DType::kI8, {1}, layer,
                      [params](const BlockCache::Block& b, const Sink& sink) -> Status {
                        QCAL_ASSIGN_OR_RETURN(const methods::StaticInputParams p, params(b));
                        const int8_t zp = static_cast<int8_t>(p.zero - 128);
                        return sink(&zp, 1);
                      });
    }
  }

  // compressed-tensors' int-quantized layout (its IntQuantizationCompressor), the weights of
  // W8A8: weight [out, in] int8 holds the signed codes q (asymmetric: q = c - 2^(b-1), zero
  // point zp = z - 2^(b-1) in weight_zero_point [out, groups] int8), weight_scale and
  // weight_g_idx as for pack-quantized.
  void PlanIntLinear(const std::string& prefix, int64_t layer, int ki, const GptqShape& g) {
    const int32_t shift = g.symmetric ? 0 : -(1 << (g.bits - 1));
    PlanBlockTensor(prefix + ".weight", DType::kI8, {g.out, g.in}, layer,
                    [=](const BlockCache::Block& b, const Sink& sink) -> Status {
                      QCAL_ASSIGN_OR_RETURN(const quant::ScalarLinearData* d, ScalarData(b, ki));
                      std::vector<int8_t> row(g.in);
                      for (int64_t r = 0; r < g.out; ++r) {
                        const int32_t* c = d->codes.data() + r * g.in;
                        for (int64_t j = 0; j < g.in; ++j) {
                          row[j] = static_cast<int8_t>(c[j] + shift);
                        }
                        QCAL_RETURN_IF_ERROR(sink(row.data(), row.size()));
                      }
                      return absl::OkStatus();
                    });
    if (!g.symmetric) {
      PlanBlockTensor(prefix + ".weight_zero_point", DType::kI8, {g.out, g.groups}, layer,
                      [=](const BlockCache::Block& b, const Sink& sink) -> Status {
                        QCAL_ASSIGN_OR_RETURN(const quant::ScalarLinearData* d,
                                              ScalarData(b, ki));
                        std::vector<int8_t> zp(d->zeros.size());
                        for (size_t i = 0; i < zp.size(); ++i) {
                          zp[i] = static_cast<int8_t>(d->zeros[i] + shift);
                        }
                        return sink(zp.data(), zp.size());
                      });
    }
    PlanScaleAndGroups(prefix, layer, ki, g);
  }

  // W8A8 (8-bit weights, quantized inputs): int-quantized, the layout vLLM's int8 W8A8 kernels
  // load; everything else: pack-quantized.
  bool IntFormat(const GptqShape& g) const { return act_.has_value() && g.bits == 8; }

  static StatusOr<const quant::ScalarLinearData*> ScalarData(const BlockCache::Block& b, int ki) {
    const auto* s =
        dynamic_cast<const quant::ScalarQuantLinear*>(&b.weights.linear(static_cast<LinearKind>(ki)));
    if (s == nullptr) return absl::InternalError("not a scalar layer after its grid was read");
    return &s->data();
  }

  // compressed-tensors' pack-quantized layout (its PackedQuantizationCompressor): signed codes q
  // in [-2^(b-1), 2^(b-1)) (qcal's asymmetric code c and zero z become q = c - 2^(b-1) and
  // zp = z - 2^(b-1), so q - zp = c - z), shifted to unsigned and packed 32/b to an int32 from
  // the low bits, along the input dimension (weight_packed) or, for zero points, the output one.
  void PlanCompressedLinear(const std::string& prefix, int64_t layer, int ki,
                            const GptqShape& g) {
    const int bits = g.bits, per_word = 32 / bits;
    const int64_t words = (g.in + per_word - 1) / per_word;
    auto data_of = [ki](const BlockCache::Block& b) { return ScalarData(b, ki); };
    PlanBlockTensor(prefix + ".weight_packed", DType::kI32, {g.out, words}, layer,
                    [=](const BlockCache::Block& b, const Sink& sink) -> Status {
                      QCAL_ASSIGN_OR_RETURN(const quant::ScalarLinearData* d, data_of(b));
                      const int32_t shift = g.symmetric ? 1 << (bits - 1) : 0;
                      std::vector<uint32_t> row(words);
                      for (int64_t r = 0; r < g.out; ++r) {
                        std::fill(row.begin(), row.end(), 0u);
                        const int32_t* c = d->codes.data() + r * g.in;
                        for (int64_t j = 0; j < g.in; ++j) {
                          const uint32_t u = static_cast<uint32_t>(c[j] + shift);
                          row[j / per_word] |= u << ((j % per_word) * bits);
                        }
                        QCAL_RETURN_IF_ERROR(sink(row.data(), row.size() * sizeof(uint32_t)));
                      }
                      return absl::OkStatus();
                    });
    if (!g.symmetric) {
      const int64_t zrows = (g.out + per_word - 1) / per_word;
      PlanBlockTensor(prefix + ".weight_zero_point", DType::kI32, {zrows, g.groups}, layer,
                      [=](const BlockCache::Block& b, const Sink& sink) -> Status {
                        QCAL_ASSIGN_OR_RETURN(const quant::ScalarLinearData* d, data_of(b));
                        std::vector<uint32_t> packed(zrows * g.groups, 0u);
                        for (int64_t r = 0; r < g.out; ++r) {
                          for (int64_t k = 0; k < g.groups; ++k) {
                            const uint32_t u = static_cast<uint32_t>(d->zeros[r * g.groups + k]);
                            packed[(r / per_word) * g.groups + k] |= u << ((r % per_word) * bits);
                          }
                        }
                        return sink(packed.data(), packed.size() * sizeof(uint32_t));
                      });
    }
    PlanScaleAndGroups(prefix, layer, ki, g);
    PlanBlockTensor(prefix + ".weight_shape", DType::kI64, {2}, layer,
                    [=](const BlockCache::Block&, const Sink& sink) -> Status {
                      const int64_t shape[2] = {g.out, g.in};
                      return sink(shape, sizeof(shape));
                    });
  }

  // weight_scale [out, groups] in the model's dtype and weight_g_idx [in] int32 (actorder
  // "group"): the same in both layouts.
  void PlanScaleAndGroups(const std::string& prefix, int64_t layer, int ki, const GptqShape& g) {
    auto data_of = [ki](const BlockCache::Block& b) { return ScalarData(b, ki); };
    const DType scale_dtype = dtype_;
    PlanBlockTensor(prefix + ".weight_scale", scale_dtype, {g.out, g.groups}, layer,
                    [=](const BlockCache::Block& b, const Sink& sink) -> Status {
                      QCAL_ASSIGN_OR_RETURN(const quant::ScalarLinearData* d, data_of(b));
                      return SinkAs(scale_dtype, d->scales.data(), d->scales.size(), sink);
                    });
    if (ct_actorder_) {
      PlanBlockTensor(prefix + ".weight_g_idx", DType::kI32, {g.in}, layer,
                      [=](const BlockCache::Block& b, const Sink& sink) -> Status {
                        QCAL_ASSIGN_OR_RETURN(const quant::ScalarLinearData* d, data_of(b));
                        std::vector<int32_t> g_idx(g.in);
                        for (int64_t j = 0; j < g.in; ++j) {
                          g_idx[j] = d->g_idx.empty()
                                         ? static_cast<int32_t>(j / g.group_size)
                                         : d->g_idx[j];
                        }
                        return sink(g_idx.data(), g_idx.size() * sizeof(int32_t));
                      });
    }
  }

  // What the v1 format cannot hold exactly, from the stored scales and zero points (checked
  // before anything is written): scales that are not fp16 values, and an asymmetric zero point
  // of 0 (the format stores zero − 1, which wraps).
  Status CheckGptqExpressible(const std::string& prefix, const GptqShape& g) {
    QCAL_ASSIGN_OR_RETURN(std::vector<float> scales,
                          model::ReadF32Checked(*ckpt_, prefix + ".scales", {g.out, g.groups}));
    for (size_t i = 0; i < scales.size(); ++i) {
      if (HalfToFloat(FloatToHalf(scales[i])) != scales[i]) {
        return absl::FailedPreconditionError(absl::StrCat(
            o_.in_dir, ": ", prefix, ": scale of output ", i / g.groups, " group ",
            i % g.groups, " (", scales[i], ") is not exact in fp16, the GPTQ format's scale "
            "type (the checkpoint was quantized with float32 scales: quantize it again with "
            "scalar.scale_dtype: f16, the rtn and gptq default)"));
      }
    }
    if (g.symmetric) return absl::OkStatus();
    QCAL_ASSIGN_OR_RETURN(std::vector<int64_t> zeros,
                          model::ReadInts(*ckpt_, prefix + ".zeros", {DType::kI32},
                                          {g.out, g.groups}));
    for (size_t i = 0; i < zeros.size(); ++i) {
      if (zeros[i] == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            o_.in_dir, ": ", prefix, ": output ", i / g.groups, " group ", i % g.groups,
            " has zero point 0, which the GPTQ v1 format cannot store (it stores zero − 1)"));
      }
    }
    return absl::OkStatus();
  }

  Status PlanLinear(int64_t layer, LinearKind k) {
    const std::string prefix = LinearPrefix(layer, k);
    const int ki = static_cast<int>(k);
    if (!gptq_ && !ct_) {
      PlanBlockTensor(prefix + ".weight", DType::kF32, model::LinearShape(config_, k), layer,
                      [k](const BlockCache::Block& b, const Sink& sink) -> Status {
                        const at::Tensor w = b.weights.linear(k).DenseWeight().contiguous();
                        return sink(w.data_ptr<float>(), w.numel() * sizeof(float));
                      });
      return absl::OkStatus();
    }
    QCAL_ASSIGN_OR_RETURN(const GptqShape g, GridOf(layer, k));
    if (ct_) {
      if (IntFormat(g)) {
        PlanIntLinear(prefix, layer, ki, g);
      } else {
        PlanCompressedLinear(prefix, layer, ki, g);
      }
      if (act_ && act_->is_static) PlanStaticInput(prefix, layer, k);
      return absl::OkStatus();
    }
    auto ints = [ki](std::vector<int32_t> quant::GptqTensors::*field) {
      return [ki, field](const BlockCache::Block& b, const Sink& sink) -> Status {
        const std::vector<int32_t>& v = b.gptq[ki].*field;
        return sink(v.data(), v.size() * sizeof(int32_t));
      };
    };
    const int64_t wrows = (g.in * g.bits + 31) / 32, zcols = (g.out * g.bits + 31) / 32;
    PlanBlockTensor(prefix + ".qweight", DType::kI32, {wrows, g.out}, layer,
                    ints(&quant::GptqTensors::qweight));
    PlanBlockTensor(prefix + ".qzeros", DType::kI32, {g.groups, zcols}, layer,
                    ints(&quant::GptqTensors::qzeros));
    PlanBlockTensor(prefix + ".scales", DType::kF16, {g.groups, g.out}, layer,
                    [ki](const BlockCache::Block& b, const Sink& sink) -> Status {
                      const std::vector<uint16_t>& v = b.gptq[ki].scales;
                      return sink(v.data(), v.size() * sizeof(uint16_t));
                    });
    PlanBlockTensor(prefix + ".g_idx", DType::kI32, {g.in}, layer,
                    [ki, this](const BlockCache::Block& b, const Sink& sink) -> Status {
                      const quant::GptqTensors& t = b.gptq[ki];
                      // desc_act: any column whose group is not column / group_size.
                      for (int64_t j = 0; j < t.in_features; ++j) {
                        const int64_t plain = grid_->group_size == -1 ? 0 : j / grid_->group_size;
                        if (t.g_idx[j] != plain) desc_act_seen_ = true;
                      }
                      return sink(t.g_idx.data(), t.g_idx.size() * sizeof(int32_t));
                    });
    return absl::OkStatus();
  }

  Status Plan() {
    const int64_t hidden = config_.hidden_size;
    // The float tensors: the model's dtype for GPTQ (what engines run in); float32 for dense,
    // whose tables stay as stored (their values, whatever the dtype, are what qcal computed with).
    const bool packed = gptq_ || ct_;
    const DType float_dtype = packed ? dtype_ : DType::kF32;
    if (ct_) {
      // One config group describes every linear: activation order anywhere puts g_idx on all.
      for (int64_t l = 0; l < config_.num_hidden_layers && !ct_actorder_; ++l) {
        for (LinearKind k : model::kAllLinears) {
          QCAL_ASSIGN_OR_RETURN(const GptqShape g, GridOf(l, k));
          QCAL_ASSIGN_OR_RETURN(const bool ordered, HasActOrder(LinearPrefix(l, k), g));
          if (ordered) {
            if (g.group_size == -1) continue;  // one group per row: any order is the same
            ct_actorder_ = true;
            break;
          }
        }
      }
    }
    {
      QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(kEmbed));
      QCAL_RETURN_IF_ERROR(PlanTable(kEmbed, packed ? dtype_ : found.second->dtype));
    }
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      PlanBlockTensor(p + "input_layernorm.weight", float_dtype, {hidden}, l,
                      [float_dtype](const BlockCache::Block& b, const Sink& sink) -> Status {
                        const at::Tensor w = b.weights.input_norm.to(at::kFloat).contiguous();
                        return SinkAs(float_dtype, w.data_ptr<float>(), w.numel(), sink);
                      });
      for (LinearKind k : {LinearKind::kQ, LinearKind::kK, LinearKind::kV, LinearKind::kO}) {
        QCAL_RETURN_IF_ERROR(PlanLinear(l, k));
      }
      PlanBlockTensor(p + "post_attention_layernorm.weight", float_dtype, {hidden}, l,
                      [float_dtype](const BlockCache::Block& b, const Sink& sink) -> Status {
                        const at::Tensor w = b.weights.post_norm.to(at::kFloat).contiguous();
                        return SinkAs(float_dtype, w.data_ptr<float>(), w.numel(), sink);
                      });
      for (LinearKind k : {LinearKind::kGate, LinearKind::kUp, LinearKind::kDown}) {
        QCAL_RETURN_IF_ERROR(PlanLinear(l, k));
      }
    }
    QCAL_RETURN_IF_ERROR(PlanSmall(kNorm, float_dtype));
    if (ckpt_->Has(kHead)) {
      QCAL_ASSIGN_OR_RETURN(auto found, ckpt_->Find(kHead));
      QCAL_RETURN_IF_ERROR(PlanTable(kHead, packed ? dtype_ : found.second->dtype));
    }
    if (!padded_.empty()) {
      QCAL_LOG_WARN(
          "export: {} linears (first: {}) have in·bits or out·bits not a multiple of 32; their "
          "packed runs end in a zero-padded word (docs/formats.md), which loaders that assume "
          "whole words (transformers, vLLM) refuse. Every Llama shape packs whole words.",
          padded_.size(), padded_.front());
    }
    return absl::OkStatus();
  }

  StatusOr<ExportResult> WriteInto(const std::string& dir) {
    // Shards by size, in order (a tensor larger than the limit alone in its shard).
    std::vector<std::vector<const Planned*>> shards(1);
    uint64_t in_shard = 0, total = 0;
    for (const Planned& p : plan_) {
      if (!shards.back().empty() && in_shard + p.bytes > static_cast<uint64_t>(o_.max_shard_bytes)) {
        shards.emplace_back();
        in_shard = 0;
      }
      shards.back().push_back(&p);
      in_shard += p.bytes;
      total += p.bytes;
    }
    ExportResult result;
    result.out_dir = o_.out_dir;
    std::map<std::string, std::string> weight_map;
    const int64_t n = static_cast<int64_t>(shards.size());
    for (int64_t i = 0; i < n; ++i) {
      const std::string name =
          n == 1 ? "model.safetensors" : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, n);
      SafetensorsWriter writer;
      writer.SetMetadata("format", "pt");  // transformers requires it
      for (const Planned* p : shards[i]) {
        QCAL_RETURN_IF_ERROR(writer.AddStreamed(p->name, p->dtype, p->shape, p->produce));
        weight_map[p->name] = name;
      }
      QCAL_RETURN_IF_ERROR(writer.Write(dir + "/" + name));
      QCAL_LOG_INFO("export: wrote {} ({} tensors)", name, shards[i].size());
      result.shards.push_back(name);
    }
    if (n > 1) QCAL_RETURN_IF_ERROR(WriteCheckpointIndex(dir, weight_map, total));
    result.tensors = static_cast<int64_t>(plan_.size());
    result.tensor_bytes = total;

    LlamaConfig out = config_;
    out.raw.erase("quantization_config");
    if (gptq_) {
      result.quantization_config = {{"quant_method", "gptq"},
                                    {"bits", grid_->bits},
                                    {"group_size", grid_->group_size},
                                    {"desc_act", desc_act_seen_},
                                    {"sym", grid_->symmetric},
                                    {"static_groups", false},
                                    {"true_sequential", true},
                                    {"lm_head", false},
                                    {"checkpoint_format", "gptq"}};
      out.raw["quantization_config"] = result.quantization_config;
      // AutoGPTQ / GPTQModel read the same fields from quantize_config.json.
      QCAL_RETURN_IF_ERROR(WriteFileAtomic(dir + "/quantize_config.json",
                                           result.quantization_config.dump(2) + "\n"));
    } else if (ct_) {
      nlohmann::json weights = {{"num_bits", grid_->bits},
                                {"type", "int"},
                                {"symmetric", grid_->symmetric},
                                {"strategy", grid_->group_size == -1 ? "channel" : "group"},
                                {"group_size", grid_->group_size == -1
                                                   ? nlohmann::json()
                                                   : nlohmann::json(grid_->group_size)},
                                {"actorder", ct_actorder_ ? nlohmann::json("group")
                                                          : nlohmann::json()},
                                {"block_structure", nullptr},
                                {"dynamic", false},
                                {"observer", "minmax"},
                                {"observer_kwargs", nlohmann::json::object()}};
      const std::string format = IntFormat(*grid_) ? "int-quantized" : "pack-quantized";
      nlohmann::json inputs;  // null: float inputs
      if (act_) {
        inputs = {{"num_bits", act_->bits},
                  {"type", "int"},
                  {"symmetric", act_->symmetric},
                  {"strategy", act_->is_static ? "tensor" : "token"},
                  {"group_size", nullptr},
                  {"block_structure", nullptr},
                  {"dynamic", !act_->is_static},
                  {"actorder", nullptr},
                  {"observer", act_->is_static ? nlohmann::json("minmax") : nlohmann::json()},
                  {"observer_kwargs", nlohmann::json::object()}};
      }
      // R4 in blocks: compressed-tensors' "hadamard" transform with head_dim = the block, online
      // on the input and (inverse) already fused into the weight, as its TransformArgs say.
      nlohmann::json transforms = nlohmann::json::object();
      for (const methods::Inference::InputHadamard& h :
           method_->inference().OnlineInputHadamards()) {
        const std::string target = absl::StrCat(
            "re:.*", absl::StrReplaceAll(model::LinearName(h.linear), {{".", "\\."}}), "$");
        transforms[absl::StrCat("hadamard_", model::LinearName(h.linear))] = {
            {"type", "hadamard"},
            {"apply",
             {{{"targets", {target}}, {"location", "input"}, {"inverse", false},
               {"ignore", nlohmann::json::array()}},
              {{"targets", {target}}, {"location", "weight_input"}, {"inverse", true},
               {"ignore", nlohmann::json::array()}}}},
            {"randomize", false},
            {"requires_grad", false},
            {"head_dim", h.block},
            {"precision", "torch.float32"}};
      }
      result.quantization_config = {
          {"quant_method", "compressed-tensors"},
          {"format", format},
          {"quantization_status", "compressed"},
          {"global_compression_ratio", nullptr},
          {"kv_cache_scheme", nullptr},
          {"ignore", {"lm_head"}},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights", weights},
              {"input_activations", inputs},
              {"output_activations", nullptr},
              {"format", format}}}}}};
      if (!transforms.empty()) {
        result.quantization_config["transform_config"] = {{"config_groups", transforms}};
      }
      out.raw["quantization_config"] = result.quantization_config;
    } else {
      out.raw["torch_dtype"] = "float32";
    }
    QCAL_RETURN_IF_ERROR(CopyTokenizerFiles(o_.in_dir, dir));
    QCAL_RETURN_IF_ERROR(
        WriteFileAtomic(dir + "/config.json", LlamaConfigToJson(out).dump(2) + "\n"));
    return result;
  }

  ExportOptions o_;
  bool gptq_ = false;
  bool ct_ = false;           // compressed-tensors, pack-quantized
  bool ct_actorder_ = false;  // its weights carry weight_g_idx ("actorder": "group")
  std::optional<ActivationQuantSpec> act_;  // compressed-tensors: the linears' input quantizer
  LlamaConfig config_;
  DType dtype_ = DType::kF32;
  std::unique_ptr<methods::Method> method_;
  std::unique_ptr<CheckpointReader> ckpt_;
  std::unique_ptr<BlockCache> cache_;
  std::vector<Planned> plan_;
  std::optional<GptqShape> grid_;
  std::vector<std::string> padded_;  // linears whose packed runs end in a partial word
  bool desc_act_seen_ = false;
};

}  // namespace

StatusOr<ExportResult> ExportCheckpoint(const ExportOptions& options) {
  Exporter exporter(options);
  return exporter.Run();
}

}  // namespace qcal::exporter
