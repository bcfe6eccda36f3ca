// The qcal CLI end to end: import, eval --json, generate, and clear errors on bad input.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace qcal {
namespace {

struct Result {
  int exit_code;
  std::string out;  // stdout and stderr together
};

// `qcal ARGS`, stdout and stderr together (stdout_only: stderr dropped). env: a command prefix
// such as "env -u VAR" (none by default).
Result RunQcal(const std::string& args, const std::string& env = "", bool stdout_only = false) {
  const std::string cmd = env + " " + testing::BuildDir() + "/client/qcal " + args +
                          (stdout_only ? " 2>/dev/null" : " 2>&1");
  Result r{-1, ""};
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A small GPTQ 4-bit recipe (8 × 64 WikiText-2 tokens) written into `dir`; its path ("" on error).
std::string SmallGptqRecipe(const std::string& dir) {
  const std::string path = dir + "/gptq.yaml";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return "";
  std::fputs("name: gptq4\nmethod: gptq\nbits: 4\ncalibration: {files: "
             "[data/wikitext2/wiki.valid.tokens], num_sequences: 8, seq_len: 64}\n", f);
  return std::fclose(f) == 0 ? path : "";
}

std::string LastLine(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const size_t pos = t.rfind('\n');
  return pos == std::string::npos ? t : t.substr(pos + 1);
}

// qcal runs OpenBLAS's Haswell kernels on x86-64 CPUs with AVX2 and FMA (common/cpu.h:
// SelectBlasKernelsOrReexec), unless OPENBLAS_CORETYPE says otherwise.
TEST(CliBlasTest, HaswellKernelsUnlessTheUserChoseOthers) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    GTEST_SKIP() << "this CPU has no AVX2 + FMA: OpenBLAS keeps its own choice";
  }
  // Not a model directory: the command fails after the start-up that logs the kernels.
  auto run = [](const std::string& env) {
    return RunQcal("--log-level info eval --model " + testing::BuildDir() + " --data " +
                       testing::SharedDir() + "/data/tinystories/TinyStories-valid.sample30k.txt",
                   env);
  };
  Result r = run("env -u OPENBLAS_CORETYPE");
  EXPECT_NE(r.out.find("BLAS: openblas"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", Haswell kernels"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(testing::BuildDir()), std::string::npos) << "the command still runs: "
                                                                << r.out;
  r = run("env OPENBLAS_CORETYPE=Prescott");
  EXPECT_NE(r.out.find(", Prescott kernels"), std::string::npos) << r.out;
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shared_ = testing::SharedDir();
    dir_ = testing::MakeTempDir("cli") + "/stories";
    Result r = RunQcal("import llama2c " + shared_ + "/models/stories260K/stories260K.bin " +
                   shared_ + "/models/stories260K/tok512.bin --out " + dir_);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    ASSERT_NE(r.out.find("parameters"), std::string::npos) << r.out;
  }
  std::string shared_, dir_;
};

TEST_F(CliTest, EvalJsonHasTheDocumentedKeys) {
  Result r = RunQcal("eval --model " + dir_ + " --data " + shared_ +
                 "/data/tinystories/TinyStories-valid.sample30k.txt --ctx 256 --max-tokens 2000"
                 " --bos-per-window --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(LastLine(r.out), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  for (const char* key : {"tokens", "mean_nll", "perplexity", "seconds", "tokens_per_s"}) {
    EXPECT_TRUE(j.contains(key)) << key << " missing in " << r.out;
  }
  EXPECT_EQ(j["tokens"].get<int64_t>(), 2000);
  EXPECT_GT(j["perplexity"].get<double>(), 1.0);
  EXPECT_LT(j["perplexity"].get<double>(), 100.0);  // an in-domain story model
  EXPECT_NEAR(std::exp(j["mean_nll"].get<double>()), j["perplexity"].get<double>(), 1e-6);
}

