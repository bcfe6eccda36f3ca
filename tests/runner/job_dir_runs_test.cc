// A job directory never mixes models or runs (issue 36), on the real stories260K:
//  * its cached products and finished blocks are keyed by the content of the inputs: another
//    model in the same job directory, or the model's weights changed in place, recompute and give
//    the bytes of a clean run of that model;
//  * one driver per job directory: a second is refused, naming the first;
//  * a full disk (a real tmpfs filled mid-job) during calibration, while saving activations and
//    while writing a shard keeps everything finished, says how much is free and what to do, and
//    a rerun after space is freed gives the bytes of an uninterrupted run;
//  * damaged inputs are named: NaN weights (file and tensor), an implausible or wrong
//    num_hidden_layers, a calibration seq_len beyond the model's context.
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/io_util.h"
#include "common/checkpoint_layout.h"
#include "runner/job_dir.h"
#include "runner/job_plan.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "methods/registry.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "runner/quantize_job.h"

namespace qcal {
namespace {

namespace fs = std::filesystem;

constexpr char kCalib[] =
    "calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 16, seq_len: 128}\n";

Recipe MustParse(const std::string& yaml) {
  StatusOr<Recipe> r = ParseRecipe(yaml, "test.yaml");
  EXPECT_TRUE(r.ok()) << r.status() << "\n" << yaml;
  return r.ok() ? *r : Recipe();
}

// QuIP# 2-bit E8P as jobs/quip-e8p-2bit.yaml, on 16 sequences.
Recipe Quip2() {
  return MustParse(absl::StrCat("name: quip2\nmethod: quip\nbits: 2\ncodebook: e8p\n", kCalib));
}

// The same with within-block fine-tuning (float activations saved at every block boundary).
Recipe Quip2Ft() {
  return MustParse(absl::StrCat(
      "name: quip2ft\nmethod: quip\nbits: 2\ncodebook: e8p\n", kCalib,
      "finetune: {enabled: true, block: {epochs: 1, lr: 5.0e-5, batch: 8, holdout: 0.25},\n"
      "           end_to_end: {enabled: false}}\n"));
}

// Every file of a checkpoint directory (not its .staging), by name.
std::map<std::string, std::string> Files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    auto bytes = ReadFile(e.path().string());
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    out[e.path().filename().string()] = bytes.ok() ? *bytes : "";
  }
  return out;
}

void ExpectSameFiles(const std::string& got, const std::string& want) {
  const auto a = Files(got), b = Files(want);
  ASSERT_EQ(a.size(), b.size()) << got << " vs " << want;
  for (const auto& [name, bytes] : b) {
    auto it = a.find(name);
    ASSERT_NE(it, a.end()) << name << " missing from " << got;
    EXPECT_TRUE(it->second == bytes) << name << " differs between " << got << " and " << want;
  }
}

// A copy of `src` (an HF model directory) whose model.safetensors has `edit` applied to each
// tensor's float32 values (every other file copied as is).
std::string CopyModel(const std::string& src, const std::string& dst,
                      const std::function<void(const std::string&, std::vector<float>*)>& edit) {
  EXPECT_TRUE(MakeDirs(dst).ok());
  for (const auto& e : fs::directory_iterator(src)) {
    if (e.path().filename() == "model.safetensors") continue;
    fs::copy_file(e.path(), dst + "/" + e.path().filename().string(),
                  fs::copy_options::overwrite_existing);
  }
  auto ckpt = CheckpointReader::Open(src);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  SafetensorsWriter w;
  std::vector<std::vector<float>> keep;
  keep.reserve((*ckpt)->TensorNames().size());
  for (const std::string& name : (*ckpt)->TensorNames()) {
    auto found = (*ckpt)->Find(name);
    EXPECT_TRUE(found.ok());
    auto values = (*ckpt)->ReadF32(name);
    EXPECT_TRUE(values.ok()) << values.status();
    keep.push_back(std::move(*values));
    edit(name, &keep.back());
    EXPECT_TRUE(w.AddF32(name, found->second->shape, keep.back().data()).ok());
  }
  EXPECT_TRUE(w.Write(dst + "/model.safetensors").ok());
  return dst;
}

// M2 of the issue: stories260K with layer 0's q, k, v and o projections scaled by 1.5.
void ScaleLayer0Attention(const std::string& name, std::vector<float>* v) {
  for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    if (name == absl::StrCat("model.layers.0.self_attn.", p, ".weight")) {
      for (float& x : *v) x *= 1.5f;
    }
  }
}

class JobDirTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
    // Canonical, as the job makes the paths it writes under (common/safe_fs.h) and names them.
    root_ = new std::string(std::filesystem::canonical(testing::MakeTempDir("jobdir")).string());
    m_ = new std::string(testing::RealModelDir("stories260K"));
    m2_ = new std::string(CopyModel(*m_, *root_ + "/m2", ScaleLayer0Attention));
  }
  static void TearDownTestSuite() {
    delete root_;
    delete m_;
    delete m2_;
  }

  v1::JobSpec Options(const std::string& model, const std::string& out,
                                  const std::string& job) {
    v1::JobSpec o;
    o.set_model_dir(model);
    o.set_out_dir(out);
    o.set_job_dir(job);
    o.set_data_root(testing::SharedDir());
    o.set_threads_per_worker(1);
    return o;
  }

  static std::string* root_;
  static std::string* m_;
  static std::string* m2_;
};

std::string* JobDirTest::root_ = nullptr;
std::string* JobDirTest::m_ = nullptr;
std::string* JobDirTest::m2_ = nullptr;

// The sequence: M into A, then M2 into B with the same job directory. B must be a clean
// run of M2, not M's Hessians applied to M2.
TEST_F(JobDirTest, AnotherModelInTheSameJobDirectoryRecomputes) {
  const std::string r = *root_ + "/two";
  const Recipe recipe = Quip2();
  auto a = job::RunQuantizeJob(recipe, Options(*m_, r + "/A", r + "/J"));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = job::RunQuantizeJob(recipe, Options(*m2_, r + "/B", r + "/J"));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->hessians_from_cache) << "M's Hessians must not be reused for M2";
  EXPECT_EQ(b->blocks_resumed, 0);
  auto clean = job::RunQuantizeJob(recipe, Options(*m2_, r + "/C", r + "/K"));
  ASSERT_TRUE(clean.ok()) << clean.status();
  ExpectSameFiles(r + "/B", r + "/C");
  // Blocks 1-4 have M's weights but M2's inputs: their shards differ from M's.
  const std::string shard2 = ShardName(2, 5);
  EXPECT_NE(*ReadFile(r + "/A/" + shard2), *ReadFile(r + "/B/" + shard2));
  // The plan's disk estimate is what the Hessians take (headers aside).
  int64_t hessian_bytes = 0;
  for (const auto& e : fs::directory_iterator(r + "/J/hessians")) {
    if (e.path().extension() == ".safetensors") hessian_bytes += fs::file_size(e.path());
  }
  auto config = LoadLlamaConfig(*m_);
  ASSERT_TRUE(config.ok());
  const DiskNeed need = EstimateDiskNeed(recipe, *config);
  EXPECT_NEAR(static_cast<double>(need.job_bytes), static_cast<double>(hessian_bytes),
              0.01 * static_cast<double>(hessian_bytes));
  // Back to M in J: its inputs again, recomputed (J's Hessians are M2's now), M's bytes.
  auto a2 = job::RunQuantizeJob(recipe, Options(*m_, r + "/A2", r + "/J"));
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_FALSE(a2->hessians_from_cache);
  ExpectSameFiles(r + "/A2", r + "/A");
}

// model.safetensors rewritten in place (same size, same inode) under a finished job: a rerun
// with the same --out resumes nothing and writes a clean run's bytes of the new weights.
TEST_F(JobDirTest, WeightsChangedInPlaceAreNotResumed) {
  const std::string r = *root_ + "/inplace";
  const Recipe recipe = Quip2();
  const std::string m3 = CopyModel(*m_, r + "/m3", [](const std::string&, std::vector<float>*) {});
  auto first = job::RunQuantizeJob(recipe, Options(m3, r + "/D", r + "/L"));
  ASSERT_TRUE(first.ok()) << first.status();
  auto new_weights = ReadFile(*m2_ + "/model.safetensors");
  ASSERT_TRUE(new_weights.ok());
  ASSERT_EQ(fs::file_size(m3 + "/model.safetensors"), new_weights->size());
  {
    std::fstream f(m3 + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.write(new_weights->data(), static_cast<std::streamsize>(new_weights->size()));
  }
  auto second = job::RunQuantizeJob(recipe, Options(m3, r + "/D", r + "/L"));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->blocks_resumed, 0);
  EXPECT_FALSE(second->hessians_from_cache);
  auto clean = job::RunQuantizeJob(recipe, Options(*m2_, r + "/E", r + "/N"));
  ASSERT_TRUE(clean.ok()) << clean.status();
  ExpectSameFiles(r + "/D", r + "/E");
  // Unchanged inputs still resume everything.
  auto third = job::RunQuantizeJob(recipe, Options(m3, r + "/D", r + "/L"));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->blocks_resumed, 5);
}

