// Recipe parsing: the bundled jobs/*.yaml, defaults, the JSON round trip, and the error messages
// (each names the file, the key and its line).
#include "methods/registry.h"

#include "methods/gptq/gptq_spec.h"
#include "methods/quarot/quarot_spec.h"
#include "methods/quip/quip_spec.h"
#include "methods/rtn/rtn_spec.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace qcal {
namespace {

constexpr char kSource[] = "jobs/bad.yaml";

using methods::gptq::GptqConfig;
using methods::quarot::QuarotConfig;
using methods::quip::QuipConfig;
using methods::rtn::RtnConfig;

// The method-specific settings, read through each method's config (empty / defaults for a
// method that has no such setting).
const QuipConfig* Quip(const Recipe& r) { return dynamic_cast<const QuipConfig*>(r.config.get()); }
const QuarotConfig* Quarot(const Recipe& r) {
  return dynamic_cast<const QuarotConfig*>(r.config.get());
}
std::string Codebook(const Recipe& r) { return Quip(r) ? Quip(r)->codebook : ""; }
bool Incoherence(const Recipe& r) { return Quip(r) && Quip(r)->incoherence; }
std::string ScaleMode(const Recipe& r) { return Quip(r) ? Quip(r)->scale_mode : ""; }
double Damp(const Recipe& r) {
  if (Quip(r)) return Quip(r)->damp;
  if (auto* g = dynamic_cast<const GptqConfig*>(r.config.get())) return g->damp;
  if (Quarot(r)) return Quarot(r)->damp;
  return 0;
}
ScalarGridSpec Scalar(const Recipe& r) {
  if (auto* g = dynamic_cast<const GptqConfig*>(r.config.get())) return g->scalar;
  if (auto* t = dynamic_cast<const RtnConfig*>(r.config.get())) return t->scalar;
  if (Quarot(r)) return Quarot(r)->scalar;
  return ScalarGridSpec();
}
std::string Weights(const Recipe& r) { return Quarot(r) ? Quarot(r)->weights : ""; }
RotationSpec Rotation(const Recipe& r) { return Quarot(r) ? Quarot(r)->rotation : RotationSpec(); }
ActivationQuantSpec Activations(const Recipe& r) {
  return Quarot(r) ? Quarot(r)->activations : ActivationQuantSpec();
}
KvCacheSpec KvCache(const Recipe& r) { return Quarot(r) ? Quarot(r)->kv_cache : KvCacheSpec(); }
// Whether the method rounds with Hessians (the float model's, or QuaRot's sequential ones).
bool NeedsHessians(const Recipe& r) {
  return r.needs().float_hessians || (Quarot(r) && Quarot(r)->gptq());
}
bool QuantizesWeights(const Recipe& r) { return !Quarot(r) || Quarot(r)->quantizes_weights(); }

std::string JobsDir() { return qcal::testing::SourceDir() + "/jobs"; }

std::vector<std::string> BundledRecipes() {
  std::vector<std::string> paths;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(JobsDir(), ec)) {
    if (entry.path().extension() == ".yaml") paths.push_back(entry.path().string());
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

// Equality of the common fields and of everything the method reads (its JSON form holds every
// setting of the method), with a readable diff on failure.
void ExpectSameRecipe(const Recipe& a, const Recipe& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.method, b.method);
  EXPECT_EQ(a.bits(), b.bits());
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.calibration.files, b.calibration.files);
  EXPECT_EQ(a.calibration.num_sequences, b.calibration.num_sequences);
  EXPECT_EQ(a.calibration.seq_len, b.calibration.seq_len);
  EXPECT_EQ(a.calibration.seed, b.calibration.seed);
  EXPECT_EQ(a.calibration.precision, b.calibration.precision);
  EXPECT_EQ(a.calibration.moe_route_all, b.calibration.moe_route_all);
  EXPECT_EQ(a.calibration.moe_min_tokens, b.calibration.moe_min_tokens);
  EXPECT_EQ(a.finetune.enabled, b.finetune.enabled);
  for (const auto& [sa, sb] : {std::make_pair(&a.finetune.block, &b.finetune.block),
                               std::make_pair(&a.finetune.end_to_end, &b.finetune.end_to_end)}) {
    EXPECT_EQ(sa->enabled, sb->enabled);
    EXPECT_EQ(sa->epochs, sb->epochs);
    EXPECT_EQ(sa->lr, sb->lr);
    EXPECT_EQ(sa->batch, sb->batch);
    EXPECT_EQ(sa->holdout, sb->holdout);
  }
  EXPECT_EQ(Codebook(a), Codebook(b));
  EXPECT_EQ(Weights(a), Weights(b));
  EXPECT_EQ(a.ToJson(), b.ToJson()) << a.ToJson().dump(2) << "\nvs\n" << b.ToJson().dump(2);
}

void ExpectRoundTrip(const Recipe& recipe, const std::string& what) {
  for (int indent : {-1, 2}) {
    const std::string text = recipe.ToJson().dump(indent);
    StatusOr<Recipe> again = ParseRecipe(text, what + ".json");
    ASSERT_TRUE(again.ok()) << again.status() << "\n" << text;
    ExpectSameRecipe(recipe, *again, what + " (json indent " + std::to_string(indent) + ")");
  }
}

Recipe MustParse(const std::string& yaml, const std::string& source = "jobs/test.yaml") {
  StatusOr<Recipe> recipe = ParseRecipe(yaml, source);
  EXPECT_TRUE(recipe.ok()) << recipe.status() << "\n" << yaml;
  return recipe.ok() ? *recipe : Recipe();
}

// Parses `yaml` as jobs/bad.yaml and expects InvalidArgument whose message holds every piece.
void ExpectError(const std::string& yaml, std::initializer_list<std::string> pieces) {
  StatusOr<Recipe> recipe = ParseRecipe(yaml, kSource);
  ASSERT_FALSE(recipe.ok()) << "parsed without error:\n" << yaml;
  EXPECT_EQ(recipe.status().code(), absl::StatusCode::kInvalidArgument) << recipe.status();
  const std::string message(recipe.status().message());
  EXPECT_EQ(message.rfind(std::string(kSource) + ": ", 0), 0u) << message;
  for (const std::string& piece : pieces) {
    EXPECT_NE(message.find(piece), std::string::npos)
        << "missing \"" << piece << "\" in: " << message << "\nfor:\n" << yaml;
  }
}

// ------------------------------------------------------------------------------------------
// Bundled recipes
// ------------------------------------------------------------------------------------------

TEST(BundledRecipes, AllExpectedFilesArePresent) {
  const std::vector<std::string> expected = {
      "gptq-2bit",       "gptq-3bit",        "gptq-4bit",         "quip-e8p-2bit",
      "quip-e8p-2bit-ft", "quip-e8p-3bit",   "quip-e8p-3bit-ft",  "quip-e8p-4bit",
      "quip-e8p-4bit-ft", "quip-halfint-2bit", "rtn-2bit",        "rtn-3bit",
      "rtn-4bit"};
  for (const std::string& name : expected) {
    struct stat st;
    EXPECT_EQ(stat((JobsDir() + "/" + name + ".yaml").c_str(), &st), 0) << JobsDir() << "/" << name;
  }
}

TEST(BundledRecipes, EveryFileParsesAndRoundTripsThroughJson) {
  const std::vector<std::string> paths = BundledRecipes();
  ASSERT_GE(paths.size(), 13u) << "no recipes under " << JobsDir();
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    StatusOr<Recipe> recipe = LoadRecipe(path);
    ASSERT_TRUE(recipe.ok()) << recipe.status();
    EXPECT_EQ(recipe->name, std::filesystem::path(path).stem().string());
    // Each file opens with a comment explaining it.
    std::ifstream in(path);
    std::string first_line;
    std::getline(in, first_line);
    EXPECT_EQ(first_line.rfind("# ", 0), 0u) << first_line;
    // Bundled calibration defaults.
    EXPECT_EQ(recipe->calibration.files,
              std::vector<std::string>{"data/wikitext2/wiki.valid.tokens"});
    EXPECT_EQ(recipe->calibration.num_sequences, 128);
    EXPECT_EQ(recipe->calibration.seq_len, 128);
    EXPECT_EQ(recipe->calibration.seed, 0u);
    ExpectRoundTrip(*recipe, path);
  }
}

