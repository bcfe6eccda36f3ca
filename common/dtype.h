// Element types of tensors stored in safetensors files, with their safetensors names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace qcal {

enum class DType : uint8_t {
  kF64, kF32, kF16, kBF16,
  kI64, kI32, kI16, kI8,
  kU64, kU32, kU16, kU8,
  kBool,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors spelling: "F32", "BF16", "I8", "U16", "BOOL", ...
std::string_view DTypeName(DType dtype);
// Parses a safetensors dtype name; InvalidArgument naming the string when unknown.
StatusOr<DType> ParseDType(std::string_view name);

// IEEE half and bfloat16 conversions (round to nearest even on the way down).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

// Floating dtypes: F64, F32, F16, BF16.
bool IsFloatingDType(DType dtype);
// n values of floating `dtype` stored little-endian at src (any alignment) -> float32.
void ConvertToF32(DType dtype, const uint8_t* src, size_t n, float* out);
// n float32 values -> floating `dtype` at out (little-endian; F16/BF16 round to nearest even).
void ConvertFromF32(DType dtype, const float* src, size_t n, uint8_t* out);

}  // namespace qcal
