#include "kernels/codebook.h"

#include <algorithm>
#include <vector>

#include "kernels/e8_codebooks.h"
#include "kernels/e8p.h"
#include "kernels/trellis.h"

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
  if (name.rfind("qtip_", 0) == 0) {
    QCAL_ASSIGN_OR_RETURN(TrellisParams p, ParseTrellisName(name));
    return MakeTrellisCodebook(p);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codebook '", name,
                   "' (expected e8p, e8_1bit, rvq3_e8p_e8, rvq4_e8p_e8p, halfint2, halfint3, "
                   "halfint4 or qtip_<1mad|3inst|hyb>_l<L>_k<k>)"));
}

void DecodeMatrix(const VectorCodebook& cb, const uint32_t* codes, int64_t rows, int64_t cols,
                  float* out) {
  const int64_t g = cb.dim(), cw = cb.code_words(), blocks = cols / g;
  const int64_t joint = cb.joint_vectors();
  if (joint == 1) {  // row-major [rows, cols] is [rows·blocks, g] vectors in code order
    cb.Decode(codes, rows * blocks, out);
    return;
  }
  std::vector<uint32_t> unit_codes(joint * cw);
  std::vector<float> unit(joint * g);
  for (int64_t r0 = 0; r0 < rows; r0 += joint) {
    const int64_t count = std::min(joint, rows - r0);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < count; ++i) {
        const uint32_t* c = &codes[((r0 + i) * blocks + b) * cw];
        std::copy(c, c + cw, &unit_codes[i * cw]);
      }
      cb.Decode(unit_codes.data(), count, unit.data());
      for (int64_t i = 0; i < count; ++i) {
        std::copy(&unit[i * g], &unit[(i + 1) * g], &out[(r0 + i) * cols + b * g]);
      }
    }
  }
}

}  // namespace qcal::kernels
