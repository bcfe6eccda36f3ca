// The GPU backend seam (kernels/gpu_backend.h) end to end on the CPU, with a fake backend in the
// style of Ray's interface fakes: its DeviceHessian is the CPU accumulator behind the device
// interface and its BlockLdlqE8p the CPU BlockLdlq. A QuIP# E8P job with the fake installed must
// take the GPU path (every Hessian and every E8P rounding through the backend) and write the same
// bytes as the plain CPU job: the plumbing (device sums merged into the accumulators, rounding
// dispatch, results) adds nothing of its own. The same for GPTQ jobs through the backend's
// Gptq. Also --device selection and its errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/hf_config.h"
#include "methods/registry.h"
#include "kernels/device_select.h"
#include "kernels/e8p.h"
#include "kernels/gpu_backend.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/calib/hessian.h"
#include "runner/quantize_job.h"
#include "engine/model/llama.h"

namespace qcal {
namespace {

std::atomic<int> g_hessian_adds{0};
std::atomic<int> g_roundings{0};
std::atomic<int> g_gptq{0};
std::atomic<int> g_new_hessians{0};

class FakeHessian final : public kernels::DeviceHessian {
 public:
  explicit FakeHessian(int64_t n) : n_(n), acc_(n) {}
  Status Add(const float* x, int64_t seqs, int64_t t) override {
    ++g_hessian_adds;
    at::Tensor v = at::from_blob(const_cast<float*>(x), {seqs, t, n_}, at::kFloat);
    return acc_.Add(v);
  }
  int64_t count() const override { return acc_.count(); }
  StatusOr<std::vector<kernels::Fixed128>> Finish(int64_t* count) override {
    *count = acc_.count();
    return acc_.ReleasePacked();
  }

 private:
  int64_t n_;
  calib::HessianAccumulator acc_;
};

class FakeBackend : public kernels::GpuBackend {
 public:
  std::string description() const override { return "fake:0"; }
  StatusOr<std::unique_ptr<kernels::DeviceHessian>> NewHessian(int64_t n) override {
    ++g_new_hessians;
    return std::unique_ptr<kernels::DeviceHessian>(std::make_unique<FakeHessian>(n));
  }
  StatusOr<kernels::VectorRoundingResult> BlockLdlqE8p(
      const double* w, int64_t m, int64_t n, const double* h,
      const kernels::VectorRoundingConfig& config) override {
    ++g_roundings;
    static const kernels::E8pCodebook cb;
    return kernels::BlockLdlq(w, m, n, h, cb, config);
  }
  StatusOr<kernels::ScalarRoundingResult> Gptq(
      const double* w, int64_t m, int64_t n, const double* h,
      const kernels::ScalarRoundingConfig& config) override {
    ++g_gptq;
    return kernels::Gptq(w, m, n, h, config);
  }
  // A device whose memory use peaks at peak_ bytes (the CUDA backend samples cudaMemGetInfo).
  int64_t TakePeakDeviceBytes() override { return peak_; }
  void set_peak(int64_t bytes) { peak_ = bytes; }

 private:
  int64_t peak_ = -1;
};

std::atomic<int> g_new_blocks{0};
std::vector<kernels::BlockForwardPrecision> g_precisions;  // NewBlock's, in order
std::atomic<int> g_block_forwards{0};

// The CPU forward behind the device-block interface: a DecoderBlock over copies of the uploaded
// weights whose q, o, gate and down linears hand their inputs to the Forward call's Hessians.
// It checks that the RoPE tables it is given are the model's for positions 0..t-1.
class TapLinear final : public model::Linear {
 public:
  TapLinear(at::Tensor w, kernels::DeviceHessian* const* slot, Status* status)
      : dense_(std::move(w)), slot_(slot), status_(status) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    if (slot_ != nullptr && *slot_ != nullptr && status_->ok()) {
      const at::Tensor c = x.contiguous();
      *status_ = (*slot_)->Add(c.data_ptr<float>(), c.size(0), c.size(1));
    }
    return dense_.Forward(x);
  }
  int64_t in_features() const override { return dense_.in_features(); }
  int64_t out_features() const override { return dense_.out_features(); }
  at::Tensor DenseWeight() const override { return dense_.DenseWeight(); }

