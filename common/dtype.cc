#include "common/dtype.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace qcal {
namespace {

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  size_t size;
};

// Indexed by the enum's value; the static_assert below keeps the two in step.
constexpr DTypeEntry kDTypes[] = {
    {DType::kF64, "F64", 8},  {DType::kF32, "F32", 4},  {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8},  {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},  {DType::kI8, "I8", 1},    {DType::kU64, "U64", 8},
    {DType::kU32, "U32", 4},  {DType::kU16, "U16", 2},  {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};
constexpr size_t kNumDTypes = sizeof(kDTypes) / sizeof(kDTypes[0]);
static_assert(kNumDTypes == static_cast<size_t>(DType::kBool) + 1, "kDTypes must list every DType");

constexpr bool EntriesInEnumOrder() {
  for (size_t i = 0; i < kNumDTypes; ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(EntriesInEnumOrder(), "kDTypes must be in enum order");

const DTypeEntry* Lookup(DType dtype) {
  const size_t i = static_cast<size_t>(dtype);
  return i < kNumDTypes ? &kDTypes[i] : nullptr;
}

uint32_t FloatBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

size_t DTypeSize(DType dtype) {
  const DTypeEntry* entry = Lookup(dtype);
  return entry ? entry->size : 0;
}

std::string_view DTypeName(DType dtype) {
  const DTypeEntry* entry = Lookup(dtype);
  return entry ? entry->name : std::string_view("INVALID");
}

StatusOr<DType> ParseDType(std::string_view name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  std::vector<std::string_view> known;
  for (const DTypeEntry& entry : kDTypes) known.push_back(entry.name);
  std::string joined;
  for (std::string_view known_name : known) {
    if (!joined.empty()) joined += ' ';
    joined.append(known_name.data(), known_name.size());
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", std::string(name), "' (known: ", joined, ")"));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {  // inf / nan: keep the payload
    return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return BitsToFloat(sign);  // signed zero
    // Subnormal half: value = mantissa * 2^-24. Normalise into a float.
    int32_t e = -14;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    mantissa &= 0x3ffu;
    return BitsToFloat(sign | (static_cast<uint32_t>(e + 127) << 23) | (mantissa << 13));
  }
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float f) {
  const uint32_t bits = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t exponent = (bits >> 23) & 0xffu;
  uint32_t mantissa = bits & 0x7fffffu;

  if (exponent == 0xff) {
    if (mantissa == 0) return sign | 0x7c00u;  // infinity
    // NaN: keep the top payload bits and force the quiet bit so it cannot become infinity.
    return static_cast<uint16_t>(sign | 0x7c00u | 0x200u | (mantissa >> 13));
  }
  // Unbiased exponent re-biased for half.
  const int32_t e = static_cast<int32_t>(exponent) - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00u;  // too large even before rounding: infinity
  if (e <= 0) {
    // Result is subnormal (or zero). Values below 2^-25 round to zero; exactly 2^-25 rounds to
    // even (zero) as well, which the general path below also produces.
    if (e < -10) return sign;
    mantissa |= 0x800000u;  // implicit leading one
    const uint32_t shift = static_cast<uint32_t>(14 - e);  // 14..24
    uint32_t half_mantissa = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) {
      ++half_mantissa;  // may carry into the smallest normal, which is the right answer
    }
    return static_cast<uint16_t>(sign | half_mantissa);
  }
  uint32_t half = (static_cast<uint32_t>(e) << 10) | (mantissa >> 13);
  const uint32_t remainder = mantissa & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u))) {
    ++half;  // a carry out of the mantissa bumps the exponent; 0x7c00 is infinity, as it should be
  }
  return static_cast<uint16_t>(sign | half);
}

float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu) != 0) {
    // NaN: truncate and set the quiet bit so the payload cannot round into infinity.
    return static_cast<uint16_t>((bits >> 16) | 0x40u);
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

namespace {

template <typename T>
T LoadLE(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void StoreLE(T v, uint8_t* p) {
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace

bool IsFloatingDType(DType d) {
  return d == DType::kF32 || d == DType::kF64 || d == DType::kF16 || d == DType::kBF16;
}

void ConvertToF32(DType dtype, const uint8_t* src, size_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(out, src, n * sizeof(float));
      break;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(LoadLE<double>(src + 8 * i));
      break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(LoadLE<uint16_t>(src + 2 * i));
      break;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(LoadLE<uint16_t>(src + 2 * i));
      break;
    default:
      break;
  }
}

void ConvertFromF32(DType dtype, const float* src, size_t n, uint8_t* out) {
  switch (dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(out, src, n * sizeof(float));
      break;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) StoreLE<double>(src[i], out + 8 * i);
      break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) StoreLE<uint16_t>(FloatToHalf(src[i]), out + 2 * i);
      break;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) StoreLE<uint16_t>(FloatToBFloat16(src[i]), out + 2 * i);
      break;
    default:
      break;
  }
}

}  // namespace qcal
