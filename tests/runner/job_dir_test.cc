// runner/job_dir.h, journal.h, job_plan.h: the torch-free job directory code shared by the
// single-process job and the coordinator (paths, journal, plan/resume, block_done checks,
// finalize) on a tiny synthetic checkpoint.
#include "common/checkpoint_layout.h"
#include "runner/job_dir.h"
#include "runner/journal.h"
#include "runner/job_plan.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/safetensors.h"
#include <sys/stat.h>
#include "runner/input_fingerprint.h"
#include "common/io_util.h"
#include "methods/registry.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

Recipe MustParse(const std::string& yaml) {
  StatusOr<Recipe> r = ParseRecipe(yaml, "tiny.yaml");
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : Recipe();
}

Recipe TinyRecipe(const std::string& method = "rtn", int bits = 4) {
  return MustParse("name: tiny\nmethod: " + method + "\nbits: " + std::to_string(bits) +
                   "\ncalibration: {files: [x.txt]}\n");
}

// A float "model": config.json (2 blocks, hidden 8, ff 16) + model.safetensors with the
// non-block tensors (blocks are not needed by the layout code).
std::string MakeFloatModel(const std::string& root) {
  const std::string dir = root + "/float";
  EXPECT_TRUE(MakeDirs(dir).ok());
  const nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                                 {"model_type", "llama"},
                                 {"hidden_size", 8},
                                 {"intermediate_size", 16},
                                 {"num_hidden_layers", 2},
                                 {"num_attention_heads", 2},
                                 {"vocab_size", 4},
                                 {"max_position_embeddings", 32}};
  EXPECT_TRUE(WriteFileAtomic(dir + "/config.json", config.dump()).ok());
  SafetensorsWriter w;
  std::vector<float> embed(4 * 8), norm(8, 1.0f);
  for (size_t i = 0; i < embed.size(); ++i) embed[i] = 0.25f * static_cast<float>(i);
  EXPECT_TRUE(w.AddF32("model.embed_tokens.weight", {4, 8}, embed.data()).ok());
  EXPECT_TRUE(w.AddF32("model.norm.weight", {8}, norm.data()).ok());
  EXPECT_TRUE(w.Write(dir + "/model.safetensors").ok());
  EXPECT_TRUE(WriteFileAtomic(dir + "/tokenizer_config.json", "{}").ok());
  return dir;
}

// A stand-in block shard and its block_done entry (code_bits per linear given).
nlohmann::json WriteBlock(const std::string& out, int64_t layer, float value, double code_bits) {
  const std::string name = ShardName(layer + 1, 2);
  SafetensorsWriter w;
  std::vector<float> norm(8, value);
  EXPECT_TRUE(w.AddF32("model.layers." + std::to_string(layer) + ".input_layernorm.weight", {8},
                       norm.data())
                  .ok());
  EXPECT_TRUE(w.Write(out + "/" + name).ok());
  auto bytes = ReadFile(out + "/" + name);
  EXPECT_TRUE(bytes.ok());
  nlohmann::json metrics = nlohmann::json::array();
  for (const char* lin : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
    metrics.push_back({{"name", lin}, {"code_bits", code_bits}, {"stored_bits", code_bits + 1}});
  }
  return {{"event", "block_done"},
          {"layer", layer},
          {"shard", name},
          {"bytes", bytes->size()},
          {"checksum", Fnv1aHex(*bytes)},
          {"metrics", metrics}};
}

TEST(JobLayoutTest, ShardNames) {
  EXPECT_EQ(ShardName(0, 5), "model-00000-of-00005.safetensors");
  EXPECT_EQ(ShardName(3, 12), "model-00003-of-00012.safetensors");
}