TEST(BundledRecipes, SettingsMatchTheirNames) {
  struct Expect {
    const char* name;
    std::string method;
    int bits;
    const char* codebook;
    bool finetune;
  };
  const Expect expects[] = {
      {"quip-e8p-2bit", "quip", 2, "e8p", false},
      {"quip-e8p-3bit", "quip", 3, "rvq3_e8p_e8", false},
      {"quip-e8p-4bit", "quip", 4, "rvq4_e8p_e8p", false},
      {"quip-e8p-2bit-ft", "quip", 2, "e8p", true},
      {"quip-e8p-3bit-ft", "quip", 3, "rvq3_e8p_e8", true},
      {"quip-e8p-4bit-ft", "quip", 4, "rvq4_e8p_e8p", true},
      {"quip-halfint-2bit", "quip", 2, "halfint2", false},
      {"rtn-2bit", "rtn", 2, "", false},
      {"rtn-3bit", "rtn", 3, "", false},
      {"rtn-4bit", "rtn", 4, "", false},
      {"gptq-2bit", "gptq", 2, "", false},
      {"gptq-3bit", "gptq", 3, "", false},
      {"gptq-4bit", "gptq", 4, "", false},
      {"qtip-2bit", "quip", 2, "qtip_1mad", false},
      {"qtip-3bit", "quip", 3, "qtip_1mad", false},
      {"qtip-4bit", "quip", 4, "qtip_1mad", false},
      {"qtip-2bit-ft", "quip", 2, "qtip_1mad", true},
  };
  for (const Expect& e : expects) {
    SCOPED_TRACE(e.name);
    StatusOr<Recipe> recipe = LoadRecipe(JobsDir() + "/" + e.name + ".yaml");
    ASSERT_TRUE(recipe.ok()) << recipe.status();
    EXPECT_EQ(recipe->method, e.method);
    EXPECT_EQ(recipe->bits(), e.bits);
    EXPECT_EQ(Codebook(*recipe), e.codebook);
    EXPECT_EQ(Incoherence(*recipe), e.method == "quip");
    EXPECT_EQ(recipe->finetune.enabled, e.finetune);
    EXPECT_EQ(recipe->finetune.block.enabled, e.finetune);
    EXPECT_EQ(recipe->finetune.end_to_end.enabled, e.finetune);
    if (e.finetune) {
      // QuIP# Appendix F.6 (5 epochs, lr 5e-5), except the 4-bit recipe, which trains 10 epochs
      // at 1e-4 in both stages (docs/results.md: the F.6 settings under-train at 4 bits).
      const bool tuned4 = e.name == std::string("quip-e8p-4bit-ft");
      EXPECT_EQ(recipe->finetune.block.epochs, tuned4 ? 10 : 5);
      EXPECT_DOUBLE_EQ(recipe->finetune.block.lr, tuned4 ? 1e-4 : 5e-5);
      EXPECT_EQ(recipe->finetune.block.batch, 8);
      EXPECT_EQ(recipe->finetune.end_to_end.epochs, tuned4 ? 10 : 5);
      EXPECT_DOUBLE_EQ(recipe->finetune.end_to_end.lr, tuned4 ? 1e-4 : 5e-5);
      EXPECT_EQ(recipe->finetune.end_to_end.batch, 1);
    }
    if (e.method != "quip") {
      EXPECT_EQ(Scalar(*recipe).group_size, -1);
      EXPECT_TRUE(Scalar(*recipe).symmetric);
      EXPECT_TRUE(Scalar(*recipe).clip_search);
      EXPECT_EQ(Scalar(*recipe).act_order, e.method == "gptq");
    }
    EXPECT_EQ(NeedsHessians(*recipe), e.method != "rtn");
  }
}

