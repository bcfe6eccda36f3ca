// libFuzzer entry point for job recipes (ParseRecipe: YAML, the common keys and every method's
// keys): any bytes give a recipe or an error status with a message; never a crash, an uncaught
// exception (yaml-cpp's or nlohmann's), or UB. An accepted recipe must serialize to valid
// UTF-8 JSON (it is journaled and sent over gRPC).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/utf8.h"
#include "methods/registry.h"
#include "tests/fuzz/fuzz_util.h"

using qcal::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto recipe = qcal::ParseRecipe(text, "fuzz/recipe.yaml");
  if (!recipe.ok()) {
    Check(!recipe.status().message().empty());
    return 0;
  }
  const std::string json = recipe->ToJson().dump();
  Check(qcal::IsValidUtf8(json));
  Check(recipe->calibration.num_sequences >= 0 && recipe->calibration.seq_len >= 0);
  return 0;
}
