// `qcal quantize`: run a quantization job in this process (no coordinator).
#pragma once

namespace CLI {
class App;
}

namespace qcal::client {

// Registers `quantize` on `app`; the callback stores the exit code in *exit_code.
void AddQuantizeCommand(CLI::App& app, int* exit_code);

}  // namespace qcal::client