TEST(JobLayoutTest, JournalAppendsReopensAndToleratesOnlyATornLastLine) {
  const std::string dir = testing::MakeTempDir("journal");
  const std::string path = dir + "/journal.jsonl";
  {
    auto j = Journal::Open(path);  // absent: empty
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_TRUE(j->entries().empty());
    ASSERT_TRUE(j->Append({{"event", "job_start"}}).ok());
    ASSERT_TRUE(j->Append({{"event", "block_done"}, {"layer", 0}}).ok());
    EXPECT_EQ(j->entries().size(), 2u);
  }
  {
    std::ofstream f(path, std::ios::app);
    f << "{\"event\": \"block_d";  // torn last line
  }
  auto j = Journal::Open(path);
  ASSERT_TRUE(j.ok()) << j.status();
  ASSERT_EQ(j->entries().size(), 2u);
  EXPECT_EQ(j->entries()[1]["layer"], 0);
  {
    std::ofstream f(path, std::ios::app);
    f << "\n{\"event\": \"job_done\"}\n";  // garbage is now in the middle
  }
  auto bad = Journal::Open(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("line 3"), std::string::npos) << bad.status();
}

// Issue 18 (found by journal_fuzz): a journal line that parses but holds a known key of another
// type (an object as "event", a string as "layer", ...) is DataLoss naming the file and line,
// not an uncaught exception in a reader.
TEST(JobLayoutTest, JournalEntriesOfTheWrongShapeAreDataLoss) {
  const std::string dir = testing::MakeTempDir("journal-shape");
  const std::string path = dir + "/journal.jsonl";
  for (const char* line :
       {R"({"event":{"event":"job_start"}})", R"({"layer":0})",
        R"({"event":"block_done","layer":"0"})", R"({"event":"block_done","shard":7})",
        R"({"event":"block_done","bytes":-1})", R"({"event":"e2e_done","checksums":{"a":1}})",
        R"({"event":"block_done","metrics":[{"code_bits":null}]})",
        R"({"event":"block_done","also_wrote":[]})"}) {
    ASSERT_TRUE(WriteFileAtomic(path, std::string("{\"event\":\"job_start\"}\n") + line +
                                          "\n{\"event\":\"job_done\"}\n")
                    .ok());
    auto j = Journal::Open(path);
    ASSERT_FALSE(j.ok()) << line;
    EXPECT_EQ(j.status().code(), absl::StatusCode::kDataLoss) << line;
    EXPECT_NE(j.status().message().find(path + ": line 2 is not a journal entry"),
              std::string::npos)
        << j.status();
  }
}

TEST(JobLayoutTest, PlanResumesIntactBlocksAndRefusesAnotherRecipe) {
  const std::string root = testing::MakeTempDir("plan");
  const std::string model = MakeFloatModel(root);
  const std::string out = root + "/out";
  const Recipe recipe = TinyRecipe();

  auto plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->job_dir, out + ".job");
  EXPECT_EQ(plan->num_blocks, 2);
  EXPECT_EQ(plan->pending_blocks(), (std::vector<int64_t>{0, 1}));
  EXPECT_FALSE(plan->has_calibrate_task(recipe));  // rtn without fine-tuning
  EXPECT_TRUE(plan->has_calibrate_task(TinyRecipe("gptq")));

  auto journal = Journal::Open(plan->job_dir + "/journal.jsonl");
  ASSERT_TRUE(journal.ok());
  ASSERT_TRUE(journal->Append(JobStartEntry(recipe, *plan, model, out)).ok());
  const nlohmann::json b0 = WriteBlock(out, 0, 1.0f, 4.0);
  const nlohmann::json b1 = WriteBlock(out, 1, 2.0f, 4.0);
  ASSERT_TRUE(CheckBlockDoneEntry(b0, out, 2).ok());
  ASSERT_TRUE(journal->Append(b0).ok());
  ASSERT_TRUE(journal->Append(b1).ok());

  plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->all_blocks_finished());
  EXPECT_EQ(plan->block_done.size(), 2u);

  // Block 1's shard changes behind the journal's back: it is pending again.
  WriteBlock(out, 1, 3.0f, 4.0);
  plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->pending_blocks(), (std::vector<int64_t>{1}));
  auto mismatch = CheckBlockDoneEntry(b1, out, 2);
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kDataLoss) << mismatch;
  EXPECT_NE(mismatch.message().find(ShardName(2, 2)), std::string::npos) << mismatch;
  nlohmann::json wrong = b0;
  wrong["layer"] = 5;
  EXPECT_EQ(CheckBlockDoneEntry(wrong, out, 2).code(), absl::StatusCode::kInvalidArgument);

  auto refused = PlanJob(TinyRecipe("rtn", 3), model, out, "", "");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("journal.jsonl belongs to another recipe"),
            std::string::npos)
      << refused.status();

  auto inside = PlanJob(recipe, model, model + "/q", "", "");
  ASSERT_FALSE(inside.ok());
  EXPECT_NE(inside.status().message().find("inside the input model directory"), std::string::npos);
}

