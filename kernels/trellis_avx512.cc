// The trellis Viterbi pass at 16 lanes; built with -mavx512f -ffp-contract=off
// (kernels/trellis_pass.h).
#include "kernels/trellis_pass.h"

namespace qcal::kernels::trellis_internal {

const float* PassW16(int V, int KV, const PassArgs& a) { return DispatchPass<16>(V, KV, a); }

}  // namespace qcal::kernels::trellis_internal
