#include "kernels/codebook.h"

#include "kernels/e8_codebooks.h"
#include "kernels/e8p.h"

namespace qcal::kernels {

StatusOr<std::unique_ptr<VectorCodebook>> MakeCodebook(const std::string& name) {
  if (name == "e8p") return std::unique_ptr<VectorCodebook>(new E8pCodebook());
  if (name == "e8_1bit") return std::unique_ptr<VectorCodebook>(new E8OneBitCodebook());
  if (name == "rvq3_e8p_e8") return MakeRvqCodebook(name, kRvq3Scales);
  if (name == "rvq4_e8p_e8p") return MakeRvqCodebook(name, kRvq4Scales);
  for (int bits = 2; bits <= 4; ++bits) {
    if (name == "halfint" + std::to_string(bits)) {
      return std::unique_ptr<VectorCodebook>(new HalfIntegerGridCodebook(bits));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codebook '", name,
                   "' (expected e8p, e8_1bit, rvq3_e8p_e8, rvq4_e8p_e8p, halfint2, halfint3 or "
                   "halfint4)"));
}

}  // namespace qcal::kernels