TEST(JobLayoutTest, AggregateBitsWeightsLinearsBySize) {
  LlamaConfig c;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  const std::string out = testing::MakeTempDir("bits");
  nlohmann::json e = WriteBlock(out, 0, 1.0f, 2.0);
  e["metrics"][6]["code_bits"] = 4.0;  // down_proj: 16 x 8 of 64+32+32+64+128+128+128 = 576
  const BitsPerWeight bits = AggregateBits(c, {{0, e}});
  EXPECT_DOUBLE_EQ(bits.code_bits, (2.0 * (576 - 128) + 4.0 * 128) / 576);
  EXPECT_DOUBLE_EQ(bits.stored_bits, 3.0);
}

TEST(JobLayoutTest, FinalizeJobWritesTheCheckpointAndRefusesMissingBlocks) {
  const std::string root = testing::MakeTempDir("finalize");
  const std::string model = MakeFloatModel(root);
  const std::string out = root + "/out";
  const Recipe recipe = TinyRecipe();
  auto plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto journal = Journal::Open(plan->job_dir + "/journal.jsonl");
  ASSERT_TRUE(journal.ok());
  ASSERT_TRUE(journal->Append(JobStartEntry(recipe, *plan, model, out)).ok());
  ASSERT_TRUE(journal->Append(WriteBlock(out, 0, 1.0f, 4.0)).ok());

  auto early = FinalizeJob(recipe, model, out, &*journal);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("block 1"), std::string::npos) << early.status();

  ASSERT_TRUE(journal->Append(WriteBlock(out, 1, 2.0f, 4.0)).ok());
  auto summary = FinalizeJob(recipe, model, out, &*journal);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_DOUBLE_EQ((*summary)["code_bits"].get<double>(), 4.0);
  EXPECT_EQ(journal->entries().back()["event"], "job_done");
  auto config = LoadLlamaConfig(out);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(config->raw.contains("quantization_config"));
  EXPECT_EQ(config->raw["quantization_config"]["method"], "rtn");
  EXPECT_DOUBLE_EQ(config->raw["quantization_config"]["bits_per_weight"]["stored"].get<double>(),
                   5.0);
  auto ckpt = CheckpointReader::Open(out);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->Has("model.embed_tokens.weight"));
  EXPECT_TRUE((*ckpt)->Has("model.layers.1.input_layernorm.weight"));
  EXPECT_TRUE((*ckpt)->Validate().ok());
  EXPECT_TRUE(ReadFile(out + "/tokenizer_config.json").ok());

  // Issue 18: the index records every shard's checksum; a shard changed after the job finished
  // (a stale writer, a bad copy) is refused by every reader, naming the file.
  auto index = ReadFile(out + "/model.safetensors.index.json");
  ASSERT_TRUE(index.ok());
  const auto sums = nlohmann::json::parse(*index)["metadata"]["qcal_fnv1a64"];
  ASSERT_EQ(sums.size(), 3u) << *index;
  const std::string shard1 = out + "/" + ShardName(2, 2);
  EXPECT_EQ(sums[ShardName(2, 2)], *FileChecksum(shard1));
  auto bytes = ReadFile(shard1);
  ASSERT_TRUE(bytes.ok());
  (*bytes)[bytes->size() - 1] ^= 1;
  ASSERT_TRUE(WriteFileAtomic(shard1, *bytes).ok());
  auto reread = CheckpointReader::Open(out);
  ASSERT_TRUE(reread.ok()) << reread.status();
  EXPECT_TRUE((*reread)->Has("model.layers.0.input_layernorm.weight"));
  EXPECT_TRUE((*reread)->Find("model.embed_tokens.weight").ok());  // shard 0 is intact
  auto damaged = (*reread)->Find("model.layers.1.input_layernorm.weight");
  ASSERT_FALSE(damaged.ok());
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(damaged.status().message().find(shard1 + ": checksum"), std::string::npos)
      << damaged.status();
}

