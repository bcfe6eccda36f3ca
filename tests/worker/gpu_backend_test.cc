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
#include <filesystem>
#include <string>

#include "common/atomic_file.h"
#include "methods/registry.h"
#include "kernels/device_select.h"
#include "kernels/e8p.h"
#include "kernels/gpu_backend.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "worker/calib/hessian.h"
#include "worker/job/quantize_job.h"
#include "worker/model/llama.h"

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
  StatusOr<std::vector<kernels::Fixed128>> Finish(int64_t* count) override {
    *count = acc_.count();
    return acc_.ReleasePacked();
  }

 private:
  int64_t n_;
  calib::HessianAccumulator acc_;
};

class FakeBackend final : public kernels::GpuBackend {
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
};

std::string ReadAll(const std::string& path) {
  auto s = ReadFile(path);
  return s.ok() ? *s : std::string("<unreadable>");
}

// Runs `yaml` on stories260K on the CPU and through the fake backend; every output file must
// be byte-identical. Returns false (with failures recorded) otherwise.
void ExpectSameBytesThroughTheBackend(const std::string& yaml, const std::string& tag) {
  model::SetComputeThreads(1);
  const std::string root = testing::MakeTempDir("gpu_backend_" + tag);
  auto recipe = ParseRecipe(yaml, tag + ".yaml");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  auto run = [&](const std::string& name) {
    job::QuantizeJobOptions o;
    o.model_dir = testing::RealModelDir("stories260K");
    o.out_dir = root + "/" + name;
    o.job_dir = root + "/" + name + ".job";
    o.data_root = testing::SharedDir();
    o.threads = 1;
    auto r = job::RunQuantizeJob(*recipe, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return o.out_dir;
  };
  const std::string cpu = run("cpu");
  ASSERT_EQ(kernels::SetActiveGpuBackend(std::make_unique<FakeBackend>()), nullptr);
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
