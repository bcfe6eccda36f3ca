// Data-parallel calibration (calib::Calibrate) with thread-ranks on stories260K: the Hessians
// and activations of 2 and 3 ranks are bit-identical to a world of one (same files, same exact
// sums), and the Hessians agree with a plain fp64 sum of at::mm products to 1e-6 (max-norm
// relative; the two use different fp32 GEMMs).
#include "engine/calib/calibration.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <limits>
#include <thread>

#include "common/atomic_file.h"
#include "runner/job_dir.h"
#include "runner/job_steps.h"
#include "common/tokenizer.h"
#include "kernels/gpu_backend.h"
#include "tests/engine/calibration_ranks.h"
#include "tests/model_fixtures.h"
#include "tests/test_util.h"
#include "engine/model/model_source.h"
#include "engine/model/llama.h"
#include "engine/comm/comm.h"

namespace qcal {
namespace {

bool VerifyCacheChecksumOk(const std::string& path) {
  return calib::VerifyCacheChecksum(path).ok();
}

// Records each sequence's fp32 xᵀx summed in fp64 (the accumulation the fixed-point sums
// replaced), for the reference.
class ReferenceRecorder final : public model::Linear {
 public:
  ReferenceRecorder(std::unique_ptr<model::Linear> inner, at::Tensor* sum, int64_t* count)
      : inner_(std::move(inner)), sum_(sum), count_(count) {}
  at::Tensor Forward(const at::Tensor& x) const override {
    if (sum_) {
      at::Tensor seqs = x.reshape({-1, x.size(-2), x.size(-1)}).contiguous();
      for (int64_t s = 0; s < seqs.size(0); ++s) {
        sum_->add_(at::mm(seqs[s].t(), seqs[s]).to(at::kDouble));
        *count_ += seqs.size(1);
      }
    }
    return inner_->Forward(x);
  }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  at::Tensor DenseWeight() const override { return inner_->DenseWeight(); }

 private:
  std::unique_ptr<model::Linear> inner_;
  at::Tensor* sum_;
  int64_t* count_;
};

class CalibrationRanksTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model::SetComputeThreads(1);
    root_ = new std::string(testing::MakeTempDir("calib"));
    auto tok = LoadTokenizerFromModelDir(testing::RealModelDir("stories260K"));
    ASSERT_TRUE(tok.ok()) << tok.status();
    CalibrationSpec spec;
    spec.files = {"data/tinystories/TinyStories-valid.sample30k.txt"};
    spec.num_sequences = 22;  // 6 chunks of 4, the last one short
    spec.seq_len = 64;
    auto tokens =
        calib::SampleCalibrationTokens(**tok, spec, testing::SharedDir(), 64, (*tok)->bos_id());
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_ = new at::Tensor(*tokens);
  }
  static void TearDownTestSuite() {
    delete root_;
    delete tokens_;
  }

  // Runs Calibrate on `ranks` thread-ranks (each with its own model) into `job_dir`; returns
  // rank 0's result (every rank's Hessians are checked equal to rank 0's).
  static calib::CalibrationResult Run(
      int ranks, const std::string& job_dir,
      int64_t budget = std::numeric_limits<int64_t>::max(),
      const std::function<void(calib::CalibrationOptions&, comm::Comm&)>& tweak = nullptr) {
    auto results = testing::CalibrateOnThreadRanks(
        ranks, testing::RealModelDir("stories260K"), *tokens_, job_dir,
        [&](calib::CalibrationOptions& opt, comm::Comm& comm) {
          opt.batch = 4;
          opt.activations = true;
          opt.memory_budget_bytes = budget;
          if (tweak) tweak(opt, comm);
        });
    for (int r = 0; r < ranks; ++r) {
      EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    }
    EXPECT_EQ(testing::FirstRankDifference(results), "");
    return results[0].ok() ? std::move(*results[0]) : calib::CalibrationResult{};
  }