// Fencing: a task attempt's files live under .staging until the job's single writer commits
// them; nothing is written once the staging directory is gone.
TEST(JobLayoutTest, StagedFilesEnterTheOutputOnlyWhenCommitted) {
  const std::string root = testing::MakeTempDir("staging");
  const std::string model = MakeFloatModel(root);
  const std::string out = root + "/out";
  const Recipe recipe = TinyRecipe();
  ASSERT_TRUE(PlanJob(recipe, model, out, "", "").ok());
  SafetensorsWriter w;
  std::vector<float> norm(8, 1.5f);
  ASSERT_TRUE(w.AddF32("model.layers.0.input_layernorm.weight", {8}, norm.data()).ok());
  const std::string name = ShardName(1, 2);
  auto a1 = WriteStagedFile(out, name, "block-0.a1", w);
  auto a2 = WriteStagedFile(out, name, "block-0.a2", w);
  ASSERT_TRUE(a1.ok() && a2.ok()) << a1.status() << a2.status();
  EXPECT_EQ(a1->staged(), name + ".block-0.a1");
  EXPECT_NE(a1->staged(), a2->staged());
  // The checksum computed while writing is the file's.
  auto bytes = ReadFile(StagingDir(out) + "/" + a1->staged());
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(a1->checksum(), Fnv1aHex(*bytes));
  EXPECT_EQ(a1->bytes(), bytes->size());
  struct stat st;
  EXPECT_NE(::stat((out + "/" + name).c_str(), &st), 0) << "not in the output before a commit";

  // A result claiming another size is refused; the accepted attempt is renamed into place.
  v1::BlockResult result;
  result.set_layer(0);
  *result.mutable_shard() = *a2;
  result.mutable_shard()->set_bytes(a2->bytes() + 1);
  EXPECT_EQ(CheckBlockResult(result, out, 2).code(), absl::StatusCode::kDataLoss);
  *result.mutable_shard() = *a2;
  result.set_layer(1);
  EXPECT_EQ(CheckBlockResult(result, out, 2).code(), absl::StatusCode::kInvalidArgument);
  result.set_layer(0);
  ASSERT_TRUE(CheckBlockResult(result, out, 2).ok());
  ASSERT_TRUE(CommitFiles(out, FilesOf(result)).ok());
  EXPECT_EQ(::stat((out + "/" + name).c_str(), &st), 0);
  // The journal entry reads back as the same result.
  const nlohmann::json entry = BlockDoneEntry(result);
  EXPECT_TRUE(CheckBlockDoneEntry(entry, out, 2).ok());
  const v1::BlockResult back = BlockResultFromEntry(entry);
  EXPECT_EQ(back.shard().checksum(), a2->checksum());
  EXPECT_EQ(back.layer(), 0);

  // The job ended: the staging directory is gone, and a stale attempt cannot write.
  ASSERT_TRUE(RemoveStaging(out).ok());
  auto stale = WriteStagedFile(out, name, "block-0.a3", w);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(::stat(StagingDir(out).c_str(), &st), 0);
}

}  // namespace
}  // namespace qcal

