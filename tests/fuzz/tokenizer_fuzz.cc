// libFuzzer entry point for tokenizer files: the first byte picks the format (sentencepiece
// tokenizer.model, a protobuf; or llama2.c tokenizer .bin), the rest is the file. Any bytes give
// a tokenizer or an error status; a tokenizer that loads must then encode and decode a fixed
// text (with bytes outside any vocabulary) without a crash and with ids in its vocabulary.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

using qcal::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool sentencepiece = data[0] & 1;
  const std::string path = qcal::fuzz::WriteInput("tokenizer", data + 1, size - 1);
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
