// The trellis Viterbi pass at 8 lanes; built with -mavx2 -ffp-contract=off (kernels/trellis_pass.h).
#include "kernels/trellis_pass.h"

namespace qcal::kernels::trellis_internal {

const float* PassW8(int V, int KV, const PassArgs& a) { return DispatchPass<8>(V, KV, a); }

}  // namespace qcal::kernels::trellis_internal