namespace qcal {
namespace {

// ContentHash fed in any pieces equals the one-shot hash; it sees every byte and the length.
TEST(InputFingerprintTest, ContentHashIsPieceInvariantAndSensitive) {
  std::string data(100003, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 131 + 7) % 251);
  ContentHash whole;
  whole.Update(data.data(), data.size());
  for (size_t piece : {1, 7, 31, 32, 33, 4096}) {
    ContentHash parts;
    for (size_t at = 0; at < data.size(); at += piece) {
      parts.Update(data.data() + at, std::min(piece, data.size() - at));
    }
    EXPECT_EQ(parts.Finish(), whole.Finish()) << "piece " << piece;
  }
  for (size_t at : {size_t{0}, size_t{31}, size_t{50000}, data.size() - 1}) {
    std::string changed = data;
    changed[at] ^= 1;
    ContentHash h;
    h.Update(changed.data(), changed.size());
    EXPECT_NE(h.Finish(), whole.Finish()) << "byte " << at;
  }
  ContentHash shorter;
  shorter.Update(data.data(), data.size() - 1);
  EXPECT_NE(shorter.Finish(), whole.Finish());
  ContentHash zeros1, zeros2;
  zeros1.Update(std::string(64, '\0').data(), 64);
  zeros2.Update(std::string(65, '\0').data(), 65);
  EXPECT_NE(zeros1.Finish(), zeros2.Finish());
}

// The inputs key follows the content of the model's files, not their names or sizes: an edit
// in place that keeps the size (and even the modification time) changes it, and the journal's
// finished blocks of the old inputs are not resumed.
TEST(InputFingerprintTest, KeyFollowsContentAndTheJournalOnlyResumesSameInputs) {
  const std::string root = testing::MakeTempDir("fingerprint");
  const std::string model = MakeFloatModel(root);
  const std::string out = root + "/out";
  const Recipe recipe = TinyRecipe();
  auto plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->inputs.files.count("model/config.json"), 1u);
  EXPECT_EQ(plan->inputs.files.count("model/model.safetensors"), 1u);
  EXPECT_EQ(plan->inputs.files.count("model/tokenizer_config.json"), 1u);
  EXPECT_TRUE(ReadFile(plan->job_dir + "/inputs.json").ok()) << "the hashes are cached";
  const std::string key = plan->inputs.key;
  {
    auto journal = Journal::Open(plan->job_dir + "/journal.jsonl");
    ASSERT_TRUE(journal.ok());
    ASSERT_TRUE(journal->Append(JobStartEntry(recipe, *plan, model, out)).ok());
    ASSERT_TRUE(journal->Append(WriteBlock(out, 0, 1.0f, 4.0)).ok());
    ASSERT_TRUE(journal->Append(WriteBlock(out, 1, 2.0f, 4.0)).ok());
  }
  plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->inputs.key, key);
  EXPECT_TRUE(plan->all_blocks_finished());
  EXPECT_TRUE(plan->notes.empty());

  // Same size, same modification time, other bytes: the change time gives it away.
  const std::string weights = model + "/model.safetensors";
  struct stat before;
  ASSERT_EQ(::stat(weights.c_str(), &before), 0);
  auto bytes = ReadFile(weights);
  ASSERT_TRUE(bytes.ok());
  (*bytes)[bytes->size() - 2] ^= 0x40;  // inside the last tensor's data
  {
    std::fstream f(weights, std::ios::in | std::ios::out | std::ios::binary);
    f.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  }
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, weights.c_str(), times, 0), 0);
  plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_NE(plan->inputs.key, key);
  EXPECT_EQ(plan->pending_blocks(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(plan->stale_blocks, 2);
  ASSERT_EQ(plan->notes.size(), 1u);
  EXPECT_NE(plan->notes[0].find("2 finished block(s) were computed from other inputs "
                                "(model/model.safetensors changed)"),
            std::string::npos)
      << plan->notes[0];

  // A job_start of the new inputs: blocks journaled after it count again.
  {
    auto journal = Journal::Open(plan->job_dir + "/journal.jsonl");
    ASSERT_TRUE(journal.ok());
    ASSERT_TRUE(journal->Append(JobStartEntry(recipe, *plan, model, out)).ok());
    ASSERT_TRUE(journal->Append(WriteBlock(out, 0, 5.0f, 4.0)).ok());
  }
  plan = PlanJob(recipe, model, out, "", "");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->pending_blocks(), (std::vector<int64_t>{1}));

  // Changing the bytes back restores the first key (content, not history).
  (*bytes)[bytes->size() - 2] ^= 0x40;
  ASSERT_TRUE(WriteFileAtomic(weights, *bytes).ok());
  auto again = FingerprintInputs(recipe, model, "", plan->job_dir + "/inputs.json");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->key, key);
  // A damaged hash cache is only a cache: it is rebuilt.
  ASSERT_TRUE(WriteFileAtomic(plan->job_dir + "/inputs.json", "{not json").ok());
  again = FingerprintInputs(recipe, model, "", plan->job_dir + "/inputs.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->key, key);
  // Another recipe's key differs even for the same files.
  auto other = FingerprintInputs(TinyRecipe("rtn", 3), model, "", "");
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->key, key);
}