 private:
  model::DenseLinear dense_;
  kernels::DeviceHessian* const* slot_;
  Status* status_;
};

class FakeDeviceBlock final : public kernels::DeviceBlock {
 public:
  FakeDeviceBlock(const LlamaConfig& config, const kernels::BlockForwardShape& shape,
                  const kernels::BlockForwardWeights& w)
      : rope_(config), hidden_(shape.hidden) {
    model::BlockWeights bw;
    bw.input_norm = at::from_blob(const_cast<float*>(w.input_norm), {shape.hidden}).clone();
    bw.post_norm = at::from_blob(const_cast<float*>(w.post_norm), {shape.hidden}).clone();
    const int64_t hd = shape.heads * shape.head_dim, kvd = shape.kv_heads * shape.head_dim;
    const int64_t outs[7] = {hd, kvd, kvd, shape.hidden, shape.intermediate, shape.intermediate,
                             shape.hidden};
    const int64_t ins[7] = {shape.hidden, shape.hidden, shape.hidden, hd,
                            shape.hidden, shape.hidden, shape.intermediate};
    const int tap_of[7] = {0, -1, -1, 1, 2, -1, 3};  // HessianKind of the recording linears
    for (int k = 0; k < 7; ++k) {
      at::Tensor t = at::from_blob(const_cast<float*>(w.linears[k]), {outs[k], ins[k]}).clone();
      bw.linears[k] = std::make_unique<TapLinear>(
          std::move(t), tap_of[k] >= 0 ? &taps_[tap_of[k]] : nullptr, &status_);
    }
    block_ = std::make_unique<model::DecoderBlock>(config, std::move(bw));
  }
  Status Forward(const float* x, int64_t seqs, int64_t t, const float* cos, const float* sin,
                 kernels::DeviceHessian* const hessians[4], float* out) override {
    ++g_block_forwards;
    const at::Tensor c = rope_.cos_table().narrow(0, 0, t).contiguous();
    const at::Tensor s = rope_.sin_table().narrow(0, 0, t).contiguous();
    if (std::memcmp(c.data_ptr<float>(), cos, c.numel() * 4) != 0 ||
        std::memcmp(s.data_ptr<float>(), sin, s.numel() * 4) != 0) {
      return absl::InternalError("the RoPE tables passed are not the model's");
    }
    for (int k = 0; k < 4; ++k) taps_[k] = hessians[k];
    status_ = absl::OkStatus();
    at::Tensor in = at::from_blob(const_cast<float*>(x), {seqs, t, hidden_});
    at::Tensor y = block_->Forward(in, rope_).contiguous();
    std::memcpy(out, y.data_ptr<float>(), y.numel() * 4);
    return status_;
  }

 private:
  model::Rope rope_;
  int64_t hidden_;
  std::unique_ptr<model::DecoderBlock> block_;
  kernels::DeviceHessian* taps_[4] = {};
  Status status_;
};

class FakeBlockBackend final : public FakeBackend {
 public:
  explicit FakeBlockBackend(LlamaConfig config) : config_(std::move(config)) {}
  StatusOr<std::unique_ptr<kernels::DeviceBlock>> NewBlock(
      const kernels::BlockForwardShape& shape, const kernels::BlockForwardWeights& w,
      kernels::BlockForwardPrecision precision) override {
    ++g_new_blocks;
    g_precisions.push_back(precision);
    return std::unique_ptr<kernels::DeviceBlock>(
        std::make_unique<FakeDeviceBlock>(config_, shape, w));
  }

