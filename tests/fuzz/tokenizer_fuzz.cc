// libFuzzer entry point for tokenizer files: the first byte picks the format (sentencepiece
// tokenizer.model, a protobuf; or llama2.c tokenizer .bin), the rest is the file. Any bytes give
// a tokenizer or an error status; a tokenizer that loads must then encode and decode a fixed
// text (with bytes outside any vocabulary) without a crash and with ids in its vocabulary.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/tokenizer.h"

namespace {
void Check(bool condition) {
  if (!condition) std::abort();
}

// The fuzz input as a file (the loaders read paths), in memory-backed /dev/shm when present.
std::string WriteInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/qcal-tokenizer-fuzz-" + std::to_string(::getpid());
  }();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool sentencepiece = data[0] & 1;
  const std::string path = WriteInput(data + 1, size - 1);
  auto tok = sentencepiece ? qcal::LoadSentencePieceTokenizer(path)
                           : qcal::LoadLlama2cTokenizer(path, 0);
  if (!tok.ok()) {
    Check(!tok.status().message().empty());
    return 0;
  }
  const std::string text = "Once upon a time, \xE2\x96\x81 caf\xC3\xA9 \xF0\x9F\x98\x80 \xFF\x00!";
  const std::vector<int32_t> ids = (*tok)->Encode(text);
  for (int32_t id : ids) Check(id >= 0 && id < (*tok)->vocab_size());
  (void)(*tok)->Decode(ids);
  (void)(*tok)->Decode({-1, 0, (*tok)->vocab_size(), 1 << 30});
  return 0;
}