  static std::string* root_;
  static at::Tensor* tokens_;
};
std::string* CalibrationRanksTest::root_ = nullptr;
at::Tensor* CalibrationRanksTest::tokens_ = nullptr;

TEST_F(CalibrationRanksTest, RanksGiveTheWorldOfOneBitsAndMatchAnFp64Reference) {
  // World of one (SelfComm) first.
  auto model = model::LlamaModel::Load(testing::RealModelDir("stories260K"));
  ASSERT_TRUE(model.ok());
  auto source = model::OpenFloatCheckpoint(testing::RealModelDir("stories260K"));
  ASSERT_TRUE(source.ok());
  auto self = comm::MakeSelfComm();
  calib::CalibrationOptions opt;
  opt.batch = 4;
  opt.activations = true;
  const std::string dir1 = *root_ + "/job1";
  auto one =
      calib::Calibrate(*self, **source, *tokens_, job::CalibrationDirsOf(dir1), "key", opt);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(one->from_cache);
  const int64_t blocks = (*model)->num_blocks();
  ASSERT_EQ(static_cast<int64_t>(one->hessians.size()), blocks);
  EXPECT_EQ(one->tokens, 22 * 64);

  // 2 and 3 ranks holding their activations in memory, and 2 ranks spilling every chunk to
  // the job directory (a budget of one byte).
  for (auto [ranks, budget] : {std::pair<int, int64_t>{2, std::numeric_limits<int64_t>::max()},
                               {3, std::numeric_limits<int64_t>::max()},
                               {2, 1}}) {
    const std::string dir =
        *root_ + "/job" + std::to_string(ranks) + (budget == 1 ? "spilled" : "");
    calib::CalibrationResult many = Run(ranks, dir, budget);
    ASSERT_EQ(static_cast<int64_t>(many.hessians.size()), blocks) << ranks << " ranks";
    EXPECT_EQ(many.tokens, one->tokens);
    for (int64_t l = 0; l < blocks; ++l) {
      for (calib::HessianKind k : calib::kAllHessianKinds) {
        const auto& a = one->hessians[l].at(k);
        const auto& b = many.hessians[l].at(k);
        EXPECT_EQ(a.count(), b.count());
        EXPECT_TRUE(a.packed() == b.packed())
            << ranks << " ranks, block " << l << " " << calib::HessianKindName(k);
      }
      // The files rank 0 wrote are byte-identical too.
      auto h1 = ReadFile(calib::HessianPath(JobPaths(dir1).hessians, l));
      auto hn = ReadFile(calib::HessianPath(JobPaths(dir).hessians, l));
      ASSERT_TRUE(h1.ok() && hn.ok());
      EXPECT_TRUE(*h1 == *hn) << "hessians block " << l;
    }
    for (int64_t l = 0; l <= blocks; ++l) {
      auto a1 = ReadFile(calib::ActivationPath(JobPaths(dir1).activations, l));
      auto an = ReadFile(calib::ActivationPath(JobPaths(dir).activations, l));
      ASSERT_TRUE(a1.ok() && an.ok()) << an.status();
      EXPECT_TRUE(*a1 == *an) << ranks << " ranks: activations at boundary " << l;
    }
  }

  // Plain fp64 reference: the same chunks, each sequence's fp32 product summed in fp64.
  at::NoGradGuard no_grad;
  at::Tensor x = (*model)->Embed(*tokens_);
  double worst = 0;
  for (int64_t l = 0; l < blocks; ++l) {
    model::BlockWeights& w = (*model)->mutable_block(l).mutable_weights();
    at::Tensor sums[4];
    int64_t counts[4] = {0, 0, 0, 0};
    const model::LinearKind recorders[4] = {model::LinearKind::kQ, model::LinearKind::kO,
                                            model::LinearKind::kGate, model::LinearKind::kDown};
    for (int k = 0; k < 4; ++k) {
      auto& slot = w.linears[static_cast<int>(recorders[k])];
      sums[k] = at::zeros({slot->in_features(), slot->in_features()}, at::kDouble);
      slot = std::make_unique<ReferenceRecorder>(std::move(slot), &sums[k], &counts[k]);
    }
    std::vector<at::Tensor> outs;
    for (int64_t s = 0; s < x.size(0); s += 4) {
      outs.push_back((*model)->block(l).Forward(x.narrow(0, s, std::min<int64_t>(4, x.size(0) - s)),
                                                (*model)->rope()));
    }
    x = at::cat(outs, 0);
    for (int k = 0; k < 4; ++k) {
      const at::Tensor ref = (sums[k] + sums[k].t()) / (2.0 * counts[k]);
      const at::Tensor got = one->hessians[l].h[k].Mean();
      const double rel = (got - ref).abs().max().item<double>() / ref.abs().max().item<double>();
      worst = std::max(worst, rel);
      // The accumulator's fp32 products come from its own upper-triangle tile GEMMs, the
      // reference's from at::mm: two fp32 summation orders, about 1e-8 apart here.
      EXPECT_LT(rel, 1e-6) << "block " << l << " kind " << k;
      EXPECT_EQ(counts[k], one->hessians[l].h[k].count());
    }
  }
  std::printf("max-norm relative difference to the fp64 reference: %.3g\n", worst);

  // A second world-of-one run reuses everything from the cache.
  auto again =
      calib::Calibrate(*self, **source, *tokens_, job::CalibrationDirsOf(dir1), "key", opt);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->from_cache);
  EXPECT_TRUE(again->activations_from_cache);
  EXPECT_TRUE(again->hessians[1].h[2].packed() == one->hessians[1].h[2].packed());
}

