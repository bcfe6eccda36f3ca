// Real-layout checkpoints (issue 12): a bf16, sharded, untied-head variant of stories260K flows
// through the streamed worker without float32 copies of its tables where none is needed:
//  * logits from the head as stored (converted in row chunks per call) equal those of the
//    float32 copy of the same table, up to float32 rounding;
//  * a job whose method leaves the non-block weights alone writes the embedding and the head
//    into its output exactly as the source stores them (bf16 bytes), and so does its GPTQ
//    export;
//  * a method that transforms them (QuaRot's R1 and norm fusion) streams them in row chunks,
//    and the chunks equal the whole table transformed at once.
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/dtype.h"
#include "common/hf_config.h"
#include "common/safetensors.h"
#include "methods/registry.h"
#include "methods/method_factory.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "export/export.h"
#include "runner/quantize_job.h"
#include "engine/model/model_source.h"

namespace qcal {
namespace {

using testing::MakeTempDir;
using testing::RealModelDir;
using testing::SharedDir;

// 100 rows of 64 per chunk: stories260K's 512-row tables in 6 chunks, the last one short.
class ChunkedTables : public ::testing::Environment {
 public:
  void SetUp() override { model::SetTableChunkElements(100 * 64); }
};
const auto* const kChunked = ::testing::AddGlobalTestEnvironment(new ChunkedTables);

constexpr char kEmbed[] = "model.embed_tokens.weight";
constexpr char kHead[] = "lm_head.weight";

// stories260K in bf16, in two shards (the tables in the first), with an untied head that differs
// from the embedding (row i is 1.25 × embedding row (7i mod vocab)).
std::string MakeBf16UntiedModel() {
  static std::string* dir = nullptr;
  if (dir != nullptr) return *dir;
  const std::string src = RealModelDir("stories260K");
  const std::string out = MakeTempDir("bf16-untied");
  auto ckpt = CheckpointReader::Open(src);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  auto config = LoadLlamaConfig(src);
  EXPECT_TRUE(config.ok()) << config.status();
  const int64_t vocab = config->vocab_size, hidden = config->hidden_size;

  auto bf16 = [](const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 2);
    ConvertFromF32(DType::kBF16, v.data(), v.size(), b.data());
    return b;
  };
  SafetensorsWriter tables, blocks;
  std::map<std::string, std::string> weight_map;
  auto embed = (*ckpt)->ReadF32(kEmbed);
  EXPECT_TRUE(embed.ok());
  std::vector<float> head(embed->size());
  for (int64_t i = 0; i < vocab; ++i) {
    const int64_t from = (7 * i) % vocab;
    for (int64_t j = 0; j < hidden; ++j) head[i * hidden + j] = 1.25f * (*embed)[from * hidden + j];
  }
  const std::vector<uint8_t> e = bf16(*embed), h = bf16(head);
  EXPECT_TRUE(tables.Add(kEmbed, DType::kBF16, {vocab, hidden}, e.data(), e.size()).ok());
  EXPECT_TRUE(tables.Add(kHead, DType::kBF16, {vocab, hidden}, h.data(), h.size()).ok());
  weight_map[kEmbed] = weight_map[kHead] = "model-00001-of-00002.safetensors";
  for (const std::string& name : (*ckpt)->TensorNames()) {
    if (name == kEmbed) continue;
    auto found = (*ckpt)->Find(name);
    auto v = (*ckpt)->ReadF32(name);
    EXPECT_TRUE(found.ok() && v.ok()) << name;
    const std::vector<uint8_t> b = bf16(*v);
    EXPECT_TRUE(blocks.Add(name, DType::kBF16, found->second->shape, b.data(), b.size()).ok());
    weight_map[name] = "model-00002-of-00002.safetensors";
  }
  EXPECT_TRUE(tables.Write(out + "/model-00001-of-00002.safetensors").ok());
  EXPECT_TRUE(blocks.Write(out + "/model-00002-of-00002.safetensors").ok());
  EXPECT_TRUE(
      WriteCheckpointIndex(out, weight_map, tables.data_bytes() + blocks.data_bytes()).ok());
  nlohmann::json cfg = nlohmann::json::parse(*ReadFile(src + "/config.json"));
  cfg["tie_word_embeddings"] = false;
  cfg["torch_dtype"] = "bfloat16";
  EXPECT_TRUE(WriteFileAtomic(out + "/config.json", cfg.dump(2)).ok());
  for (const char* f : {"tokenizer.model", "tokenizer_config.json"}) {
    auto bytes = ReadFile(src + "/" + f);
    EXPECT_TRUE(bytes.ok()) << f;
    EXPECT_TRUE(WriteFileAtomic(out + "/" + f, *bytes).ok());
  }
  dir = new std::string(out);
  return out;
}

// The stored bytes of tensor `name` in checkpoint `dir`, with its dtype.
std::pair<DType, std::string> StoredBytes(const std::string& dir, const std::string& name) {
  auto ckpt = CheckpointReader::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  auto found = (*ckpt)->Find(name);
  EXPECT_TRUE(found.ok()) << found.status();
  const uint8_t* p = found->first->Data(*found->second);
  return {found->second->dtype,
          std::string(reinterpret_cast<const char*>(p), found->second->nbytes())};
}

Recipe MakeRecipe(const std::string& yaml) {
  auto r = ParseRecipe(yaml, "stored_tables_test.yaml");
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

v1::JobSpec Options(const std::string& model, const std::string& out) {
  v1::JobSpec o;
  o.set_model_dir(model);
  o.set_out_dir(out);
  o.set_data_root(SharedDir());
  o.set_threads_per_worker(1);
  return o;
}

TEST(StoredTablesTest, Bf16HeadGivesTheLogitsOfItsFloat32Copy) {
  model::SetComputeThreads(2);
  const std::string dir = MakeBf16UntiedModel();
  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_FALSE((*source)->HeadTied());
  ASSERT_EQ(model::TableChunkRows((*source)->config().hidden_size), 100);
  // More hidden rows than one LinearRows chunk, and a 3-D batch.
  at::Tensor hidden = at::randn({3, 200, (*source)->config().hidden_size},
                                at::TensorOptions().dtype(at::kFloat));
  auto logits = (*source)->Logits(hidden);
  ASSERT_TRUE(logits.ok()) << logits.status();
  auto model = model::LlamaModel::Load(dir);  // the whole float32 model, head included
  ASSERT_TRUE(model.ok()) << model.status();
  const at::Tensor expected = (*model)->Head(hidden);
  ASSERT_EQ(logits->sizes(), expected.sizes());
  EXPECT_GT(expected.abs().max().item<double>(), 0.0);
  // Not bit for bit: BLAS may block a GEMM differently when its output has fewer columns, and
  // the sums then round differently; within float32 rounding of the dot products.
  EXPECT_LT(testing::RelMaxDiff(expected, *logits), 1e-6);
  // HeadRows reads the same rows the head multiplies with.
  auto rows = (*source)->HeadRows(100, 5);
  ASSERT_TRUE(rows.ok());
  EXPECT_TRUE(at::equal(*rows, (*model)->head().DenseWeight().narrow(0, 100, 5)));
  const Status past_end = (*source)->HeadRows(510, 5).status();
  EXPECT_EQ(past_end.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(past_end.message().find("head rows [510, 515) outside its 512 rows"),
            std::string::npos)
      << past_end;
}

TEST(StoredTablesTest, UntransformedTablesAreCopiedAsStored) {
  const std::string dir = MakeBf16UntiedModel();
  const std::string out = MakeTempDir("bf16-rtn") + "/out";
  const Recipe recipe = MakeRecipe(
      "name: rtn4\nmethod: rtn\nbits: 4\nscalar: {clip_search: true}\n"
      "calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 4, seq_len: 64}\n");
  auto result = job::RunQuantizeJob(recipe, Options(dir, out));
  ASSERT_TRUE(result.ok()) << result.status();
  for (const char* name : {kEmbed, kHead}) {
    const auto [dtype, bytes] = StoredBytes(out, name);
    const auto [src_dtype, src_bytes] = StoredBytes(dir, name);
    EXPECT_EQ(dtype, DType::kBF16) << name;
    EXPECT_TRUE(bytes == src_bytes) << name;
  }
  // Its GPTQ export keeps the model's dtype (bf16) for the tables, byte for byte, and stores the
  // norms in it.
  exporter::ExportOptions ex;
  ex.format = "gptq";
  ex.in_dir = out;
  ex.out_dir = MakeTempDir("bf16-rtn-gptq") + "/gptq";
  auto exported = exporter::ExportCheckpoint(ex);
  ASSERT_TRUE(exported.ok()) << exported.status();
  for (const char* name : {kEmbed, kHead}) {
    const auto [dtype, bytes] = StoredBytes(ex.out_dir, name);
    EXPECT_EQ(dtype, DType::kBF16) << name;
    EXPECT_TRUE(bytes == StoredBytes(dir, name).second) << name;
  }
  EXPECT_EQ(StoredBytes(ex.out_dir, "model.layers.0.input_layernorm.weight").first, DType::kBF16);
  EXPECT_EQ(StoredBytes(ex.out_dir, "model.layers.1.mlp.down_proj.scales").first, DType::kF16);
  EXPECT_EQ(exported->quantization_config.value("bits", 0), 4);
  // The output evaluates through the same stored-dtype head.
  auto quantized = methods::OpenModel(out);
  ASSERT_TRUE(quantized.ok()) << quantized.status();
  at::Tensor h = at::randn({1, 8, (*quantized)->config().hidden_size});
  auto logits = (*quantized)->Logits(h);
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_TRUE(at::isfinite(*logits).all().item<bool>());
}

TEST(StoredTablesTest, TransformedTablesStreamedInChunksEqualTheWholeTableTransformed) {
  const std::string dir = MakeBf16UntiedModel();
  const std::string out = MakeTempDir("bf16-quarot") + "/out";
  const Recipe recipe = MakeRecipe(
      "name: quarot-w4\nmethod: quarot\nweights: rtn\nbits: 4\nscalar: {clip_search: true}\n"
      "rotation: {r1: true, r2: true, r3: false, r4: false}\n"
      "calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 4, seq_len: 64}\n");
  auto result = job::RunQuantizeJob(recipe, Options(dir, out));
  ASSERT_TRUE(result.ok()) << result.status();

  auto source = model::OpenFloatCheckpoint(dir);
  ASSERT_TRUE(source.ok());
  auto config = LoadLlamaConfig(dir);
  auto method = methods::MakeMethod(recipe, *config);
  ASSERT_TRUE(method.ok()) << method.status();
  auto nb = (*source)->LoadNonBlock();
  ASSERT_TRUE(nb.ok()) << nb.status();
  auto embed = (*method)->transform().PrepareEmbeddingRows(nb->embed);
  auto head = (*method)->transform().PrepareHeadRows(nb->head, nb->final_norm);
  ASSERT_TRUE(embed.ok() && head.ok());
  EXPECT_FALSE(at::equal(*embed, nb->embed));  // R1 changed them
  auto ckpt = CheckpointReader::Open(out);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  for (const auto& [name, expected] :
       {std::pair<std::string, at::Tensor>{kEmbed, *embed}, {kHead, *head}}) {
    const auto [dtype, bytes] = StoredBytes(out, name);
    EXPECT_EQ(dtype, DType::kF32) << name;
    ASSERT_EQ(bytes.size(), static_cast<size_t>(expected.numel()) * 4) << name;
    EXPECT_EQ(std::memcmp(bytes.data(), expected.contiguous().data_ptr<float>(), bytes.size()), 0)
        << name;
  }
  auto norm = model::LoadTensorF32(**ckpt, "model.norm.weight", {nb->final_norm.numel()});
  ASSERT_TRUE(norm.ok());
  EXPECT_TRUE(at::equal(*norm, at::ones_like(*norm)));  // fused into the head
}

}  // namespace
}  // namespace qcal