// Two drivers on one job directory (different outputs): the second is refused naming the
// first, and touches nothing; once the first is gone the job runs.
TEST_F(JobDirTest, SecondDriverOnAJobDirectoryIsRefused) {
  const std::string r = *root_ + "/locked";
  const Recipe recipe = MustParse(absl::StrCat("name: rtn4\nmethod: rtn\nbits: 4\n", kCalib));
  auto held = JobDirLock::Acquire(r + "/J", "qcal quantize --out " + r + "/first");
  ASSERT_TRUE(held.ok()) << held.status();
  auto refused = job::RunQuantizeJob(recipe, Options(*m_, r + "/second", r + "/J"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find(r + "/J: the job directory is in use by qcal "
                                                "quantize --out " + r + "/first (pid "),
            std::string::npos)
      << refused.status();
  EXPECT_TRUE(fs::exists(r + "/J"));
  EXPECT_FALSE(fs::exists(r + "/J/journal.jsonl")) << "the refused run wrote nothing";
  *held = JobDirLock();
  auto ok = job::RunQuantizeJob(recipe, Options(*m_, r + "/second", r + "/J"));
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// A tmpfs of our own, so that a test can fill it (root only; skipped visibly elsewhere).
class Tmpfs {
 public:
  explicit Tmpfs(const std::string& dir, const std::string& size = "64m") : dir_(dir) {
    EXPECT_TRUE(MakeDirs(dir).ok());
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0) {
      mounted_ = true;
    } else {
      why_ = absl::StrCat("cannot mount a tmpfs at ", dir, ": ", std::strerror(errno),
                          " (needs root and CAP_SYS_ADMIN)");
    }
  }
  ~Tmpfs() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }
  // Takes every free page (the job's next write fails with ENOSPC).
  void Fill() {
    const int fd = ::open((dir_ + "/filler").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ASSERT_GE(fd, 0);
    const std::string chunk(1 << 20, '\0');
    for (size_t size : {size_t{1} << 20, size_t{4096}}) {
      while (::write(fd, chunk.data(), size) == static_cast<ssize_t>(size)) {
      }
    }
    ::close(fd);
    filled_ = true;
  }
  void Free() {
    ASSERT_EQ(::unlink((dir_ + "/filler").c_str()), 0);
    filled_ = false;
  }
  bool filled() const { return filled_; }

 private:
  std::string dir_, why_;
  bool mounted_ = false, filled_ = false;
};

struct DiskFullCase {
  const char* name;
  bool finetune;
  const char* phase;  // the event after which the disk fills
  int64_t done;
  const char* failing_path;  // a piece of the path the failing write names
  std::vector<std::string> kept;  // files (under the tmpfs) that must survive the failure
};

void PrintTo(const DiskFullCase& c, std::ostream* os) { *os << c.name; }

class DiskFullTest : public JobDirTest, public ::testing::WithParamInterface<DiskFullCase> {};

TEST_P(DiskFullTest, KeepsFinishedWorkAndResumesByteIdentical) {
  const DiskFullCase& c = GetParam();
  const std::string r = *root_ + "/full-" + c.name;
  Tmpfs disk(r + "/disk");
  if (!disk.mounted()) GTEST_SKIP() << disk.why();
  const Recipe recipe = c.finetune ? Quip2Ft() : Quip2();
  const std::string out = r + "/disk/out", job_dir = r + "/disk/out.job";
  auto fill_at = [&](const job::JobEvent& e) {
    if (!disk.filled() && e.phase == c.phase && e.done == c.done) disk.Fill();
  };
  auto failed = job::RunQuantizeJob(recipe, Options(*m_, out, job_dir), fill_at);
  ASSERT_TRUE(disk.filled()) << "the job never reached " << c.phase << " " << c.done;
  ASSERT_FALSE(failed.ok());
  const std::string message(failed.status().message());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition) << message;
  EXPECT_TRUE(io::IsOutOfSpace(failed.status())) << message;
  EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
  EXPECT_NE(message.find(" MiB free of 64.0 MiB on the filesystem of "), std::string::npos)
      << message;
  EXPECT_NE(message.find(c.failing_path), std::string::npos) << message;
  for (const std::string& f : c.kept) {
    EXPECT_TRUE(fs::exists(r + "/disk/" + f)) << f << " was lost with the failure: " << message;
  }

  disk.Free();
  auto resumed = job::RunQuantizeJob(recipe, Options(*m_, out, job_dir));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  auto clean = job::RunQuantizeJob(recipe, Options(*m_, r + "/clean", r + "/clean.job"));
  ASSERT_TRUE(clean.ok()) << clean.status();
  ExpectSameFiles(out, r + "/clean");
  if (std::string(c.phase) == "quantize") {
    EXPECT_EQ(resumed->blocks_resumed, c.done);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Phases, DiskFullTest,
    ::testing::Values(
        DiskFullCase{"calibration", false, "calibrate", 2, "/hessians/block_2.safetensors",
                     {"out.job/hessians/block_0.safetensors",
                      "out.job/hessians/block_1.safetensors", "out.job/journal.jsonl"}},
        DiskFullCase{"activations", true, "calibrate", 1, "/activations/block_1.safetensors",
                     {"out.job/activations/block_0.safetensors",
                      "out.job/hessians/block_0.safetensors", "out.job/journal.jsonl"}},
        DiskFullCase{"shard", false, "quantize", 1, "/.staging/model-00002-of-00005.safetensors",
                     {"out/model-00001-of-00005.safetensors",
                      "out.job/hessians/block_4.safetensors", "out.job/journal.jsonl"}}),
    [](const ::testing::TestParamInfo<DiskFullCase>& info) { return info.param.name; });

// A job that cannot fit is told so when it is planned, with the sizes (it still runs: finished
// work is kept when the disk fills).
TEST_F(JobDirTest, PlanSaysWhenTheJobWillNotFit) {
  const std::string r = *root_ + "/small";
  Tmpfs disk(r + "/disk", "1m");
  if (!disk.mounted()) GTEST_SKIP() << disk.why();
  auto plan = PlanJob(Quip2(), *m_, r + "/disk/out", r + "/disk/out.job", testing::SharedDir());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->notes.size(), 1u);
  EXPECT_NE(plan->notes[0].find(r + "/disk/out.job: this job writes about 1."),
            std::string::npos)
      << plan->notes[0];
  EXPECT_NE(plan->notes[0].find("(Hessians 330.0 KiB a block, and the quantized checkpoint in " +
                                r + "/disk/out) but "),
            std::string::npos)
      << plan->notes[0];
  auto roomy = PlanJob(Quip2(), *m_, r + "/out", r + "/out.job", testing::SharedDir());
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  EXPECT_TRUE(roomy->notes.empty());
}