// Sharded Hessians (each rank sums every rank's inputs into its band of rows and writes it in
// place): the same files, byte for byte, as the unsharded walk of one rank. With 16-row strips
// stories260K's inputs (64 and 172 wide) are cut into 4 and 11 strips, so 2 and 3 ranks own real
// bands; with the production strips (512 rows) rank 0 owns everything and the others none. 22
// sequences in chunks of 4: 6 chunks, so with 4 ranks two ranks step past their last chunk.
TEST_F(CalibrationRanksTest, ShardedHessiansWriteTheUnshardedFilesByteForByte) {
  const int64_t blocks = 5;  // stories260K
  for (int64_t strip : {int64_t{16}, calib::kHessianStripRows}) {
    const std::string dir1 = *root_ + "/unsharded-strip" + std::to_string(strip);
    calib::CalibrationResult one = Run(1, dir1, std::numeric_limits<int64_t>::max(),
                                       [&](calib::CalibrationOptions& o, comm::Comm&) {
                                         o.hessian_strip_rows = strip;
                                       });
    ASSERT_EQ(static_cast<int64_t>(one.hessians.size()), blocks);
    for (auto [ranks, budget] : {std::pair<int, int64_t>{2, std::numeric_limits<int64_t>::max()},
                                 {3, std::numeric_limits<int64_t>::max()},
                                 {4, 1}}) {
      const std::string dir = *root_ + "/sharded-strip" + std::to_string(strip) + "-" +
                              std::to_string(ranks);
      calib::CalibrationResult many =
          Run(ranks, dir, budget, [&](calib::CalibrationOptions& o, comm::Comm&) {
        o.hessian_strip_rows = strip;
        o.shard_hessians = true;
      });
      ASSERT_EQ(static_cast<int64_t>(many.hessians.size()), blocks) << ranks << " ranks";
      EXPECT_EQ(many.tokens, 22 * 64);
      for (int64_t l = 0; l < blocks; ++l) {
        auto h1 = ReadFile(calib::HessianPath(JobPaths(dir1).hessians, l));
        auto hn = ReadFile(calib::HessianPath(JobPaths(dir).hessians, l));
        ASSERT_TRUE(h1.ok() && hn.ok()) << hn.status();
        EXPECT_TRUE(*h1 == *hn) << "strip " << strip << ", " << ranks << " ranks: block " << l;
        EXPECT_TRUE(VerifyCacheChecksumOk(calib::HessianPath(JobPaths(dir).hessians, l)));
        for (int k = 0; k < 4; ++k) {
          EXPECT_FALSE(many.hessians[l].h[k].is_band()) << "kept Hessians are whole";
          EXPECT_TRUE(many.hessians[l].h[k].packed() == one.hessians[l].h[k].packed());
        }
      }
      for (int64_t l = 0; l <= blocks; ++l) {
        auto a1 = ReadFile(calib::ActivationPath(JobPaths(dir1).activations, l));
        auto an = ReadFile(calib::ActivationPath(JobPaths(dir).activations, l));
        ASSERT_TRUE(a1.ok() && an.ok()) << an.status();
        EXPECT_TRUE(*a1 == *an) << ranks << " ranks: activations at boundary " << l;
      }
    }
  }
}

