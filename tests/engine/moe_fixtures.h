// The mixture-of-experts models of the MoE tests (engine_moe_model_test,
// engine_moe_calibration_test): upcycled by the independent reference
// tests/reference/moe_reference.py from one random dense Llama with GQA (hidden 64, 4 heads, 2 KV
// heads, 4 layers, vocabulary kMoeVocab), made once per process. Needs /usr/bin/python3 with numpy.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace qcal::testing {

inline constexpr int64_t kMoeVocab = 100;

inline void Shell(const std::string& cmd) { ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd; }

// "/usr/bin/python3 <source>/tests/reference/": the reference scripts' command prefix.
inline std::string ReferencePython() {
  return "/usr/bin/python3 " + SourceDir() + "/tests/reference/";
}

// The dense model every MoE test model is upcycled from.
inline const std::string& MoeDenseDir() {
  static const std::string dir = [] {
    const std::string d = MakeTempDir("moe-dense");
    Shell(absl::StrCat(ReferencePython(), "llama_reference.py make --out ", d,
                       " --seed 7 --hidden 64 --intermediate 96 --heads 4 --kv-heads 2",
                       " --layers 4 --vocab ", kMoeVocab, " --max-position-embeddings 64",
                       " --std 0.1"));
    return d;
  }();
  return dir;
}

// A MoE model upcycled from MoeDenseDir(): 4 experts, each its block's MLP with 5% relative
// noise (seed 3), and the layout and options `args` name ("--layout mixtral", ...).
inline std::string UpcycleMoe(const std::string& name, const std::string& args) {
  const std::string dir = MakeTempDir("moe-" + name);
  Shell(absl::StrCat(ReferencePython(), "moe_reference.py upcycle --dense ", MoeDenseDir(),
                     " --out ", dir, " --experts 4 --noise 0.05 --seed 3 ", args));
  return dir;
}

}  // namespace qcal::testing