// NaN weights are named by file and tensor, before any Hessian is made of them.
TEST_F(JobDirTest, NonFiniteWeightsNameTheFileAndTensor) {
  const std::string r = *root_ + "/nan";
  const std::string bad = CopyModel(*m_, r + "/model", [](const std::string& name,
                                                          std::vector<float>* v) {
    if (name == "model.layers.1.mlp.gate_proj.weight") (*v)[17] = std::nanf("");
  });
  auto result = job::RunQuantizeJob(Quip2(), Options(bad, r + "/out", r + "/out.job"));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find(
                bad + "/model.safetensors: tensor 'model.layers.1.mlp.gate_proj.weight' has 1 "
                      "non-finite value(s) of "),
            std::string::npos)
      << result.status();
  EXPECT_NE(result.status().message().find("element 17, is NaN"), std::string::npos)
      << result.status();
}

// num_hidden_layers far beyond any model, or beyond the checkpoint's tensors, is named as such.
TEST_F(JobDirTest, WrongLayerCountsAreNamed) {
  const std::string r = *root_ + "/layers";
  const std::string dir = CopyModel(*m_, r + "/model", [](const std::string&, std::vector<float>*) {});
  auto config = nlohmann::json::parse(*ReadFile(dir + "/config.json"));
  const Recipe recipe = Quip2();
  config["num_hidden_layers"] = 1000000000;
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", config.dump()).ok());
  auto huge = job::RunQuantizeJob(recipe, Options(dir, r + "/out", r + "/out.job"));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("config.json: num_hidden_layers 1000000000 is "
                                         "implausible"),
            std::string::npos)
      << huge.status();
  config["num_hidden_layers"] = 7;
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", config.dump()).ok());
  auto seven = job::RunQuantizeJob(recipe, Options(dir, r + "/out", r + "/out.job"));
  ASSERT_FALSE(seven.ok());
  EXPECT_NE(seven.status().message().find(
                dir + "/config.json: num_hidden_layers is 7 but the checkpoint has no tensors "
                      "of layer 5 (it holds 5 block(s), layers 0 to 4)"),
            std::string::npos)
      << seven.status();
  EXPECT_FALSE(fs::exists(r + "/out")) << "refused before anything was created";
}

// A calibration seq_len beyond the model's context is capped, and the cap is said.
TEST(CalibrationSeqLenTest, CapIsSaid) {
  LlamaConfig config;
  config.max_position_embeddings = 256;
  Recipe recipe = MustParse(absl::StrCat("name: x\nmethod: quip\nbits: 2\ncodebook: e8p\n",
                                         "calibration: {files: [a.txt], seq_len: 4096}\n"));
  std::string note;
  EXPECT_EQ(job::CalibrationSeqLen(recipe, config, &note), 256);
  EXPECT_EQ(note, "calibration.seq_len 4096 is longer than the model's context "
                  "(max_position_embeddings 256): calibrating on sequences of 256 tokens");
  recipe.calibration.seq_len = 128;
  note.clear();
  EXPECT_EQ(job::CalibrationSeqLen(recipe, config, &note), 128);
  EXPECT_TRUE(note.empty());
}

}  // namespace
}  // namespace qcal