 private:
  LlamaConfig config_;
};

std::string ReadAll(const std::string& path) {
  auto s = ReadFile(path);
  return s.ok() ? *s : std::string("<unreadable>");
}

// Runs `yaml` on stories260K on the CPU and through the fake backend; every output file must
// be byte-identical. Returns false (with failures recorded) otherwise.
void ExpectSameBytesThroughTheBackend(const std::string& yaml, const std::string& tag,
                                      bool block_forward = false) {
  model::SetComputeThreads(1);
  const std::string root = testing::MakeTempDir("gpu_backend_" + tag);
  auto recipe = ParseRecipe(yaml, tag + ".yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  auto run = [&](const std::string& name) {
    v1::JobSpec o;
    o.set_model_dir(testing::RealModelDir("stories260K"));
    o.set_out_dir(root + "/" + name);
    o.set_job_dir(root + "/" + name + ".job");
    o.set_data_root(testing::SharedDir());
    o.set_threads_per_worker(1);
    auto r = job::RunQuantizeJob(*recipe, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return o.out_dir();
  };
  const std::string cpu = run("cpu");
  std::unique_ptr<kernels::GpuBackend> backend = std::make_unique<FakeBackend>();
  if (block_forward) {
    auto config = LoadLlamaConfig(testing::RealModelDir("stories260K") + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    backend = std::make_unique<FakeBlockBackend>(*config);
  }
  ASSERT_EQ(kernels::SetActiveGpuBackend(std::move(backend)), nullptr);
  const std::string gpu = run("gpu");
  kernels::SetActiveGpuBackend(nullptr);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(cpu)) {
    const std::string name = e.path().filename().string();
    if (name == "qcal_job.json") continue;  // timings
    ++files;
    EXPECT_EQ(ReadAll(cpu + "/" + name), ReadAll(gpu + "/" + name)) << tag << ": " << name;
  }
  EXPECT_GT(files, 2);
}

constexpr char kCalib[] =
    "calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 16, seq_len: 128}\n";

TEST(GpuBackendTest, QuipJobThroughTheBackendWritesTheCpuJobsBytes) {
  g_hessian_adds = 0;
  g_roundings = 0;
  g_new_hessians = 0;
  ExpectSameBytesThroughTheBackend(
      std::string("name: quip-e8p-fake\nmethod: quip\nbits: 2\ncodebook: e8p\n") + kCalib,
      "quip");
  // 5 layers × 4 Hessian kinds, 7 linears each rounded with E8P. The 16 sequences are 2 chunks
  // of 8 per block: one device accumulator per kind and block, kept across the chunks.
  EXPECT_EQ(g_hessian_adds.load(), 5 * 4 * 2);
  EXPECT_EQ(g_new_hessians.load(), 5 * 4);
  EXPECT_EQ(g_roundings.load(), 5 * 7);
}

TEST(GpuBackendTest, BlockForwardOnTheDeviceWritesTheCpuJobsBytes) {
  g_hessian_adds = 0;
  g_new_hessians = 0;
  g_new_blocks = 0;
  g_precisions.clear();
  g_block_forwards = 0;
  g_roundings = 0;
  ExpectSameBytesThroughTheBackend(
      std::string("name: quip-e8p-fake-block\nmethod: quip\nbits: 2\ncodebook: e8p\n") + kCalib,
      "quip_block", /*block_forward=*/true);
  // Each of the 5 blocks is uploaded once and runs its 2 chunks of 8 sequences on the device,
  // its 4 linear inputs going to the device Hessians there.
  EXPECT_EQ(g_new_blocks.load(), 5);
  EXPECT_EQ(g_precisions, std::vector<kernels::BlockForwardPrecision>(
                              5, kernels::BlockForwardPrecision::kFloat32));  // the default
  EXPECT_EQ(g_block_forwards.load(), 5 * 2);
  EXPECT_EQ(g_hessian_adds.load(), 5 * 4 * 2);
  EXPECT_EQ(g_new_hessians.load(), 5 * 4);
  EXPECT_EQ(g_roundings.load(), 5 * 7);
}

// calibration.precision is the recipe's, not the process's: bf16 reaches the device block
// forward of every block, and a rank without a GPU refuses it (naming the key) rather than
// computing something the checkpoint would not say.
TEST(GpuBackendTest, TheRecipeChoosesTheDeviceForwardsPrecision) {
  model::SetComputeThreads(1);
  const std::string root = testing::MakeTempDir("gpu_backend_precision");
  auto recipe = ParseRecipe(
      std::string("name: quip-bf16\nmethod: quip\nbits: 2\ncodebook: e8p\n"
                  "calibration: {files: [data/wikitext2/wiki.valid.tokens], num_sequences: 16, "
                  "seq_len: 128, precision: bf16}\n"),
      "quip-bf16.yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  EXPECT_EQ(recipe->ToJson()["calibration"]["precision"], "bf16");
  v1::JobSpec o;
  o.set_model_dir(testing::RealModelDir("stories260K"));
  o.set_data_root(testing::SharedDir());
  o.set_threads_per_worker(1);
  o.set_recipe_path("quip-bf16.yaml");
  o.set_out_dir(root + "/cpu");
  auto refused = job::RunQuantizeJob(*recipe, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("quip-bf16.yaml: calibration.precision bf16"),
            std::string::npos)
      << refused.status();

  auto config = LoadLlamaConfig(testing::RealModelDir("stories260K") + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(kernels::SetActiveGpuBackend(std::make_unique<FakeBlockBackend>(*config)), nullptr);
  g_precisions.clear();
  o.set_out_dir(root + "/gpu");
  auto done = job::RunQuantizeJob(*recipe, o);
  kernels::SetActiveGpuBackend(nullptr);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(g_precisions, std::vector<kernels::BlockForwardPrecision>(
                              5, kernels::BlockForwardPrecision::kBf16));
  auto written = LoadLlamaConfig(o.out_dir() + "/config.json");
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->raw["quantization_config"]["recipe"]["calibration"]["precision"], "bf16");
}

TEST(GpuBackendTest, GptqJobsThroughTheBackendWriteTheCpuJobsBytes) {
  g_gptq = 0;
  // Per channel with act order and clip search (gptq-4bit's grid), and groups of 32 (the
  // per-group parameters are set by the sweep).
  ExpectSameBytesThroughTheBackend(
      std::string("name: gptq-fake\nmethod: gptq\nbits: 4\n"
                  "scalar: {group_size: -1, act_order: true, clip_search: true}\n") + kCalib,
      "gptq_channel");
  ExpectSameBytesThroughTheBackend(
      std::string("name: gptq-fake-g32\nmethod: gptq\nbits: 3\n"
                  "scalar: {group_size: 32, symmetric: false}\n") + kCalib,
      "gptq_group");
  EXPECT_EQ(g_gptq.load(), 2 * 5 * 7);
}

// Every phase of a job on a GPU rank carries the device's peak memory beside the host's (the
// backend's mark, through common/phase_trace.h's probe), and `qcal quantize --json` its largest;
// a CPU job's are unknown (-1).
TEST(GpuBackendTest, PhasesCarryTheDevicesPeakMemory) {
  model::SetComputeThreads(1);
  const std::string root = testing::MakeTempDir("gpu_backend_peaks");
  auto recipe = ParseRecipe(
      std::string("name: gptq-peaks\nmethod: gptq\nbits: 4\n") + kCalib, "gptq-peaks.yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  v1::JobSpec o;
  o.set_model_dir(testing::RealModelDir("stories260K"));
  o.set_data_root(testing::SharedDir());
  o.set_threads_per_worker(1);
  constexpr int64_t kPeak = int64_t{3} << 30;
  auto backend = std::make_unique<FakeBackend>();
  backend->set_peak(kPeak);
  ASSERT_EQ(kernels::SetActiveGpuBackend(std::move(backend)), nullptr);
  o.set_out_dir(root + "/gpu");
  auto gpu = job::RunQuantizeJob(*recipe, o);
  kernels::SetActiveGpuBackend(nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(gpu->peak_device_bytes, kPeak);
  // The job's phases after the job opened its rank's device ("plan" and "open" run before).
  int with_peak = 0;
  for (const v1::PhaseTiming& p : gpu->phases) with_peak += p.peak_device_bytes() == kPeak;
  EXPECT_GE(with_peak, 3) << "calibrate, quantize, finalize";
  ASSERT_EQ(gpu->blocks.size(), 5u);
  for (const job::BlockSummary& b : gpu->blocks) {
    for (const v1::PhaseTiming& p : b.phases) {
      if (p.name().find('/') != std::string::npos) continue;  // parts carry no peaks
      EXPECT_EQ(p.peak_device_bytes(), kPeak) << "block " << b.layer << ": " << p.name();
    }
  }
  o.set_out_dir(root + "/cpu");
  auto cpu = job::RunQuantizeJob(*recipe, o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->peak_device_bytes, -1);
  for (const v1::PhaseTiming& p : cpu->phases) EXPECT_EQ(p.peak_device_bytes(), -1) << p.name();
}

TEST(DeviceSelectTest, ChoicesAndErrors) {
  auto cpu = kernels::SelectComputeDevice("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(*cpu, "cpu");
  EXPECT_EQ(kernels::ActiveGpuBackend(), nullptr);
  auto bad = kernels::SelectComputeDevice("gpu");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("auto, cpu, cuda, cuda:N"), std::string::npos);
  EXPECT_EQ(kernels::SelectComputeDevice("cuda:x").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto autod = kernels::SelectComputeDevice("auto");
  ASSERT_TRUE(autod.ok()) << autod.status();
  if (autod->rfind("cpu", 0) == 0) {
    // No usable GPU here: auto falls back and says why; cuda is a clear error.
    EXPECT_NE(autod->find("auto:"), std::string::npos) << *autod;
    EXPECT_EQ(kernels::ActiveGpuBackend(), nullptr);
    auto cuda = kernels::SelectComputeDevice("cuda");
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable) << cuda.status();
  } else {
    EXPECT_EQ(autod->rfind("cuda:", 0), 0u) << *autod;
    EXPECT_NE(kernels::ActiveGpuBackend(), nullptr);
  }
  kernels::SetActiveGpuBackend(nullptr);
  ::setenv("SLURM_LOCALID", "3", 1);
  EXPECT_EQ(kernels::LocalRankFromEnvironment(), 3);
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  EXPECT_EQ(kernels::LocalRankFromEnvironment(), 1);  // Open MPI's first
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  ::unsetenv("SLURM_LOCALID");
}

}  // namespace
}  // namespace qcal
