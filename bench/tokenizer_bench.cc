// Single-threaded encoding speed of a tokenizer on a text file (best of N runs), as JSON on one
// line. bench/tokenizer-vs-js.sh runs it beside the JS reference tokenizer on the same file.
//
//   build/bench/bench_tokenizer MODEL_DIR_OR_TOKENIZER_JSON FILE [RUNS]
#include <chrono>
#include <cstdio>
#include <string>

#include <sys/stat.h>

#include "common/atomic_file.h"
#include "common/hf_tokenizer.h"
#include "common/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR|tokenizer.json FILE [RUNS]\n", argv[0]);
    return 2;
  }
  const std::string source = argv[1];
  struct stat st;
  const bool is_dir = ::stat(source.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  auto tok = is_dir ? qcal::LoadTokenizerFromModelDir(source) : qcal::LoadHfTokenizer(source);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  auto text = qcal::ReadFile(argv[2]);
  if (!text.ok()) {
    std::fprintf(stderr, "%s\n", text.status().ToString().c_str());
    return 1;
  }
  const int runs = argc > 3 ? std::stoi(argv[3]) : 5;
  double best = 1e300;
  size_t tokens = 0;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = (*tok)->Encode(*text).size();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ms);
  }
  std::printf("{\"file\":\"%s\",\"bytes\":%zu,\"tokens\":%zu,\"best_ms\":%.1f}\n", argv[2],
              text->size(), tokens, best);
  return 0;
}