// A GPU backend whose "device" Hessians are host accumulators, and whose device reduction is
// DeviceHessian::AllReduce's contract done on the host: the sums as reduction digits through
// the given int64 sum, piece by piece. Counts the reductions and the downloads.
std::atomic<int> g_device_reductions{0};
std::atomic<int> g_device_downloads{0};

class HostDeviceHessian final : public kernels::DeviceHessian {
 public:
  explicit HostDeviceHessian(int64_t n) : n_(n), acc_(n) {}
  Status Add(const float* x, int64_t seqs, int64_t t) override {
    return acc_.Add(at::from_blob(const_cast<float*>(x), {seqs, t, n_}, at::kFloat));
  }
  int64_t count() const override { return acc_.count(); }
  Status AllReduce(const kernels::DeviceInt64Sum& sum, int64_t total_rows) override {
    ++g_device_reductions;
    std::vector<kernels::Fixed128> packed = acc_.ReleasePacked();
    constexpr size_t kPiece = 1000;  // several pieces per Hessian, the last one short
    std::vector<int64_t> limbs;
    for (size_t off = 0; off < packed.size(); off += kPiece) {
      const size_t m = std::min(kPiece, packed.size() - off);
      limbs.resize(4 * m);
      calib::HessianAccumulator::SplitDigits(packed.data() + off, m, limbs.data());
      QCAL_RETURN_IF_ERROR(sum(limbs.data(), limbs.size()));
      QCAL_RETURN_IF_ERROR(
          calib::HessianAccumulator::CombineDigits(limbs.data(), m, packed.data() + off));
    }
    QCAL_ASSIGN_OR_RETURN(acc_,
                          calib::HessianAccumulator::FromFixed(n_, std::move(packed), total_rows));
    return absl::OkStatus();
  }
  StatusOr<std::vector<kernels::Fixed128>> Finish(int64_t* count) override {
    ++g_device_downloads;
    *count = acc_.count();
    return acc_.ReleasePacked();
  }

 private:
  int64_t n_;
  calib::HessianAccumulator acc_;
};

class HostDeviceBackend final : public kernels::GpuBackend {
 public:
  std::string description() const override { return "host-as-device:0"; }
  StatusOr<std::unique_ptr<kernels::DeviceHessian>> NewHessian(int64_t n) override {
    return std::unique_ptr<kernels::DeviceHessian>(std::make_unique<HostDeviceHessian>(n));
  }
  StatusOr<kernels::VectorRoundingResult> BlockLdlqE8p(const double*, int64_t, int64_t,
                                                       const double*,
                                                       const kernels::VectorRoundingConfig&) override {
    return absl::UnimplementedError("not in this test");
  }
  StatusOr<kernels::ScalarRoundingResult> Gptq(const double*, int64_t, int64_t, const double*,
                                               const kernels::ScalarRoundingConfig&) override {
    return absl::UnimplementedError("not in this test");
  }
};