// --device: where LibTorch evaluates, said in the JSON; CUDA is refused with the reason by a
// build whose LibTorch has none (Debian's), and used by one that has it.
TEST_F(CliTest, EvalDeviceIsChosenAndReported) {
  const std::string args = "eval --model " + dir_ + " --data " + shared_ +
                           "/data/tinystories/TinyStories-valid.sample30k.txt --ctx 256 "
                           "--max-tokens 2000 --json --device ";
  Result cpu = RunQcal(args + "cpu");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.out;
  auto j = nlohmann::json::parse(LastLine(cpu.out), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << cpu.out;
  EXPECT_EQ(j["device"], "cpu");
  Result bad = RunQcal(args + "gpu");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("'gpu' is not one of auto, cpu, cuda, cuda:N"), std::string::npos)
      << bad.out;
  Result cuda = RunQcal(args + "cuda");
  if (cuda.exit_code == 0) {
    auto c = nlohmann::json::parse(LastLine(cuda.out), nullptr, false);
    EXPECT_EQ(c["device"], "cuda:0") << cuda.out;
    EXPECT_NEAR(c["perplexity"].get<double>() / j["perplexity"].get<double>(), 1.0, 1e-4);
  } else {
    EXPECT_NE(cuda.out.find("this build's LibTorch has no CUDA"), std::string::npos) << cuda.out;
  }
}

