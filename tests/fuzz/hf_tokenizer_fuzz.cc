// libFuzzer entry point for Hugging Face tokenizer.json files (ParseHfTokenizer): any bytes give
// a tokenizer or an error status with a message, never a crash, an uncaught exception (nlohmann's)
// or UB. The first byte picks whether special tokens are parsed; a tokenizer that loads must then
// encode and decode a fixed text (with special-token look-alikes, malformed UTF-8 and characters
// outside any vocabulary) with ids in its vocabulary.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/hf_tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

using qcal::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  qcal::HfTokenizerOptions options;
  options.parse_special = data[0] & 1;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  auto tok = qcal::ParseHfTokenizer(text, "fuzz/tokenizer.json", options);
  if (!tok.ok()) {
    Check(!tok.status().message().empty());
    return 0;
  }
  const std::string sample =
      "Once upon a time,  \n\n caf\xC3\xA9 \xE2\x96\x81 <s> <|begin_of_text|> 123456 "
      "\xF0\x9F\xA6\x99 \xFF\x00 it's";
  const std::vector<int32_t> ids = (*tok)->Encode(sample);
  for (int32_t id : ids) Check(id >= 0 && id < (*tok)->vocab_size());
  (void)(*tok)->Decode(ids);
  (void)(*tok)->Decode({-1, 0, (*tok)->vocab_size(), 1 << 30});
  return 0;
}