// GPU ranks reduce their Hessian sums where they are (CalibrationOptions::device_sum: NCCL's
// all-reduce in qcal-worker; here the thread-ranks' int64 all-reduce on the fake's host
// "device" memory). The files must be the world of one's bytes. Each block's four sums go
// through the device reduction on every rank, and only the saving rank downloads them, unless
// the Hessians are kept. Without device_sum on every rank, every rank downloads and reduces on
// the host (same bytes).
TEST_F(CalibrationRanksTest, DeviceReducedHessiansWriteTheHostReducedBytes) {
  const int64_t blocks = 5;  // stories260K
  const std::string dir1 = *root_ + "/device-one";
  calib::CalibrationResult one = Run(1, dir1);
  ASSERT_EQ(static_cast<int64_t>(one.hessians.size()), blocks);
  HostDeviceBackend backend;  // the ranks' backend, passed to the calibration
  // 22 sequences in chunks of 4: 6 chunks; 7 ranks leave rank 6 without any.
  for (int ranks : {2, 7}) {
    for (bool keep : {false, true}) {
      for (bool all_have_sum : {true, false}) {
        SCOPED_TRACE(::testing::Message() << ranks << " ranks, keep " << keep << ", device_sum on "
                                          << (all_have_sum ? "every rank" : "rank 0 only"));
        g_device_reductions = 0;
        g_device_downloads = 0;
        const std::string dir = *root_ + "/device-" + std::to_string(ranks) + "-" +
                                std::to_string(keep) + std::to_string(all_have_sum);
        calib::CalibrationResult many = Run(
            ranks, dir, std::numeric_limits<int64_t>::max(),
            [&](calib::CalibrationOptions& o, comm::Comm& comm) {
              o.keep_hessians = keep;
              o.gpu = &backend;
              if (all_have_sum || comm.rank() == 0) {
                o.device_sum = [&comm](int64_t* data, size_t count) {
                  return comm.AllReduceSum(data, count);
                };
              }
            });
        EXPECT_EQ(many.tokens, 22 * 64);
        if (all_have_sum) {
          EXPECT_EQ(g_device_reductions.load(), ranks * blocks * 4);
          EXPECT_EQ(g_device_downloads.load(), (keep ? ranks : 1) * blocks * 4);
        } else {
          EXPECT_EQ(g_device_reductions.load(), 0);
          // Ranks with sequences download their own sums before the host reduction.
          EXPECT_EQ(g_device_downloads.load(), std::min(ranks, 6) * blocks * 4);
        }
        for (int64_t l = 0; l < blocks; ++l) {
          auto h1 = ReadFile(calib::HessianPath(JobPaths(dir1).hessians, l));
          auto hn = ReadFile(calib::HessianPath(JobPaths(dir).hessians, l));
          ASSERT_TRUE(h1.ok() && hn.ok()) << hn.status();
          EXPECT_TRUE(*h1 == *hn) << "block " << l;
          if (keep) {
            ASSERT_EQ(static_cast<int64_t>(many.hessians.size()), blocks);
            for (int k = 0; k < 4; ++k) {
              EXPECT_TRUE(many.hessians[l].h[k].packed() == one.hessians[l].h[k].packed());
            }
          }
        }
      }
    }
  }
  // Without a device all-reduce, or without a backend, the device reduction says what is missing.
  auto self = comm::MakeSelfComm();
  calib::BlockHessians h;
  h.backend = &backend;
  Status s = calib::AllReduceDeviceHessians(*self, nullptr, true, &h);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no device all-reduce"), std::string::npos) << s;
  h.backend = nullptr;
  s = calib::AllReduceDeviceHessians(
      *self, [](int64_t*, size_t) { return absl::OkStatus(); }, true, &h);
  EXPECT_NE(s.message().find("no GPU backend"), std::string::npos) << s;
}