// Off a terminal (a log, a Slurm job's output) `qcal quantize` still says where it is: a plain
// line per phase when it is done (and every 10 s while it runs), on stderr, never on stdout.
TEST_F(CliTest, QuantizeShowsProgressOffATerminal) {
  const std::string dir = testing::MakeTempDir("cli-quantize");
  const std::string recipe = SmallGptqRecipe(dir);
  ASSERT_FALSE(recipe.empty());
  const std::string args = "quantize --recipe " + recipe + " --model " + dir_ + " --out " + dir +
                           "/q --data-root " + shared_;
  Result r = RunQcal(args);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("calibrate 5/5, "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nquantize 5/5, "), std::string::npos) << r.out;
  // Where the time went: the job's phases and the block tasks' (summed over the blocks).
  EXPECT_NE(r.out.find("\nphases: plan "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; calibrate "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nblock tasks: read weights "), std::string::npos) << r.out;
  // Parts of a phase in parentheses after it: GPTQ's factorization and rounding pass, the
  // calibration walk's forward passes.
  EXPECT_NE(r.out.find("(factor "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", round "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\ncalibrate: tokens "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("forward "), std::string::npos) << r.out;
  // stdout alone has none of it: the --json result is all there is.
  Result j = RunQcal(args + " --json", "", /*stdout_only=*/true);
  ASSERT_EQ(j.exit_code, 0) << j.out;
  EXPECT_EQ(j.out.find("5/5"), std::string::npos) << j.out;
  EXPECT_FALSE(nlohmann::json::parse(j.out, nullptr, false).is_discarded()) << j.out;
}

// `qcal quantize --json` says where the job's time and memory went: its phases in order with
// seconds and peak resident bytes, the calibration step's own phases, and every block task's.
TEST_F(CliTest, QuantizeJsonHasPhaseTimesAndPeaks) {
  const std::string dir = testing::MakeTempDir("cli-phases");
  const std::string recipe = SmallGptqRecipe(dir);
  ASSERT_FALSE(recipe.empty());
  const Result r = RunQcal("quantize --recipe " + recipe + " --model " + dir_ + " --out " + dir +
                               "/q --data-root " + shared_ + " --json",
                           "", /*stdout_only=*/true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  // Top-level phases, and the parts ("<phase>/<part>": measured inside a phase, no peak).
  auto names = [](const nlohmann::json& phases) {
    std::vector<std::string> out;
    for (const auto& p : phases) {
      const std::string name = p["name"].get<std::string>();
      if (name.find('/') == std::string::npos) out.push_back(name);
    }
    return out;
  };
  auto part = [](const nlohmann::json& phases, const std::string& name) -> double {
    for (const auto& p : phases) {
      if (p["name"] == name) {
        EXPECT_TRUE(p["peak_host_bytes"].is_null()) << p;
        return p["seconds"].get<double>();
      }
    }
    return -1;
  };
  EXPECT_EQ(names(j["phases"]), (std::vector<std::string>{"plan", "open", "calibrate", "quantize",
                                                           "finalize"}));
  EXPECT_EQ(names(j["calibrate_phases"]), (std::vector<std::string>{"tokens", "hessians"}));
  EXPECT_GT(part(j["calibrate_phases"], "hessians/forward"), 0.0) << j["calibrate_phases"];
  EXPECT_GT(part(j["calibrate_phases"], "hessians/read weights"), 0.0);
  double sum = 0;
  for (const auto& p : j["phases"]) {
    EXPECT_GE(p["seconds"].get<double>(), 0.0);
    sum += p["seconds"].get<double>();
    ASSERT_TRUE(p["peak_host_bytes"].is_number()) << p;  // Linux: VmHWM
    EXPECT_GT(p["peak_host_bytes"].get<int64_t>(), 0);
    EXPECT_LE(p["peak_host_bytes"].get<int64_t>(), j["peak_host_bytes"].get<int64_t>());
    EXPECT_TRUE(p["peak_device_bytes"].is_null()) << "a CPU job has no device peak: " << p;
  }
  EXPECT_TRUE(j.contains("peak_device_bytes") && j["peak_device_bytes"].is_null()) << j;
  EXPECT_GE(sum, j["seconds"].get<double>() * 0.999);  // the job's wall time is within them
  ASSERT_EQ(j["blocks"].size(), 5u);
  for (const auto& b : j["blocks"]) {
    EXPECT_EQ(names(b["phases"]), (std::vector<std::string>{"read weights", "transform",
                                                             "load calibration", "quantize",
                                                             "write"}))
        << b;
    double block_sum = 0, quantize = 0;
    for (const auto& p : b["phases"]) {
      if (p["name"].get<std::string>().find('/') != std::string::npos) continue;
      block_sum += p["seconds"].get<double>();
      if (p["name"] == "quantize") quantize = p["seconds"].get<double>();
    }
    EXPECT_LE(block_sum, b["seconds"].get<double>() * 1.001 + 1e-6) << b;
    // GPTQ's parts: the factorization, the pass, the proxy loss, all inside "quantize".
    const double factor = part(b["phases"], "quantize/factor");
    const double round = part(b["phases"], "quantize/round");
    const double proxy = part(b["phases"], "quantize/proxy loss");
    EXPECT_GT(factor, 0.0) << b;
    EXPECT_GT(round, 0.0) << b;
    EXPECT_GT(proxy, 0.0) << b;
    EXPECT_LE(factor + round + proxy, quantize * 1.001 + 1e-6) << b;
  }
}

TEST_F(CliTest, HumanEvalOutputAndGenerate) {
  Result r = RunQcal("eval --model " + dir_ + " --data " + shared_ +
                 "/data/wikitext2/wiki.test.joined.txt --ctx 512 --max-tokens 3000");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* word : {"perplexity", "mean NLL", "tokens/s", "wall time"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << r.out;
  }
  r = RunQcal("generate --model " + dir_ + " --tokens 16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(LastLine(r.out), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["generated_ids"].size(), 16u);
}

TEST_F(CliTest, BadInputGivesAClearError) {
  // A model directory whose config.json is broken.
  const std::string broken = testing::MakeTempDir("cli-broken");
  FILE* f = std::fopen((broken + "/config.json").c_str(), "w");
  std::fputs("{\"hidden_size\": 64,", f);
  std::fclose(f);
  Result r = RunQcal("eval --model " + broken + " --data " + shared_ +
                 "/data/tinystories/TinyStories-valid.sample30k.txt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("config.json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;

  // A model file that is not a llama2.c checkpoint.
  r = RunQcal("import llama2c " + shared_ + "/models/stories260K/tok512.bin " + shared_ +
          "/models/stories260K/tok512.bin --out " + broken + "/x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("tok512.bin"), std::string::npos) << r.out;

  // ctx beyond the model.
  r = RunQcal("eval --model " + dir_ + " --data " + shared_ +
          "/data/tinystories/TinyStories-valid.sample30k.txt --ctx 100000");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("max_position_embeddings"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace qcal