// A job journaled by an earlier qcal resumes: calibration.precision fp32 (the default, what every
// recipe meant before the key existed) leaves the recipe hash as it was. The value is the
// recipe_hash that main 8ffa820 (before the key) journaled for jobs/quip-e8p-2bit.yaml.
TEST(InputFingerprintTest, RecipeHashOfAnFp32RecipeIsTheOneBeforeThePrecisionKey) {
  auto text = ReadFile(testing::SourceDir() + "/jobs/quip-e8p-2bit.yaml");
  ASSERT_TRUE(text.ok()) << text.status();
  auto fp32 = ParseRecipe(*text, "quip-e8p-2bit.yaml");
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_EQ(fp32->ToJson()["calibration"]["precision"], "fp32");
  EXPECT_EQ(RecipeHash(*fp32), "229b6bcb3f1b1376");
  Recipe bf16 = *fp32;
  bf16.calibration.precision = "bf16";
  EXPECT_NE(RecipeHash(bf16), RecipeHash(*fp32));
}

// One driver per job directory: the second is refused naming the first; the lock goes with its
// holder.
// The layout docs/formats.md documents: the default job directory beside the output, and the
// files in it.
TEST(JobPathsTest, NamesTheDocumentedLayout) {
  EXPECT_EQ(DefaultJobDir("/x/out"), "/x/out.job");
  EXPECT_EQ(JobDirFor("", "/x/out"), "/x/out.job");
  EXPECT_EQ(JobDirFor("/y/job", "/x/out"), "/y/job");
  const JobPaths p("/y/job");
  EXPECT_EQ(p.journal, "/y/job/journal.jsonl");
  EXPECT_EQ(p.lock, "/y/job/lock");
  EXPECT_EQ(p.inputs, "/y/job/inputs.json");
  EXPECT_EQ(p.hessians, "/y/job/hessians");
  EXPECT_EQ(p.activations, "/y/job/activations");
  EXPECT_EQ(p.spill, "/y/job/spill");
  EXPECT_EQ(p.report, "/y/job/report.html");
  EXPECT_EQ(p.workers_log, "/y/job/workers.log");
  EXPECT_EQ(p.PhaseProducts("rotations"), "/y/job/phases/rotations.safetensors");
  EXPECT_EQ(p.SequentialInputs(3), "/y/job/sequential/inputs-3.safetensors");
  EXPECT_EQ(p.SequentialFloatInputs(3), "/y/job/sequential/float-inputs-3.safetensors");
  EXPECT_EQ(StagingDir("/x/out"), "/x/out/.staging");
}