TEST(BundledRecipes, CalibrationFilesExistUnderTheDataRoot) {
  const std::string shared = qcal::testing::SharedDir();
  struct stat st;
  if (stat((shared + "/data").c_str(), &st) != 0) {
    GTEST_SKIP() << "no shared data at " << shared << "/data";
  }
  for (const std::string& path : BundledRecipes()) {
    StatusOr<Recipe> recipe = LoadRecipe(path);
    ASSERT_TRUE(recipe.ok()) << recipe.status();
    for (const std::string& file : recipe->calibration.files) {
      EXPECT_EQ(stat((shared + "/" + file).c_str(), &st), 0) << path << ": " << shared << "/" << file;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Defaults and accepted forms
// ------------------------------------------------------------------------------------------

TEST(RecipeDefaults, OnlyMethodGiven) {
  const Recipe r = MustParse("method: quip\n", "jobs/minimal.yaml");
  EXPECT_EQ(r.name, "minimal");  // the file stem
  EXPECT_EQ(r.method, "quip");
  EXPECT_EQ(r.bits(), 2);
  EXPECT_EQ(Codebook(r), "e8p");
  EXPECT_TRUE(Incoherence(r));
  EXPECT_EQ(ScaleMode(r), "row");
  EXPECT_EQ(r.seed, 0u);
  EXPECT_DOUBLE_EQ(Damp(r), 0.01);
  EXPECT_EQ(r.calibration.files, std::vector<std::string>{"data/wikitext2/wiki.valid.tokens"});
  EXPECT_EQ(r.calibration.num_sequences, 64);
  EXPECT_EQ(r.calibration.seq_len, 128);
  EXPECT_EQ(r.calibration.seed, 0u);
  EXPECT_FALSE(r.finetune.enabled);
  EXPECT_FALSE(r.finetune.block.enabled);
  EXPECT_EQ(r.finetune.block.epochs, 5);
  EXPECT_DOUBLE_EQ(r.finetune.block.lr, 5e-5);
  EXPECT_EQ(r.finetune.block.batch, 8);
  EXPECT_DOUBLE_EQ(r.finetune.block.holdout, 0.1);
  EXPECT_FALSE(r.finetune.end_to_end.enabled);
  ExpectRoundTrip(r, "minimal");
}

TEST(RecipeDefaults, RtnAndGptqHaveNoCodebookOrIncoherence) {
  for (const char* method : {"rtn", "gptq"}) {
    const Recipe r = MustParse(std::string("method: ") + method + "\n");
    EXPECT_EQ(r.bits(), 2);
    EXPECT_EQ(Codebook(r), "");
    EXPECT_FALSE(Incoherence(r));
    EXPECT_EQ(Scalar(r).group_size, -1);
    EXPECT_TRUE(Scalar(r).symmetric);
    EXPECT_FALSE(Scalar(r).act_order);
    EXPECT_FALSE(Scalar(r).clip_search);
    const nlohmann::json j = r.ToJson();
    EXPECT_FALSE(j.contains("codebook")) << j;
    EXPECT_FALSE(j.contains("scale")) << j;
    EXPECT_TRUE(j.contains("scalar")) << j;
    EXPECT_EQ(j.contains("damp"), std::string(method) == "gptq") << j;
    ExpectRoundTrip(r, method);
  }
}

TEST(RecipeDefaults, QuipCodebookFollowsBitsAndBitsFollowCodebook) {
  EXPECT_EQ(Codebook(MustParse("method: quip\nbits: 3\n")), "rvq3_e8p_e8");
  EXPECT_EQ(Codebook(MustParse("method: quip\nbits: 4\n")), "rvq4_e8p_e8p");
  EXPECT_EQ(Codebook(MustParse("method: quip\nbits: 2\n")), "e8p");
  EXPECT_EQ(MustParse("method: quip\ncodebook: halfint3\n").bits(), 3);
  EXPECT_EQ(MustParse("method: quip\ncodebook: halfint4\n").bits(), 4);
  EXPECT_EQ(MustParse("method: quip\ncodebook: rvq4_e8p_e8p\nbits: 4\n").bits(), 4);
}

TEST(RecipeDefaults, ExplicitValuesAndForms) {
  const Recipe r = MustParse(
      "# comment\n"
      "name: \"my recipe\"\n"
      "method: gptq\n"
      "bits: 8\n"
      "seed: 18446744073709551615\n"
      "damp: 1\n"
      "scalar: {group_size: 128, symmetric: False, act_order: TRUE, clip_search: true}\n"
      "calibration:\n"
      "  files:\n"
      "    - a.txt\n"
      "    - /abs/b.txt\n"
      "  num_sequences: 1\n"
      "  seq_len: 2\n"
      "  seed: 7\n"
      "finetune:\n"
      "  enabled: false\n"
      "  end_to_end: {enabled: true, epochs: 1, lr: 1.0e-3, batch: 1, holdout: 0}\n");
  EXPECT_EQ(r.name, "my recipe");
  EXPECT_EQ(r.bits(), 8);
  EXPECT_EQ(r.seed, 18446744073709551615ull);
  EXPECT_DOUBLE_EQ(Damp(r), 1.0);
  EXPECT_EQ(Scalar(r).group_size, 128);
  EXPECT_FALSE(Scalar(r).symmetric);
  EXPECT_TRUE(Scalar(r).act_order);
  EXPECT_TRUE(Scalar(r).clip_search);
  EXPECT_EQ(r.calibration.files, (std::vector<std::string>{"a.txt", "/abs/b.txt"}));
  EXPECT_EQ(r.calibration.num_sequences, 1);
  EXPECT_EQ(r.calibration.seq_len, 2);
  EXPECT_EQ(r.calibration.seed, 7u);
  // End to end alone, without the within-block stage, is allowed.
  EXPECT_FALSE(r.finetune.enabled);
  EXPECT_TRUE(r.finetune.end_to_end.enabled);
  EXPECT_EQ(r.finetune.end_to_end.epochs, 1);
  EXPECT_DOUBLE_EQ(r.finetune.end_to_end.lr, 1e-3);
  EXPECT_DOUBLE_EQ(r.finetune.end_to_end.holdout, 0.0);
  ExpectRoundTrip(r, "explicit");
}

// The mixture-of-experts calibration keys: defaults (real routing, the hidden-size minimum),
// explicit values, their range, and a JSON that names them only when set, so that every other
// recipe's JSON (and the checkpoints that carry it) stays as it was.
TEST(RecipeDefaults, MoeCalibrationKeys) {
  const Recipe plain = MustParse("method: gptq\n");
  EXPECT_FALSE(plain.calibration.moe_route_all);
  EXPECT_EQ(plain.calibration.moe_min_tokens, -1);
  EXPECT_FALSE(plain.ToJson()["calibration"].contains("moe_route_all"));
  EXPECT_FALSE(plain.ToJson()["calibration"].contains("moe_min_tokens"));
  const Recipe r =
      MustParse("method: gptq\ncalibration: {moe_route_all: true, moe_min_tokens: 16}\n");
  EXPECT_TRUE(r.calibration.moe_route_all);
  EXPECT_EQ(r.calibration.moe_min_tokens, 16);
  EXPECT_EQ(r.ToJson()["calibration"]["moe_min_tokens"], 16);
  ExpectRoundTrip(r, "moe");
  ExpectRoundTrip(MustParse("method: rtn\ncalibration: {moe_min_tokens: 0}\n"), "moe-zero");
  ExpectError("method: gptq\ncalibration: {moe_min_tokens: -2}\n",
              {"calibration.moe_min_tokens", "-1 for the model's hidden size", "-2"});
  ExpectError("method: gptq\ncalibration: {moe_route_all: 3}\n",
              {"calibration.moe_route_all"});
}

TEST(RecipeDefaults, JsonIsCompleteForQuip) {
  const nlohmann::json j = MustParse("method: quip\nfinetune: {enabled: true}\n").ToJson();
  for (const char* key : {"name", "method", "bits", "codebook", "incoherence", "scale", "seed",
                          "damp", "calibration", "finetune"}) {
    EXPECT_TRUE(j.contains(key)) << key << " in " << j;
  }
  EXPECT_FALSE(j.contains("scalar")) << j;
  EXPECT_EQ(j["method"], "quip");
  EXPECT_EQ(j["finetune"]["enabled"], true);
  EXPECT_EQ(j["finetune"]["block"].size(), 4u) << j;  // enabled lives at finetune.enabled
  EXPECT_EQ(j["finetune"]["end_to_end"].size(), 5u) << j;
  EXPECT_EQ(j["calibration"].size(), 5u) << j;
  EXPECT_EQ(j["calibration"]["precision"], "fp32") << j;  // recorded even when not written
}

TEST(RecipeDefaults, CalibrationPrecisionIsFp32OrBf16) {
  const Recipe r = MustParse("method: quip\ncalibration: {precision: bf16}\n");
  EXPECT_EQ(r.calibration.precision, "bf16");
  ExpectRoundTrip(r, "bf16");
  ExpectError("method: quip\ncalibration: {precision: fp16}\n",
              {"key 'calibration.precision'", "must be fp32 or bf16, got 'fp16'"});
}

TEST(RecipeDefaults, QuipScaleModes) {
  for (const char* mode : {"row", "matrix", "auto"}) {
    const Recipe r = MustParse(std::string("method: quip\nscale: ") + mode + "\n");
    EXPECT_EQ(ScaleMode(r), mode);
    EXPECT_EQ(r.ToJson()["scale"], mode);
    ExpectRoundTrip(r, mode);
  }
  ExpectError("method: quip\nscale: rows\n",
              {"key 'scale' (line 2) must be row or matrix or auto, got 'rows'",
               "did you mean 'row'?"});
  ExpectError("method: gptq\nscale: row\n", {"key 'scale' (line 2) applies only to method quip"});
}

TEST(RecipeDefaults, QuipTrellisCodebooks) {
  const Recipe r = MustParse("method: quip\nbits: 3\ncodebook: qtip_hyb\ntrellis_l: 12\n");
  EXPECT_EQ(r.bits(), 3);
  EXPECT_EQ(r.ToJson()["codebook"], "qtip_hyb");
  EXPECT_EQ(r.ToJson()["trellis_l"], 12);
  const auto& q = *Quip(r);
  EXPECT_EQ(q.kernel_codebook(), "qtip_hyb_l12_k3");
  ExpectRoundTrip(r, "qtip_hyb");
  const Recipe d = MustParse("method: quip\ncodebook: qtip_1mad\n");
  EXPECT_EQ(d.bits(), 2);
  EXPECT_EQ(Quip(d)->kernel_codebook(),
            "qtip_1mad_l16_k2");
  // Lattice recipes keep their JSON: no trellis_l key.
  EXPECT_FALSE(MustParse("method: quip\n").ToJson().contains("trellis_l"));
  ExpectError("method: quip\ncodebook: e8p\ntrellis_l: 16\n",
              {"key 'trellis_l' (line 3) applies only to the trellis codebooks"});
  ExpectError("method: quip\nbits: 4\ncodebook: qtip_hyb\ntrellis_l: 9\n",
              {"key 'trellis_l' (line 4) must be 10..20", "got 9"});
  ExpectError("method: quip\ncodebook: qtip_2mad\n", {"key 'codebook' (line 2)", "qtip_1mad"});
}

TEST(RecipeDefaults, RefineSweeps) {
  auto sweeps = [](const Recipe& r) { return r.ToJson()["refine_sweeps"].get<int>(); };
  EXPECT_EQ(sweeps(MustParse("method: quip\n")), methods::quip::QuipConfig::kDefaultRefineSweeps);
  EXPECT_EQ(sweeps(MustParse("method: gptq\n")), methods::gptq::GptqConfig::kDefaultRefineSweeps);
  for (const char* yaml : {"method: quip\nrefine_sweeps: 3\n", "method: gptq\nrefine_sweeps: 3\n",
                           "method: quarot\nweights: gptq\nrefine_sweeps: 3\n"}) {
    const Recipe r = MustParse(yaml);
    EXPECT_EQ(sweeps(r), 3) << yaml;
    ExpectRoundTrip(r, yaml);
  }
  EXPECT_FALSE(MustParse("method: quarot\nweights: rtn\n").ToJson().contains("refine_sweeps"));
  ExpectError("method: quip\nrefine_sweeps: 101\n",
              {"key 'refine_sweeps' (line 2) must be in 0..100, got 101"});
  ExpectError("method: gptq\nrefine_sweeps: -1\n", {"key 'refine_sweeps' (line 2)"});
  ExpectError("method: rtn\nrefine_sweeps: 2\n", {"key 'refine_sweeps' (line 2)"});
  ExpectError("method: quarot\nweights: rtn\nrefine_sweeps: 2\n",
              {"key 'refine_sweeps' (line 3) does not apply with 'weights: rtn'"});
}

TEST(RecipeDefaults, PrefixquantKeysRoundTripAndBadValuesAreNamed) {
  const std::string yaml =
      "method: prefixquant\nbits: 4\nactivations: {bits: 8}\nkv_cache: {bits: 4}\n"
      "prefix: {enabled: true, threshold: 32}\ngrid_search: false\nsearch_sequences: 4\n";
  const Recipe r = MustParse(yaml);
  EXPECT_TRUE(r.needs().sequential);
  EXPECT_EQ(r.needs().global_phases, (std::vector<std::string>{"prefix"}));
  ExpectRoundTrip(r, yaml);
  EXPECT_TRUE(MustParse("method: prefixquant\nprefix: {enabled: false}\n").needs()
                  .global_phases.empty());
  ExpectError("method: prefixquant\nbits: 9\n", {"key 'bits' (line 2)", "2..8, or 16"});
  ExpectError("method: prefixquant\nactivations: {bits: 1}\n", {"key 'activations.bits'"});
  ExpectError("method: prefixquant\nprefix: {enabled: false, threshold: 64}\n",
              {"key 'prefix.threshold'", "does not apply with 'enabled: false'"});
  ExpectError("method: prefixquant\nprefix: {threshold: 1}\n", {"key 'prefix.threshold'", "> 1"});
  ExpectError("method: prefixquant\nbits: 16\nactivations: {bits: 16}\nkv_cache: {bits: 16}\n",
              {"quantizes nothing"});
  ExpectError("method: prefixquant\nkv_cache: {bits: 4, format: bfp}\n",
              {"unknown key 'kv_cache.format'"});
}

TEST(RecipeDefaults, SpinquantKeysRoundTripAndBadValuesAreNamed) {
  const std::string yaml =
      "method: spinquant\nweights: gptq\nbits: 4\nactivations: {bits: 4}\nkv_cache: {bits: 4}\n"
      "training: {steps: 20, lr: 0.5, batch: 4, grad_clip: 0, checkpoint_every: 5, init: identity, "
      "loss: ce, range_gradient: false, validation: 8}\n";
  const Recipe r = MustParse(yaml);
  EXPECT_TRUE(r.needs().sequential);
  EXPECT_EQ(r.needs().global_phases, (std::vector<std::string>{"rotations"}));
  ExpectRoundTrip(r, yaml);
  // Training defaults: float weights before GPTQ when activations or KV are quantized, else the
  // target bits (weight-only: float weights would leave the loss independent of the rotations).
  nlohmann::json j = MustParse(yaml).ToJson();
  EXPECT_EQ(j["training"]["weight_bits"], 16);
  j = MustParse("method: spinquant\nweights: gptq\nbits: 3\n").ToJson();
  EXPECT_EQ(j["training"]["weight_bits"], 3);
  ExpectError("method: spinquant\nrotation: {r2: false}\n",
              {"key 'rotation'", "trains R1 and R2"});
  ExpectError("method: spinquant\nbits: 4\ntraining: {weight_bits: 16}\n",
              {"key 'training.weight_bits'", "nothing is quantized in training"});
  ExpectError("method: spinquant\nweights: none\n", {"quantizes nothing"});
  ExpectError("method: spinquant\nactivations: {bits: 4}\nkv_cache: {bits: 4, format: bfp}\n",
              {"key 'kv_cache'", "int KV cache"});
  ExpectError("method: spinquant\ntraining: {steps: 0}\n", {"key 'training.steps'", "1..100000"});
  ExpectError("method: spinquant\ntraining: {lr: -1}\n", {"key 'training.lr'"});
  ExpectError("method: spinquant\ntraining: {init: random}\n",
              {"key 'training.init'", "must be hadamard or identity or best"});
  ExpectError("method: spinquant\ntraining: {loss: mse}\n",
              {"key 'training.loss'", "must be kl or ce"});
  ExpectError("method: spinquant\ntraining: {range_gradient: 1}\n",
              {"key 'training.range_gradient'"});
  // Held-out sequences come out of the calibration set (64 by default): one must be left.
  EXPECT_EQ(MustParse("method: spinquant\nbits: 4\n").ToJson()["training"]["validation"], 0);
  ExpectError("method: spinquant\ntraining: {validation: 64}\n",
              {"key 'training.validation'", "0..63", "calibration.num_sequences = 64"});
  ExpectError("method: spinquant\ntraining: {validation: -1}\n", {"key 'training.validation'"});
  // Smoothing scales: recorded only when on (recipes without them keep their recorded config).
  EXPECT_FALSE(MustParse("method: spinquant\nbits: 4\n").ToJson()["training"].contains("smooth"));
  const std::string smooth =
      "method: spinquant\nweights: gptq\nbits: 4\nactivations: {bits: 4}\nkv_cache: {bits: 4}\n"
      "training: {smooth: true, smooth_lr: 0.2}\n";
  ExpectRoundTrip(MustParse(smooth), smooth);
  EXPECT_EQ(MustParse(smooth).ToJson()["training"]["smooth_lr"], 0.2);
  ExpectError("method: spinquant\ntraining: {smooth: true, smooth_lr: 0}\n",
              {"key 'training.smooth_lr'", "in (0, 10]"});
  ExpectError("method: spinquant\ntraining: {smooth: 1}\n", {"key 'training.smooth'"});
  ExpectError("method: spinquant\ntraining: {momentum: 0.9}\n",
              {"unknown key 'training.momentum'"});
}

TEST(RecipeDefaults, TheRegistryListsEveryMethod) {
  std::vector<std::string> names;
  for (const MethodSpec* spec : methods::AllSpecs()) names.push_back(spec->name());
  EXPECT_EQ(names, (std::vector<std::string>{"quip", "rtn", "gptq", "quarot", "prefixquant",
                                             "spinquant"}));
  EXPECT_EQ(methods::FindSpec("gptq"), methods::AllSpecs()[2]);
  EXPECT_EQ(methods::FindSpec("awq"), nullptr);
  // Every method's config reports its own name, and the recipe's method is that name.
  for (const std::string& name : names) {
    const Recipe r = MustParse("method: " + name + "\n");
    EXPECT_EQ(r.method, name);
    EXPECT_EQ(r.config->method(), name);
  }
}

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

TEST(RecipeErrors, UnknownTopLevelKeySuggestsTheClosest) {
  ExpectError("method: quip\nbitz: 2\n",
              {"unknown key 'bitz' (line 2)", "did you mean 'bits'?"});
  ExpectError("method: quip\nBits: 2\n", {"unknown key 'Bits' (line 2)", "did you mean 'bits'?"});
  ExpectError("method: quip\nincoherance: true\n",
              {"unknown key 'incoherance' (line 2)", "did you mean 'incoherence'?"});
}

TEST(RecipeErrors, UnknownKeyWithNothingCloseListsTheKnownKeys) {
  ExpectError("method: quip\nwhatever: 1\n",
              {"unknown key 'whatever' (line 2)", "known keys: name, method, seed, calibration, finetune, bits"});
}

TEST(RecipeErrors, UnknownNestedKeys) {
  ExpectError("method: quip\ncalibration:\n  files: [a]\n  seqlen: 64\n",
              {"unknown key 'calibration.seqlen' (line 4)", "did you mean 'calibration.seq_len'?"});
  ExpectError("method: gptq\nscalar:\n  grup_size: 64\n",
              {"unknown key 'scalar.grup_size' (line 3)", "did you mean 'scalar.group_size'?"});
  ExpectError("method: quip\nfinetune:\n  enabled: true\n  block:\n    epoch: 3\n",
              {"unknown key 'finetune.block.epoch' (line 5)", "did you mean 'finetune.block.epochs'?"});
  ExpectError("method: quip\nfinetune:\n  end_to_end: {enabled: true, lrr: 1}\n",
              {"unknown key 'finetune.end_to_end.lrr' (line 3)", "did you mean 'finetune.end_to_end.lr'?"});
  ExpectError("method: quip\nfinetune:\n  block: {enabled: true}\n",
              {"unknown key 'finetune.block.enabled' (line 3)", "'finetune.enabled'"});
}

TEST(RecipeErrors, WrongTypes) {
  ExpectError("name: x\nmethod: quip\nbits: two\n",
              {"key 'bits' (line 3) must be an integer, got 'two'"});
  ExpectError("method: quip\nbits: \"2\"\n",
              {"key 'bits' (line 2) must be an integer, got the quoted string \"2\""});
  ExpectError("method: quip\nbits: 2.0\n", {"key 'bits' (line 2) must be an integer, got '2.0'"});
  ExpectError("method: quip\nbits:\n", {"key 'bits' (line 2) must be an integer, got an empty value"});
  ExpectError("method: quip\nseed: -1\n",
              {"key 'seed' (line 2) must be a non-negative integer, got '-1'"});
  ExpectError("method: quip\nseed: 18446744073709551616\n", {"key 'seed' (line 2) is out of range"});
  ExpectError("method: quip\nincoherence: yes\n",
              {"key 'incoherence' (line 2) must be a boolean (true or false), got 'yes'"});
  ExpectError("method: quip\ndamp: small\n", {"key 'damp' (line 2) must be a number, got 'small'"});
  ExpectError("method: quip\ndamp: .nan\n", {"key 'damp' (line 2) must be a number"});
  ExpectError("method: quip\nname: [a, b]\n", {"key 'name' (line 2) must be a string, got a list"});
  ExpectError("method: quip\ncalibration: wikitext\n",
              {"key 'calibration' (line 2) must be a mapping, got 'wikitext'"});
  ExpectError("method: quip\ncalibration:\n  seq_len: long\n",
              {"key 'calibration.seq_len' (line 3) must be an integer, got 'long'"});
  ExpectError("method: quip\nfinetune:\n  block:\n    lr: fast\n",
              {"key 'finetune.block.lr' (line 4) must be a number, got 'fast'"});
  ExpectError("method: quip\nfinetune:\n  enabled: 1\n",
              {"key 'finetune.enabled' (line 3) must be a boolean"});
}

TEST(RecipeErrors, YamlSyntaxErrorsCarryTheParserTextAndLine) {
  ExpectError("method: quip\ncalibration:\n  files: [a, b\n", {"YAML error at line", "flow"});
  ExpectError("method: quip\nbits: *missing\n", {"YAML error at line 2", "anchor"});
  ExpectError("method: quip\n---\nmethod: rtn\n", {"more than one YAML document", "line 2"});
  // yaml-cpp 0.7's LoadAll loops forever on these (jbeder/yaml-cpp#1040); they must fail fast.
  ExpectError(",\n", {"YAML error"});
  ExpectError("# comment\n, b\nmethod: quip\n", {"YAML error"});
  ExpectError("method: quip\n---\n,\n", {"more than one YAML document"});
  ExpectError("method: quip\ncalibration:\n\tseq_len: 64\n",
              {"YAML error at line 3", "spaces, not tabs"});
  ExpectError("just a string\n", {"must be a mapping"});
  ExpectError("", {"empty", "'method' (quip, rtn, gptq, quarot, prefixquant or spinquant) is required"});
  ExpectError("# nothing but a comment\n", {"empty", "'method'"});
  // Too deep for the parser: said so, not yaml-cpp's "bad file".
  ExpectError("method: quip\nx: " + std::string(3000, '[') + std::string(3000, ']') + "\n",
              {"YAML nested too deeply at line 2", "levels"});
}

TEST(RecipeErrors, DuplicateKeys) {
  ExpectError("method: quip\nbits: 2\nbits: 3\n",
              {"duplicate key 'bits' (line 3, first at line 2)"});
  ExpectError("method: quip\ncalibration:\n  seed: 1\n  seed: 2\n",
              {"duplicate key 'calibration.seed' (line 4, first at line 3)"});
}

TEST(RecipeErrors, Method) {
  ExpectError("bits: 2\n", {"missing required key 'method'"});
  ExpectError("method: qiup\n",
              {"key 'method' (line 1) must be one of quip, rtn, gptq, quarot, prefixquant, spinquant, got 'qiup'",
               "did you mean 'quip'?"});
  ExpectError("method: awq\n",
              {"key 'method' (line 1) must be one of quip, rtn, gptq, quarot, prefixquant, spinquant, got 'awq'"});
}

TEST(RecipeErrors, QuipCodebookAndBits) {
  ExpectError("method: quip\ncodebook: e8\n",
              {"key 'codebook' (line 2) must be one of e8p, rvq3_e8p_e8", "got 'e8'",
               "did you mean 'e8p'?"});
  ExpectError("method: quip\nbits: 3\ncodebook: e8p\n",
              {"key 'bits' (line 2) is 3 but codebook 'e8p' (line 3) is a 2-bit codebook"});
  ExpectError("method: quip\ncodebook: rvq4_e8p_e8p\nbits: 2\n",
              {"key 'bits' (line 3) is 2 but codebook 'rvq4_e8p_e8p' (line 2) is a 4-bit"});
  ExpectError("method: quip\nbits: 5\n", {"key 'bits' (line 2) must be 2, 3 or 4 for method quip, got 5"});
  ExpectError("method: quip\nscalar: {group_size: 64}\n",
              {"key 'scalar' (line 2) applies only to methods rtn, gptq, quarot and spinquant, not quip"});
}

TEST(RecipeErrors, ScalarMethods) {
  ExpectError("method: rtn\ncodebook: e8p\n", {"key 'codebook' (line 2) applies only to method quip"});
  ExpectError("method: gptq\nbits: 9\n", {"key 'bits' (line 2) must be in 2..8 for method gptq, got 9"});
  ExpectError("method: rtn\nbits: 1\n", {"key 'bits' (line 2) must be in 2..8 for method rtn, got 1"});
  ExpectError("method: rtn\nscalar:\n  act_order: true\n",
              {"key 'scalar.act_order' (line 3) applies only to method gptq"});
  ExpectError("method: rtn\nincoherence: true\n",
              {"key 'incoherence' (line 2) applies only to method quip"});
  ExpectError("method: rtn\ndamp: 0.01\n", {"key 'damp' (line 2) does not apply to method rtn"});
  // The "off" values are accepted (ToJson writes them).
  EXPECT_FALSE(Scalar(MustParse("method: rtn\nincoherence: false\nscalar: {act_order: false}\n")).act_order);
}

TEST(RecipeErrors, Ranges) {
  ExpectError("method: quip\ndamp: 0\n", {"key 'damp' (line 2) must be in (0, 1], got 0"});
  ExpectError("method: gptq\ndamp: 1.5\n", {"key 'damp' (line 2) must be in (0, 1], got 1.5"});
  ExpectError("method: gptq\nscalar: {group_size: 0}\n",
              {"key 'scalar.group_size' (line 2) must be -1 (per output channel) or a positive"});
  ExpectError("method: gptq\nscalar:\n  group_size: -2\n", {"key 'scalar.group_size' (line 3)", "got -2"});
  ExpectError("method: quip\ncalibration:\n  num_sequences: 0\n",
              {"key 'calibration.num_sequences' (line 3) must be in [1, 1048576], got 0"});
  ExpectError("method: quip\ncalibration:\n  seq_len: 1\n",
              {"key 'calibration.seq_len' (line 3) must be in [2, 1048576], got 1"});
  ExpectError("method: quip\nfinetune:\n  block: {epochs: 0}\n",
              {"key 'finetune.block.epochs' (line 3) must be in [1, 65536], got 0"});
  ExpectError("method: quip\nfinetune:\n  block:\n    lr: 0\n",
              {"key 'finetune.block.lr' (line 4) must be greater than 0, got 0"});
  ExpectError("method: quip\nfinetune:\n  end_to_end:\n    lr: -1e-4\n",
              {"key 'finetune.end_to_end.lr' (line 4) must be greater than 0"});
  ExpectError("method: quip\nfinetune:\n  block:\n    batch: 0\n",
              {"key 'finetune.block.batch' (line 4) must be in [1, 1048576], got 0"});
  ExpectError("method: quip\nfinetune:\n  block:\n    holdout: 1\n",
              {"key 'finetune.block.holdout' (line 4) must be in [0, 1), got 1"});
  ExpectError("method: quip\nfinetune:\n  end_to_end: {holdout: -0.1}\n",
              {"key 'finetune.end_to_end.holdout' (line 3) must be in [0, 1)"});
}

// Sizes a recipe implies are bounded before anything is allocated: a typo such as
// num_sequences: 2000000000 is refused naming the key and the limit.
TEST(RecipeErrors, SizesAreBoundedBeforeAllocation) {
  ExpectError("method: quip\ncalibration:\n  num_sequences: 2000000000\n",
              {"key 'calibration.num_sequences' (line 3) must be in [1, 1048576], got 2000000000"});
  ExpectError("method: quip\ncalibration:\n  seq_len: 99999999\n",
              {"key 'calibration.seq_len' (line 3) must be in [2, 1048576], got 99999999"});
  ExpectError("method: quip\ncalibration: {num_sequences: 1048576, seq_len: 4096}\n",
              {"key 'calibration.num_sequences' (line 2)", "num_sequences × seq_len is at most "
               "2147483648 tokens, got 1048576 × 4096"});
  ExpectError("method: quip\nfinetune:\n  end_to_end: {epochs: 100000000}\n",
              {"key 'finetune.end_to_end.epochs' (line 3) must be in [1, 65536]"});
  // At the limits, accepted.
  EXPECT_TRUE(ParseRecipe("method: quip\ncalibration: {num_sequences: 4096, seq_len: 4096}\n",
                          kSource).ok());
}

// A recipe is UTF-8 text, for `qcal quantize` and `qcal submit` alike (its strings go into JSON
// and protobuf messages): any other byte, even in a comment, is refused with its place.
TEST(RecipeErrors, NonUtf8BytesAreRefusedWithTheirPlace) {
  ExpectError("method: quip\nname: caf\xe9\n",
              {"not UTF-8 text at line 2, byte 10 (0xe9)", "a recipe must be UTF-8"});
  ExpectError("method: quip  # \xff\n", {"not UTF-8 text at line 1, byte 17 (0xff)"});
  ExpectError("method: quip\ncalibration: {files: [\"a\xc3\"]}\n", {"line 2"});
  // Well-formed multi-byte text is fine.
  EXPECT_TRUE(ParseRecipe("method: quip\nname: caf\xc3\xa9  # \xe2\x9c\x93\n", kSource).ok());
}

// YAML allows no C0 control characters but tab, LF and CR. yaml-cpp read a NUL inside a quoted
// name as a stray 0xA0 byte, and the recipe's JSON then aborted (found by recipe_fuzz).
TEST(RecipeErrors, ControlCharactersAreRefusedWithTheirPlace) {
  ExpectError(std::string("#ic.\nname: w7a\"\"\"\"\"\"\"\"\"\0_\"\"\"\"\"\"\"ot\nmethod: quarot", 49),
              {"control character 0x00 at line 2, byte 19", "YAML does not allow it"});
  ExpectError("method: quip\nname: a\x01" "b\n", {"control character 0x01 at line 2, byte 8"});
  ExpectError("method: quip\x7f\n", {"control character 0x7f at line 1, byte 13"});
  EXPECT_TRUE(ParseRecipe("method: quip\r\nname:\tq\r\n", kSource).ok());
}

TEST(RecipeErrors, CalibrationFiles) {
  ExpectError("method: quip\ncalibration:\n  files: []\n",
              {"key 'calibration.files' (line 3) must list at least one file"});
  ExpectError("method: quip\ncalibration:\n  files: data/x.txt\n",
              {"key 'calibration.files' (line 3) must be a list of file paths, got 'data/x.txt'"});
  ExpectError("method: quip\ncalibration:\n  files:\n    - a.txt\n    - {b: 1}\n",
              {"key 'calibration.files' item 2 (line 5) must be a non-empty file path, got a mapping"});
  ExpectError("method: quip\nname: \"\"\n", {"key 'name' (line 2) must not be empty"});
}

TEST(LoadRecipe, MissingFileNamesThePath) {
  const std::string path = qcal::testing::MakeTempDir("recipe") + "/nope.yaml";
  StatusOr<Recipe> recipe = LoadRecipe(path);
  ASSERT_FALSE(recipe.ok());
  EXPECT_EQ(recipe.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(recipe.status().message().find(path), absl::string_view::npos) << recipe.status();
}

TEST(LoadRecipe, DirectoryIsRejected) {
  const std::string dir = qcal::testing::MakeTempDir("recipe");
  StatusOr<Recipe> recipe = LoadRecipe(dir);
  ASSERT_FALSE(recipe.ok());
  EXPECT_NE(recipe.status().message().find("not a regular file"), absl::string_view::npos)
      << recipe.status();
}

TEST(LoadRecipe, ErrorsNameTheFileAndNameDefaultsToTheStem) {
  const std::string dir = qcal::testing::MakeTempDir("recipe");
  {
    std::ofstream(dir + "/typo.yaml") << "# a recipe with a typo\nmethod: quip\nbitz: 2\n";
    StatusOr<Recipe> recipe = LoadRecipe(dir + "/typo.yaml");
    ASSERT_FALSE(recipe.ok());
    EXPECT_EQ(std::string(recipe.status().message()),
              dir + "/typo.yaml: unknown key 'bitz' (line 3); did you mean 'bits'?");
  }
  {
    std::ofstream(dir + "/my-job.yaml") << "method: rtn\nbits: 4\n";
    StatusOr<Recipe> recipe = LoadRecipe(dir + "/my-job.yaml");
    ASSERT_TRUE(recipe.ok()) << recipe.status();
    EXPECT_EQ(recipe->name, "my-job");
  }
}

}  // namespace
}  // namespace qcal

// ------------------------------------------------------------------------------------------
// QuaRot (method quarot)
// ------------------------------------------------------------------------------------------

namespace qcal {
namespace {

TEST(QuarotRecipes, DefaultsAndSections) {
  Recipe r = MustParse("method: quarot\n");
  EXPECT_EQ(r.method, "quarot");
  EXPECT_EQ(Weights(r), "gptq");
  EXPECT_EQ(r.bits(), 2);
  EXPECT_TRUE(NeedsHessians(r));
  EXPECT_TRUE(Rotation(r).enabled && Rotation(r).r1 && Rotation(r).r2 && Rotation(r).r3 &&
              Rotation(r).r4);
  EXPECT_FALSE(Activations(r).enabled());
  EXPECT_FALSE(KvCache(r).enabled());
  EXPECT_FALSE(Incoherence(r));
  EXPECT_TRUE(Codebook(r).empty());
  ExpectRoundTrip(r, "defaults");

  r = MustParse(
      "method: quarot\nweights: rtn\nbits: 4\nscalar: {clip_search: true}\n"
      "rotation: {r3: false, seed: 7}\n"
      "activations: {bits: 4, clip: 0.9}\n"
      "kv_cache: {bits: 3, group: 4, clip: 0.95}\n");
  EXPECT_EQ(Weights(r), "rtn");
  EXPECT_FALSE(NeedsHessians(r));
  EXPECT_FALSE(Rotation(r).r3);
  EXPECT_EQ(Rotation(r).seed, 7u);
  EXPECT_EQ(Activations(r).bits, 4);
  EXPECT_EQ(Activations(r).granularity, "per_token");
  EXPECT_EQ(KvCache(r).bits, 3);
  EXPECT_EQ(KvCache(r).group, 4);
  EXPECT_EQ(KvCache(r).granularity, "per_group");
  EXPECT_FALSE(KvCache(r).symmetric);
  ExpectRoundTrip(r, "rtn a4 kv3");
  EXPECT_FALSE(r.ToJson().contains("damp"));

  r = MustParse("method: quarot\nweights: none\nkv_cache: {bits: 4}\n");
  EXPECT_EQ(r.bits(), 16);
  EXPECT_FALSE(QuantizesWeights(r));
  EXPECT_FALSE(NeedsHessians(r));
  EXPECT_FALSE(r.ToJson().contains("bits"));
  EXPECT_FALSE(r.ToJson().contains("scalar"));
  ExpectRoundTrip(r, "kv only");

  r = MustParse(
      "method: quarot\nweights: rtn\nbits: 8\nscalar: {per_tensor: true}\n"
      "activations: {bits: 8, clip: 1.0, granularity: per_tensor, static: true}\n"
      "kv_cache: {bits: 8, granularity: per_tensor, static: true, symmetric: true}\n");
  EXPECT_TRUE(Scalar(r).per_tensor);
  EXPECT_TRUE(Activations(r).is_static);
  EXPECT_TRUE(KvCache(r).is_static);
  ExpectRoundTrip(r, "static per tensor");

  r = MustParse("method: quarot\nrotation: {r3: false}\nkv_cache: {bits: 4, format: bfp, "
                "group: 32, k_sort: true}\n");
  EXPECT_EQ(KvCache(r).format, "bfp");
  EXPECT_TRUE(KvCache(r).k_sort);
  EXPECT_FALSE(r.ToJson()["kv_cache"].contains("clip"));
  EXPECT_EQ(KvCache(r).key_point, "pre_rope");  // the K-sort paper's cache by default
  ExpectRoundTrip(r, "bfp k-sort");
  r = MustParse("method: quarot\nkv_cache: {bits: 4, format: bfp, key_point: post_rope}\n");
  EXPECT_EQ(KvCache(r).key_point, "post_rope");
  ExpectRoundTrip(r, "bfp post-rope");

  r = MustParse("method: quarot\nrotation: {enabled: false}\n");
  EXPECT_FALSE(Rotation(r).any());
  ExpectRoundTrip(r, "norot");
}

TEST(QuarotRecipes, ActivationRuleIsQcalByDefaultOrHummingWhereItApplies) {
  EXPECT_EQ(Activations(MustParse("method: quarot\nactivations: {bits: 4}\n")).rule, "qcal");
  EXPECT_FALSE(MustParse("method: quarot\nactivations: {bits: 4}\n")
                   .ToJson()["activations"]
                   .contains("rule"));  // recipes written before the key hash the same
  const Recipe humming =
      MustParse("method: quarot\nactivations: {bits: 4, clip: 1.0, rule: humming}\n");
  EXPECT_EQ(Activations(humming).rule, "humming");
  EXPECT_EQ(humming.ToJson()["activations"]["rule"], "humming");
  ExpectRoundTrip(humming, "humming a4");
  ExpectRoundTrip(MustParse("method: quarot\nactivations: {bits: 8, clip: 1.0, rule: humming}\n"),
                  "humming a8");
  ExpectError("method: quarot\nactivations: {bits: 4, rule: humming}\n",
              {"activations.rule", "clip: 1.0"});  // the default clip is 0.9
  ExpectError("method: quarot\nactivations: {bits: 3, clip: 1.0, rule: humming}\n",
              {"activations.rule", "bits 4 or 8"});
  ExpectError("method: quarot\nactivations: {bits: 4, clip: 1.0, granularity: per_tensor, "
              "rule: humming}\n",
              {"activations.rule", "per_token"});
  ExpectError("method: quarot\nactivations: {bits: 4, clip: 1.0, symmetric: false, "
              "rule: humming}\n",
              {"activations.rule", "symmetric"});
  ExpectError("method: quarot\nactivations: {bits: 4, rule: marlin}\n", {"activations.rule"});
}

TEST(QuarotRecipes, Fp8KvCacheIsStaticPerTensorWithNothingElseToSet) {
  const Recipe fp8 = MustParse("method: quarot\nkv_cache: {bits: 8, format: fp8}\n");
  EXPECT_EQ(KvCache(fp8).format, "fp8");
  EXPECT_TRUE(KvCache(fp8).is_static);
  EXPECT_EQ(KvCache(fp8).granularity, "per_tensor");
  EXPECT_EQ(fp8.ToJson()["kv_cache"], nlohmann::json({{"bits", 8}, {"format", "fp8"}}));
  ExpectRoundTrip(fp8, "fp8 kv");
  ExpectRoundTrip(MustParse("method: quarot\nkv_cache: {bits: 8, format: fp8, static: true}\n"),
                  "fp8 kv, static said");
  ExpectError("method: quarot\nkv_cache: {bits: 4, format: fp8}\n", {"kv_cache.bits", "8 (E4M3)"});
  ExpectError("method: quarot\nkv_cache: {bits: 8, format: fp8, static: false}\n",
              {"kv_cache.static", "must be true"});
  for (const char* key : {"granularity: per_token", "group: 4", "clip: 0.9", "symmetric: true",
                          "k_sort: true", "key_point: pre_rope"}) {
    ExpectError(std::string("method: quarot\nkv_cache: {bits: 8, format: fp8, ") + key + "}\n",
                {"does not apply to format fp8"});
  }
}

TEST(QuarotRecipes, R4BlockIsAbsentZeroAPowerOfTwoOrAuto) {
  EXPECT_EQ(Rotation(MustParse("method: quarot\n")).r4_block, 0);
  EXPECT_FALSE(MustParse("method: quarot\n").ToJson()["rotation"].contains("r4_block"));
  const Recipe eight = MustParse("method: quarot\nrotation: {r4_block: 8}\n");
  EXPECT_EQ(Rotation(eight).r4_block, 8);
  ExpectRoundTrip(eight, "r4_block 8");
  const Recipe automatic = MustParse("method: quarot\nrotation: {r4_block: auto}\n");
  EXPECT_EQ(Rotation(automatic).r4_block, RotationSpec::kR4BlockAuto);
  EXPECT_EQ(automatic.ToJson()["rotation"]["r4_block"], "auto");
  ExpectRoundTrip(automatic, "r4_block auto");
  ExpectError("method: quarot\nrotation: {r4_block: 6}\n",
              {"key 'rotation.r4_block' (line 2) must be 0 (the whole Hadamard), a power of two "
               ">= 2 or auto, got 6"});
  ExpectError("method: quarot\nrotation: {r4_block: big}\n", {"rotation.r4_block", "auto"});
}

TEST(QuarotRecipes, Errors) {
  ExpectError("method: quarot\nweights: gtpq\n",
              {"key 'weights' (line 2) must be rtn, gptq or none, got 'gtpq'",
               "did you mean 'gptq'?"});
  ExpectError("method: gptq\nrotation: {r1: true}\n",
              {"key 'rotation' (line 2) applies only to methods quarot, prefixquant and spinquant, not gptq"});
  ExpectError("method: rtn\nactivations: {bits: 4}\n",
              {"key 'activations' (line 2) applies only to methods quarot, prefixquant and spinquant, not rtn"});
  ExpectError("method: quarot\nweights: none\nbits: 4\n",
              {"key 'bits' (line 3) does not apply with 'weights: none' (line 2)"});
  ExpectError("method: quarot\nweights: rtn\ndamp: 0.01\n",
              {"key 'damp' (line 3) does not apply with 'weights: rtn'"});
  ExpectError("method: quarot\nweights: none\nscalar: {clip_search: true}\n",
              {"key 'scalar' (line 3) does not apply with 'weights: none'"});
  ExpectError("method: quarot\nweights: rtn\nscalar: {act_order: true}\n",
              {"key 'scalar.act_order' (line 3) applies only to 'weights: gptq', not rtn"});
  ExpectError("method: quarot\nscalar: {group_size: 64, per_tensor: true}\n",
              {"key 'scalar.per_tensor' (line 2) cannot be combined with group_size 64"});
  ExpectError("method: quarot\nrotation: {r5: true}\n",
              {"unknown key 'rotation.r5' (line 2)", "did you mean 'rotation.r1'?"});
  ExpectError("method: quarot\nactivations: {clip: 0.9}\n",
              {"key 'activations' (line 2) needs 'bits'"});
  ExpectError("method: quarot\nactivations: {bits: 9}\n",
              {"key 'activations.bits' (line 2) must be 2..8, or 16 (not quantized), got 9"});
  ExpectError("method: quarot\nactivations: {bits: 4, clip: 0}\n",
              {"key 'activations.clip' (line 2) must be in (0, 1], got 0"});
  ExpectError("method: quarot\nactivations: {bits: 4, granularity: per_tokn}\n",
              {"key 'activations.granularity' (line 2) must be per_token or per_tensor",
               "did you mean 'per_token'?"});
  ExpectError("method: quarot\nactivations:\n  bits: 8\n  static: true\n",
              {"key 'activations.static' (line 4) applies only to granularity per_tensor"});
  ExpectError("method: quarot\nkv_cache: {group: 8}\n", {"key 'kv_cache' (line 2) needs 'bits'"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, granularity: per_tensor}\n",
              {"key 'kv_cache.granularity' (line 2) per_tensor needs 'static: true'"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, group: -2}\n",
              {"key 'kv_cache.group' (line 2) must be 0 (= head_dim) or a positive"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, granularity: per_token, group: 4}\n",
              {"key 'kv_cache.group' (line 2) applies only to granularity per_group"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, format: bfp, clip: 0.9}\n",
              {"key 'kv_cache.clip' (line 2) applies only to format int"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, format: fp4}\n",
              {"key 'kv_cache.format' (line 2) must be int or bfp or fp8, got 'fp4'"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, k_sort: true}\n",
              {"key 'kv_cache.k_sort' (line 2) applies only to format bfp"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, key_point: pre_rope}\n",
              {"key 'kv_cache.key_point' (line 2) applies only to format bfp"});
  ExpectError("method: quarot\nkv_cache: {bits: 4, format: bfp, key_point: after}\n",
              {"kv_cache.key_point", "after", "pre_rope", "post_rope"});
  ExpectError("method: quarot\nrotation:\n  r3: true\nkv_cache: {bits: 4, format: bfp, k_sort: true}\n",
              {"key 'kv_cache.k_sort' (line 4) cannot be combined with rotation.r3", "(line 3)"});
  ExpectError("method: quarot\nfinetune: {enabled: true}\n",
              {"key 'finetune.enabled' (line 2) is not supported with method quarot"});
  ExpectError("method: quarot\ncodebook: e8p\n", {"key 'codebook' (line 2) applies only to method quip"});
  ExpectError("method: quarot\nincoherence: true\n",
              {"key 'incoherence' (line 2) applies only to method quip"});
}

// Every bundled quarot-X recipe has an unrotated twin X-norot that differs only in its name and
// rotation.enabled (so the pair measures the rotations and nothing else).
// Every bundled PrefixQuant recipe has its twin without the prefix, the same otherwise.
TEST(PrefixquantRecipes, BundledRecipesComeWithTwinsWithoutThePrefix) {
  int pairs = 0;
  for (const std::string& path : BundledRecipes()) {
    const std::string stem = std::filesystem::path(path).stem().string();
    if (stem.rfind("prefixquant-", 0) != 0 || stem.find("-noprefix") != std::string::npos) continue;
    SCOPED_TRACE(stem);
    StatusOr<Recipe> with = LoadRecipe(path);
    ASSERT_TRUE(with.ok()) << with.status();
    EXPECT_FALSE(with->needs().global_phases.empty());
    StatusOr<Recipe> without = LoadRecipe(JobsDir() + "/" + stem + "-noprefix.yaml");
    ASSERT_TRUE(without.ok()) << without.status();
    EXPECT_TRUE(without->needs().global_phases.empty());
    nlohmann::json a = with->ToJson(), b = without->ToJson();
    for (nlohmann::json* j : {&a, &b}) {
      j->erase("name");
      j->erase("prefix");
    }
    EXPECT_EQ(a, b) << a.dump(2) << "\nvs\n" << b.dump(2);
    ++pairs;
  }
  EXPECT_GE(pairs, 3);
}

TEST(QuarotRecipes, BundledRecipesComeInRotatedAndUnrotatedTwins) {
  int pairs = 0;
  for (const std::string& path : BundledRecipes()) {
    const std::string stem = std::filesystem::path(path).stem().string();
    if (stem.rfind("quarot-", 0) != 0) continue;
    SCOPED_TRACE(stem);
    StatusOr<Recipe> rotated = LoadRecipe(path);
    ASSERT_TRUE(rotated.ok()) << rotated.status();
    EXPECT_EQ(rotated->method, "quarot");
    EXPECT_TRUE(Rotation(*rotated).any());
    std::string twin = stem.substr(7);
    // A servable variant (R1/R2 only, "-r12"; R1/R2 and R4 in blocks, "-r124b") shares its
    // full-rotation twin's unrotated one.
    for (const std::string suffix : {"-r12", "-r124b"}) {
      if (twin.size() > suffix.size() &&
          twin.compare(twin.size() - suffix.size(), suffix.size(), suffix) == 0) {
        twin.resize(twin.size() - suffix.size());
      }
    }
    const size_t rtn = twin.rfind("-rtn");
    twin = rtn != std::string::npos && rtn + 4 == twin.size()
               ? twin.substr(0, rtn) + "-norot-rtn" : twin + "-norot";
    StatusOr<Recipe> plain = LoadRecipe(JobsDir() + "/" + twin + ".yaml");
    ASSERT_TRUE(plain.ok()) << plain.status();
    EXPECT_FALSE(Rotation(*plain).any());
    nlohmann::json a = rotated->ToJson(), b = plain->ToJson();
    for (nlohmann::json* j : {&a, &b}) {
      j->erase("name");
      j->erase("rotation");
    }
    EXPECT_EQ(a, b) << a.dump(2) << "\nvs\n" << b.dump(2);
    ++pairs;
  }
  EXPECT_GE(pairs, 13);
  // The named pair.
  StatusOr<Recipe> w4a4 = LoadRecipe(JobsDir() + "/quarot-w4a4kv4.yaml");
  ASSERT_TRUE(w4a4.ok()) << w4a4.status();
  EXPECT_EQ(Weights(*w4a4), "gptq");
  EXPECT_EQ(w4a4->bits(), 4);
  EXPECT_TRUE(Scalar(*w4a4).clip_search);
  EXPECT_TRUE(Scalar(*w4a4).symmetric);
  EXPECT_EQ(Scalar(*w4a4).group_size, -1);
  EXPECT_EQ(Activations(*w4a4).bits, 4);
  EXPECT_DOUBLE_EQ(Activations(*w4a4).clip, 0.9);
  EXPECT_EQ(Activations(*w4a4).granularity, "per_token");
  EXPECT_EQ(KvCache(*w4a4).bits, 4);
  EXPECT_FALSE(KvCache(*w4a4).symmetric);
  EXPECT_EQ(KvCache(*w4a4).group, 0);  // = head_dim
  EXPECT_DOUBLE_EQ(KvCache(*w4a4).clip, 0.95);
  // Its servable twins (issue 54): what vLLM's Humming kernels run, nothing online but R4 in
  // blocks.
  for (const char* name : {"quarot-w4a4-servable", "spinquant-w4a4-servable"}) {
    SCOPED_TRACE(name);
    StatusOr<Recipe> servable = LoadRecipe(JobsDir() + "/" + name + ".yaml");
    ASSERT_TRUE(servable.ok()) << servable.status();
    EXPECT_EQ(Weights(*servable), "gptq");
    EXPECT_EQ(servable->bits(), 4);
    EXPECT_TRUE(Scalar(*servable).symmetric);
    EXPECT_EQ(Scalar(*servable).group_size, -1);
    EXPECT_EQ(Activations(*servable).bits, 4);
    EXPECT_EQ(Activations(*servable).rule, "humming");
    EXPECT_DOUBLE_EQ(Activations(*servable).clip, 1.0);
    EXPECT_FALSE(KvCache(*servable).enabled());
    EXPECT_TRUE(Rotation(*servable).r1 && Rotation(*servable).r2 && Rotation(*servable).r4);
    EXPECT_FALSE(Rotation(*servable).r3);
    EXPECT_EQ(Rotation(*servable).r4_block, RotationSpec::kR4BlockAuto);
  }
}

}  // namespace
}  // namespace qcal
