// libFuzzer entry point for config.json (ParseLlamaConfig): any bytes give a config satisfying
// the documented invariants or an error status; never a crash, an uncaught exception, or UB.
// An accepted config must also survive a write and a re-read unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/hf_config.h"
#include "tests/fuzz/fuzz_util.h"

using qcal::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = qcal::ParseLlamaConfig(text, "fuzz/config.json");
  if (!config.ok()) {
    Check(!config.status().message().empty());
    return 0;
  }
  Check(config->hidden_size > 0 && config->num_hidden_layers > 0 && config->vocab_size > 0);
  Check(config->num_attention_heads > 0 && config->num_key_value_heads > 0 &&
        config->head_dim > 0);
  Check(config->num_attention_heads % config->num_key_value_heads == 0);
  const std::string again = qcal::LlamaConfigToJson(*config).dump(
      2, ' ', false, nlohmann::json::error_handler_t::replace);
  auto reread = qcal::ParseLlamaConfig(again, "fuzz/config.json (rewritten)");
  Check(reread.ok());
  Check(reread->hidden_size == config->hidden_size &&
        reread->num_hidden_layers == config->num_hidden_layers &&
        reread->vocab_size == config->vocab_size && reread->head_dim == config->head_dim);
  return 0;
}