TEST_F(CalibrationRanksTest, MoreRanksThanChunksStillAgree) {
  // 22 sequences in chunks of 8: 3 chunks over 4 ranks; rank 3 has none.
  auto comms = comm::MakeThreadComms(4);
  std::vector<Status> status(4);
  std::vector<calib::CalibrationResult> results(4);
  std::vector<std::thread> threads;
  const std::string dir = *root_ + "/job4";
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      auto source = model::OpenFloatCheckpoint(testing::RealModelDir("stories260K"));
      calib::CalibrationOptions opt;
      opt.batch = 8;
      auto res =
          calib::Calibrate(*comms[r], **source, *tokens_, job::CalibrationDirsOf(dir), "key", opt);
      status[r] = res.status();
      if (res.ok())
        results[r] = std::move(*res);
      else
        comms[r].reset();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(status[r].ok()) << r << ": " << status[r];
  auto source = model::OpenFloatCheckpoint(testing::RealModelDir("stories260K"));
  ASSERT_TRUE(source.ok());
  auto self = comm::MakeSelfComm();
  calib::CalibrationOptions opt;
  opt.batch = 8;
  auto one = calib::Calibrate(*self, **source, *tokens_,
                              job::CalibrationDirsOf(*root_ + "/job4one"), "key", opt);
  ASSERT_TRUE(one.ok());
  for (size_t l = 0; l < one->hessians.size(); ++l) {
    for (int k = 0; k < 4; ++k) {
      EXPECT_TRUE(results[3].hessians[l].h[k].packed() == one->hessians[l].h[k].packed());
    }
  }
}

}  // namespace
}  // namespace qcal

namespace qcal {
namespace {

// Flips one bit of `path` at byte `offset`.
void FlipBit(const std::string& path, size_t offset) {
  auto bytes = ReadFile(path);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_LT(offset, bytes->size());
  (*bytes)[offset] ^= 0x10;
  ASSERT_TRUE(WriteFileAtomic(path, *bytes).ok());
}

// Issue 18: a damaged Hessian or activation cache is never used. Loading names the file and the
// problem; the next calibration recomputes it (bit-identical to the first computation).
TEST_F(CalibrationRanksTest, DamagedCachesAreNamedAndRecomputed) {
  const std::string dir = *root_ + "/damaged";
  calib::CalibrationResult first = Run(1, dir);
  ASSERT_FALSE(first.from_cache);
  const std::string hpath = calib::HessianPath(JobPaths(dir).hessians, 1);
  const std::string apath = calib::ActivationPath(JobPaths(dir).activations, 2);
  const auto h_original = ReadFile(hpath);
  const auto a_original = ReadFile(apath);
  ASSERT_TRUE(h_original.ok() && a_original.ok());
  EXPECT_TRUE(ReadFile(calib::CacheChecksumPath(hpath)).ok());

  FlipBit(hpath, h_original->size() - 100);  // inside the data: the header still parses
  FlipBit(apath, a_original->size() / 2);
  auto h = calib::LoadBlockHessians(hpath, "key");
  ASSERT_FALSE(h.ok());
  EXPECT_TRUE(absl::IsDataLoss(h.status())) << h.status();
  EXPECT_NE(h.status().message().find(hpath + ": checksum"), std::string::npos) << h.status();
  const std::vector<int64_t> shape = {tokens_->size(0), tokens_->size(1), 64};
  auto a = calib::LoadActivation(apath, "key", shape);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsDataLoss(a.status())) << a.status();
  EXPECT_NE(a.status().message().find(apath + ": checksum"), std::string::npos) << a.status();

  calib::CalibrationResult again = Run(1, dir);
  EXPECT_FALSE(again.from_cache);
  EXPECT_FALSE(again.activations_from_cache);
  EXPECT_EQ(*ReadFile(hpath), *h_original);
  EXPECT_EQ(*ReadFile(apath), *a_original);
  EXPECT_TRUE(calib::LoadBlockHessians(hpath, "key").ok());

  // Without its checksum file a cache is not trusted either.
  ASSERT_EQ(std::remove(calib::CacheChecksumPath(hpath).c_str()), 0);
  h = calib::LoadBlockHessians(hpath, "key");
  ASSERT_FALSE(h.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(h.status())) << h.status();
  EXPECT_NE(h.status().message().find("no checksum"), std::string::npos) << h.status();
}

}  // namespace
}  // namespace qcal