// `qcal report DIR` and `qcal export`: a job directory, or an output directory with its default
// job directory beside it; an unfinished job's output is named as such.
TEST(JobPathsTest, FindsTheJobOfADirectoryAndSaysWhenItIsUnfinished) {
  const std::string root = testing::MakeTempDir("findjob");
  const std::string out = root + "/out";
  EXPECT_FALSE(FindJob(out).ok());
  ASSERT_TRUE(CheckJobFinished(out).ok());  // not a job's output at all
  ASSERT_TRUE(MakeDirs(DefaultJobDir(out)).ok());
  ASSERT_TRUE(MakeDirs(out).ok());
  ASSERT_TRUE(WriteFileAtomic(JobPaths(DefaultJobDir(out)).journal, "{}\n").ok());
  auto from_out = FindJob(out);
  ASSERT_TRUE(from_out.ok()) << from_out.status();
  EXPECT_EQ(from_out->job_dir, DefaultJobDir(out));
  EXPECT_EQ(from_out->out_dir, out);
  auto from_job = FindJob(DefaultJobDir(out));
  ASSERT_TRUE(from_job.ok()) << from_job.status();
  EXPECT_EQ(from_job->job_dir, DefaultJobDir(out));
  EXPECT_EQ(from_job->out_dir, "");
  const Status unfinished = CheckJobFinished(out);
  EXPECT_EQ(unfinished.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(unfinished.message().find("has not finished"), absl::string_view::npos);
  ASSERT_TRUE(WriteFileAtomic(out + "/config.json", "{}").ok());
  EXPECT_TRUE(CheckJobFinished(out).ok());
}

TEST(JobDirLockTest, SecondDriverIsRefusedNamingTheHolder) {
  const std::string dir = testing::MakeTempDir("jobdirlock") + "/job";
  auto first = JobDirLock::Acquire(dir, "qcal quantize --out /somewhere");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = JobDirLock::Acquire(dir, "qcal-coordinator, job for /elsewhere");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(second.status().message());
  EXPECT_NE(message.find(dir + ": the job directory is in use by qcal quantize --out /somewhere "
                               "(pid " + std::to_string(::getpid()) + " on "),
            std::string::npos)
      << message;
  *first = JobDirLock();  // released
  auto third = JobDirLock::Acquire(dir, "qcal-coordinator, job for /elsewhere");
  EXPECT_TRUE(third.ok()) << third.status();
  auto holder = ReadFile(JobPaths(dir).lock);
  ASSERT_TRUE(holder.ok());
  EXPECT_EQ(holder->rfind("qcal-coordinator, job for /elsewhere (pid ", 0), 0u) << *holder;
}

TEST(JobDirLockTest, OnlyProductsCountAsFinishedWork) {
  const std::string root = testing::MakeTempDir("finished");
  const std::string job = root + "/job", out = root + "/out";
  ASSERT_TRUE(MakeDirs(job + "/hessians").ok());
  ASSERT_TRUE(MakeDirs(out + "/.staging").ok());
  ASSERT_TRUE(WriteFileAtomic(job + "/journal.jsonl", "{}\n").ok());
  ASSERT_TRUE(WriteFileAtomic(job + "/inputs.json", "{}").ok());
  ASSERT_TRUE(WriteFileAtomic(job + "/lock", "x").ok());
  ASSERT_TRUE(WriteFileAtomic(out + "/.staging/model-00001-of-00002.safetensors.a1", "x").ok());
  EXPECT_FALSE(HoldsFinishedWork(job, out));
  ASSERT_TRUE(WriteFileAtomic(job + "/hessians/block_0.safetensors", "x").ok());
  EXPECT_TRUE(HoldsFinishedWork(job, out));
  ASSERT_EQ(std::remove((job + "/hessians/block_0.safetensors").c_str()), 0);
  ASSERT_TRUE(WriteFileAtomic(out + "/model-00001-of-00002.safetensors", "x").ok());
  EXPECT_TRUE(HoldsFinishedWork(job, out));
}

// What a Llama-3-70B-shaped GPTQ job writes: 80 blocks of exact Hessian sums, 16 bytes per
// triangle entry of each of the four inputs (8192, 8192, 8192, 28672 features).
TEST(JobDirLockTest, DiskNeedAtA70BShape) {
  LlamaConfig c;
  c.hidden_size = 8192;
  c.intermediate_size = 28672;
  c.num_hidden_layers = 80;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.vocab_size = 128256;
  c.max_position_embeddings = 8192;
  c.torch_dtype = "bfloat16";
  const DiskNeed need = EstimateDiskNeed(TinyRecipe("gptq"), c);
  int64_t per_block = 0;
  for (int64_t n : {8192, 8192, 8192, 28672}) per_block += 16 * (n * (n + 1) / 2);
  EXPECT_EQ(need.job_bytes, 80 * per_block);
  EXPECT_EQ(need.job_bytes, int64_t{655016591360});
  EXPECT_EQ(need.job_detail, "Hessians 7.6 GiB a block");
  // 4-bit codes (+ scales) of 68.5e9 linear weights and two bf16 tables of 128256 x 8192.
  EXPECT_GT(need.out_bytes, int64_t{35} * 1000000000);
  EXPECT_LT(need.out_bytes, int64_t{45} * 1000000000);
  EXPECT_EQ(EstimateDiskNeed(TinyRecipe("rtn"), c).job_bytes, 0);
}

// A full disk says how much is free and what to do, in one message for every file.
TEST(JobDirLockTest, OutOfSpaceMessageNamesTheRoomAndTheRemedy) {
  const Status s = io::ErrnoError(ENOSPC, "/tmp/x.safetensors", "write failed");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(io::IsOutOfSpace(s));
  EXPECT_NE(s.message().find("MiB free of"), std::string::npos) << s;
  EXPECT_NE(s.message().find("on the filesystem of /tmp"), std::string::npos) << s;
  EXPECT_NE(s.message().find("finished blocks and calibration products are kept"),
            std::string::npos)
      << s;
  EXPECT_FALSE(io::IsOutOfSpace(io::ErrnoError(ENOENT, "/tmp/x", "open")));
}

}  // namespace
}  // namespace qcal
