// Tests for common/dtype and common/safetensors: conversions against known bit patterns, the
// reader's validation of every malformed-file case, writer round trips and sharded checkpoints.
#include "common/safetensors.h"

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "common/dtype.h"
#include "common/hash.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

// Asserts `status` has `code` and its message contains every phrase.
void ExpectError(const Status& status, absl::StatusCode code,
                 std::initializer_list<std::string> phrases) {
  ASSERT_FALSE(status.ok()) << "expected an error";
  EXPECT_EQ(status.code(), code) << status;
  const std::string message(status.message());
  for (const std::string& phrase : phrases) {
    EXPECT_NE(message.find(phrase), std::string::npos)
        << "message \"" << message << "\" lacks \"" << phrase << "\"";
  }
}

float Bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t BitsOf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// A fresh directory under the test temp dir, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = qcal::testing::MakeTempDir("qcal_safetensors");
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Writes raw bytes to dir/name and returns the path.
  std::string WriteRaw(const std::string& name, const std::string& bytes) const {
    const std::string path = Path(name);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << path;
    return path;
  }

  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string dir_;
};

std::string LittleEndian64(uint64_t value) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file: 8-byte length, header text, data bytes.
std::string MakeFile(const std::string& header, const std::string& data) {
  return LittleEndian64(header.size()) + header + data;
}

// A file whose data section is `data_bytes` zero bytes.
std::string MakeFile(const std::string& header, size_t data_bytes) {
  return MakeFile(header, std::string(data_bytes, '\0'));
}

class SafetensorsMalformedTest : public TempDirTest {
 protected:
  // Writes `bytes` to bad.safetensors, opens it, and checks the error.
  void ExpectOpenError(const std::string& bytes, absl::StatusCode code,
                       std::initializer_list<std::string> phrases) {
    const std::string path = WriteRaw("bad.safetensors", bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << "opened a malformed file";
    ExpectError(file.status(), code, phrases);
    // The message names the file.
    EXPECT_NE(std::string(file.status().message()).find("bad.safetensors"), std::string::npos)
        << file.status().message();
    // The pure parser agrees on code (its source is the given name).
    auto parsed = ParseSafetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                   "mem.safetensors");
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), code);
    EXPECT_NE(std::string(parsed.status().message()).find("mem.safetensors"), std::string::npos);
  }
};

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

// ---------------------------------------------------------------------------------------------
// dtype
// ---------------------------------------------------------------------------------------------

TEST(DTypeTest, NamesSizesAndParse) {
  struct Case {
    DType dtype;
    const char* name;
    size_t size;
  };
  const Case cases[] = {
      {DType::kF64, "F64", 8},  {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2},
      {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
      {DType::kI16, "I16", 2},  {DType::kI8, "I8", 1},   {DType::kU64, "U64", 8},
      {DType::kU32, "U32", 4},  {DType::kU16, "U16", 2}, {DType::kU8, "U8", 1},
      {DType::kBool, "BOOL", 1},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(DTypeName(c.dtype), c.name);
    EXPECT_EQ(DTypeSize(c.dtype), c.size) << c.name;
    auto parsed = ParseDType(c.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, c.dtype) << c.name;
  }
}

TEST(DTypeTest, ParseUnknownNamesTheString) {
  ExpectError(ParseDType("F8_E4M3").status(), kInvalid, {"unknown dtype 'F8_E4M3'"});
  ExpectError(ParseDType("f32").status(), kInvalid, {"'f32'"});  // case matters
  ExpectError(ParseDType("").status(), kInvalid, {"unknown dtype ''"});
}

TEST(DTypeTest, FloatToHalfKnownPatterns) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.5f), 0x3800);
  EXPECT_EQ(FloatToHalf(0.1f), 0x2E66);
  EXPECT_EQ(FloatToHalf(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);  // largest finite half
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);  // below the midpoint to infinity
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // midpoint rounds to even: infinity
  EXPECT_EQ(FloatToHalf(1e10f), 0x7C00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xFC00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // half-way to 2^-24: ties to even (0)
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: ties to even (2)
  EXPECT_EQ(FloatToHalf(-std::ldexp(1.0f, -26)), 0x8000);  // underflow keeps the sign
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
  // Ties between normals: 1 + 2^-11 sits between 0x3C00 and 0x3C01.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  // Rounding up carries into the exponent: the largest value below 2 that rounds to 2.
  EXPECT_EQ(FloatToHalf(std::nextafter(2.0f, 0.0f)), 0x4000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xFC00);
  const uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x03FF, 0);
  // A signalling NaN whose payload sits only in the low bits must stay a NaN (not become inf).
  const uint16_t snan = FloatToHalf(Bits(0x7F800001u));
  EXPECT_EQ(snan & 0x7C00, 0x7C00);
  EXPECT_NE(snan & 0x03FF, 0);
  EXPECT_EQ(FloatToHalf(Bits(0xFFC00000u)) & 0x8000, 0x8000);  // negative NaN keeps its sign
}

TEST(DTypeTest, HalfToFloatKnownPatterns) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(HalfToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(BitsOf(HalfToFloat(0x0000)), 0x00000000u);
  EXPECT_EQ(BitsOf(HalfToFloat(0x8000)), 0x80000000u);
  EXPECT_EQ(HalfToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0xFE00)));
}

TEST(DTypeTest, HalfRoundTripsEveryPattern) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if ((h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      const uint16_t back = FloatToHalf(f);
      ASSERT_TRUE((back & 0x7C00) == 0x7C00 && (back & 0x03FF) != 0) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

// For every pair of adjacent positive halves (subnormals and the overflow boundary included), the
// exact midpoint rounds to the even one and its float neighbours round to the nearer one.
TEST(DTypeTest, FloatToHalfRoundsToNearestEvenAtEveryMidpoint) {
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const double lo = HalfToFloat(static_cast<uint16_t>(h));
    const double hi = h + 1 == 0x7C00 ? 65536.0 : HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: 12 significant bits
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
    ASSERT_EQ(FloatToHalf(mid), even) << std::hex << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 1e30f)), h + 1) << std::hex << h;
    ASSERT_EQ(FloatToHalf(-mid), even | 0x8000) << std::hex << h;
  }
}

TEST(DTypeTest, BFloat16KnownPatterns) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBFloat16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(3.140625f), 0x4049);
  EXPECT_EQ(FloatToBFloat16(0.1f), 0x3DCD);  // 0x3DCCCCCD rounds up
  // 1 + 2^-8 is the midpoint between 0x3F80 and 0x3F81: ties to even.
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to infinity
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(FloatToBFloat16(Bits(0x00012345u)), 0x0001);  // float subnormal rounds
  EXPECT_EQ(FloatToBFloat16(Bits(0x00008000u)), 0x0000);  // subnormal tie to even
  EXPECT_EQ(FloatToBFloat16(Bits(0x00018000u)), 0x0002);
  // NaNs stay NaN, including a signalling NaN whose payload lies only in the dropped bits.
  for (uint32_t nan_bits : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    const uint16_t b = FloatToBFloat16(Bits(nan_bits));
    EXPECT_EQ(b & 0x7F80, 0x7F80) << std::hex << nan_bits;
    EXPECT_NE(b & 0x007F, 0) << std::hex << nan_bits;
    EXPECT_EQ(b & 0x8000, (nan_bits >> 16) & 0x8000) << std::hex << nan_bits;
  }
  EXPECT_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
  EXPECT_EQ(BFloat16ToFloat(0xFF80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(0x7FC0)));
  EXPECT_EQ(BitsOf(BFloat16ToFloat(0x0001)), 0x00010000u);
}

TEST(DTypeTest, BFloat16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(f)))) << std::hex << b;
      continue;
    }
    ASSERT_EQ(FloatToBFloat16(f), b) << std::hex << b;
  }
}

// ---------------------------------------------------------------------------------------------
// Malformed files: one test per failure class, each checking the code, the file name and the
// specific phrase.
// ---------------------------------------------------------------------------------------------

TEST_F(SafetensorsMalformedTest, EmptyFile) {
  ExpectOpenError("", kDataLoss, {"file is 0 bytes", "too short"});
}

TEST_F(SafetensorsMalformedTest, ShorterThanLengthPrefix) {
  ExpectOpenError(std::string(5, '\x01'), kDataLoss, {"file is 5 bytes", "8-byte header length"});
}

TEST_F(SafetensorsMalformedTest, HeaderLengthPastEndOfFile) {
  std::string bytes = LittleEndian64(1000) + std::string(42, ' ');
  ExpectOpenError(bytes, kDataLoss, {"header length 1000 extends past the end of the file (50 bytes"});
}

TEST_F(SafetensorsMalformedTest, OversizeHeaderIsRejectedBeforeAnyRead) {
  std::string bytes = LittleEndian64(200'000'000) + "{}";
  ExpectOpenError(bytes, kInvalid, {"header length 200000000 exceeds the limit of 100000000"});
  // A length with the top bit set (would overflow naive 8 + N arithmetic).
  ExpectOpenError(LittleEndian64(~uint64_t{0}) + "{}", kInvalid, {"exceeds the limit"});
}

TEST_F(SafetensorsMalformedTest, DataCutShort) {
  const std::string header =
      R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  ExpectOpenError(MakeFile(header, 12), kInvalid,
                  {"tensor 'w'", "data_offsets [0, 16) extend past the end of the data section (12 bytes"});
}

TEST_F(SafetensorsMalformedTest, HeaderNotJson) {
  ExpectOpenError(MakeFile("{\"w\": nope}", 0), kInvalid, {"header is not valid JSON", "syntax error"});
  ExpectOpenError(MakeFile("", 0), kInvalid, {"header is not valid JSON"});
  // Invalid UTF-8 inside a string is a JSON error too.
  ExpectOpenError(MakeFile("{\"\xff\xfe\":1}", 0), kInvalid, {"header is not valid JSON"});
  // Trailing garbage after the object.
  ExpectOpenError(MakeFile("{} x", 0), kInvalid, {"header is not valid JSON"});
}

TEST_F(SafetensorsMalformedTest, HeaderNotObject) {
  ExpectOpenError(MakeFile("[1, 2]", 0), kInvalid, {"header must be a JSON object, got array"});
  ExpectOpenError(MakeFile("42", 0), kInvalid, {"header must be a JSON object, got integer"});
}

TEST_F(SafetensorsMalformedTest, UnknownDType) {
  const std::string header = R"({"w":{"dtype":"F8","shape":[4],"data_offsets":[0,4]}})";
  ExpectOpenError(MakeFile(header, 4), kInvalid, {"tensor 'w'", "unknown dtype 'F8'"});
  const std::string not_string = R"({"w":{"dtype":4,"shape":[4],"data_offsets":[0,4]}})";
  ExpectOpenError(MakeFile(not_string, 4), kInvalid, {"tensor 'w'", "dtype must be a string, got integer"});
}

TEST_F(SafetensorsMalformedTest, ShapeSizeMismatch) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,12]}})";
  ExpectOpenError(MakeFile(header, 12), kInvalid,
                  {"bad.safetensors: tensor 'x': data_offsets [0, 12) do not match shape [2, 3] x F32 "
                   "(24 bytes)"});
}

TEST_F(SafetensorsMalformedTest, ShapeOverflow) {
  // 2^40 * 2^40 elements overflows 64 bits; the check must not wrap around to a small number.
  const std::string header =
      R"({"x":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}})";
  ExpectOpenError(MakeFile(header, 0), kInvalid, {"tensor 'x'", "too many elements"});
  // numel fits, bytes do not: 2^62 x F32.
  const std::string bytes_overflow =
      R"({"x":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})";
  ExpectOpenError(MakeFile(bytes_overflow, 0), kInvalid, {"tensor 'x'", "overflows 64 bits"});
  // Dimensions beyond int64.
  const std::string huge = R"({"x":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})";
  ExpectOpenError(MakeFile(huge, 0), kInvalid, {"tensor 'x'", "too large"});
}

TEST_F(SafetensorsMalformedTest, NegativeShape) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}})";
  ExpectOpenError(MakeFile(header, 8), kInvalid, {"tensor 'x'", "negative dimension -1"});
}

TEST_F(SafetensorsMalformedTest, ShapeNotListOfIntegers) {
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"F32","shape":4,"data_offsets":[0,16]}})", 16),
                  kInvalid, {"tensor 'x'", "shape must be a list of integers, got integer"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
                  kInvalid, {"tensor 'x'", "shape must be a list of integers, found number"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8),
                  kInvalid, {"tensor 'x'", "found string"});
}

TEST_F(SafetensorsMalformedTest, BadDataOffsets) {
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4,8]}})", 4),
                  kInvalid, {"tensor 'x'", "data_offsets must be a list of two non-negative integers"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[-4,0]}})", 4),
                  kInvalid, {"tensor 'x'", "two non-negative integers"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":"0-4"}})", 4),
                  kInvalid, {"tensor 'x'", "got string"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 4),
                  kInvalid, {"tensor 'x'", "data_offsets [4, 0) are reversed"});
}

TEST_F(SafetensorsMalformedTest, OutOfRangeOffsets) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})";
  ExpectOpenError(MakeFile(header, 8), kInvalid,
                  {"tensor 'x'", "data_offsets [16, 24) extend past the end of the data section (8 bytes"});
  // An end near 2^64 must not wrap in any sum.
  const std::string wrap =
      R"({"x":{"dtype":"U8","shape":[8],"data_offsets":[18446744073709551608,18446744073709551615]}})";
  ExpectOpenError(MakeFile(wrap, 8), kInvalid, {"tensor 'x'"});
}

TEST_F(SafetensorsMalformedTest, OverlappingOffsets) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  ExpectOpenError(MakeFile(header, 12), kInvalid,
                  {"tensor 'b': data_offsets [4, 12) overlap tensor 'a' [0, 8)"});
  // An empty tensor placed inside another one overlaps it as well.
  const std::string inside =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
  ExpectOpenError(MakeFile(inside, 8), kInvalid, {"tensor 'e'", "overlap tensor 'a'"});
  // Two tensors with the same range.
  const std::string same =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})";
  ExpectOpenError(MakeFile(same, 8), kInvalid, {"tensor 'b'", "overlap tensor 'a'"});
}

TEST_F(SafetensorsMalformedTest, HoleInData) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  ExpectOpenError(MakeFile(header, 12), kInvalid,
                  {"hole in the data section: bytes [4, 8) belong to no tensor", "'b'"});
  // Extra bytes after the last tensor.
  const std::string trailing = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  ExpectOpenError(MakeFile(trailing, 10), kInvalid, {"hole in the data section: bytes [4, 10)"});
  // A gap at the very start.
  const std::string leading = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  ExpectOpenError(MakeFile(leading, 8), kInvalid, {"bytes [0, 4) belong to no tensor"});
  // No tensors but data.
  ExpectOpenError(MakeFile("{}", 3), kInvalid, {"bytes [0, 3)"});
}

TEST_F(SafetensorsMalformedTest, MetadataNotStrings) {
  ExpectOpenError(MakeFile(R"({"__metadata__":{"format":"pt","step":1}})", 0), kInvalid,
                  {"__metadata__ value for key 'step' must be a string, got integer"});
  ExpectOpenError(MakeFile(R"({"__metadata__":{"k":null}})", 0), kInvalid,
                  {"key 'k' must be a string, got null"});
  ExpectOpenError(MakeFile(R"({"__metadata__":["a"]})", 0), kInvalid,
                  {"__metadata__ must be an object of strings, got array"});
}

TEST_F(SafetensorsMalformedTest, EntryShape) {
  ExpectOpenError(MakeFile(R"({"x":[1,2]})", 0), kInvalid,
                  {"tensor 'x'", "entry must be a JSON object, got array"});
  ExpectOpenError(
      MakeFile(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", 1),
      kInvalid, {"tensor 'x'", "unexpected key 'extra'"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"U8","shape":[1]}})", 1), kInvalid,
                  {"tensor 'x'", "missing 'data_offsets'"});
  ExpectOpenError(MakeFile(R"({"x":{"shape":[1],"data_offsets":[0,1]}})", 1), kInvalid,
                  {"tensor 'x'", "missing 'dtype'"});
  ExpectOpenError(MakeFile(R"({"x":{"dtype":"U8","data_offsets":[0,1]}})", 1), kInvalid,
                  {"tensor 'x'", "missing 'shape'"});
}

TEST_F(SafetensorsMalformedTest, DeeplyNestedJsonIsRejectedWithoutCrashing) {
  const std::string deep = "{\"x\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  ExpectOpenError(MakeFile(deep, 0), kInvalid, {"tensor 'x'", "entry must be a JSON object"});
}

TEST_F(TempDirTest, OpenMissingFileIsNotFound) {
  auto file = SafetensorsFile::Open(Path("absent.safetensors"));
  ExpectError(file.status(), absl::StatusCode::kNotFound, {"absent.safetensors"});
}

TEST_F(TempDirTest, OpenDirectoryIsRejected) {
  auto file = SafetensorsFile::Open(dir_);
  ASSERT_FALSE(file.ok());
  EXPECT_NE(std::string(file.status().message()).find(dir_), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Valid edge cases
// ---------------------------------------------------------------------------------------------

TEST(SafetensorsParseTest, EmptyHeaderAndScalarsAndEmptyTensors) {
  const std::string header =
      R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
      R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[8,8]},)"
      R"("z":{"dtype":"BOOL","shape":[3],"data_offsets":[8,11]},)"
      R"("__metadata__":{"format":"pt"}}   )";
  const std::string bytes = MakeFile(header, 11);
  auto parsed =
      ParseSafetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->tensors.size(), 3u);
  EXPECT_EQ(parsed->data_offset, 8 + header.size());
  EXPECT_EQ(parsed->tensors[0].name, "s");
  EXPECT_EQ(parsed->tensors[0].numel(), 1);  // scalar
  EXPECT_EQ(parsed->tensors[1].name, "e");
  EXPECT_EQ(parsed->tensors[1].numel(), 0);
  EXPECT_EQ(parsed->tensors[1].nbytes(), 0u);
  EXPECT_EQ(parsed->tensors[2].name, "z");
  EXPECT_EQ(parsed->tensors[2].dtype, DType::kBool);
  EXPECT_EQ(parsed->metadata.at("format"), "pt");

  // A zero dimension makes the tensor empty even if the other dimensions' product overflows.
  const std::string zero_header =
      R"({"z":{"dtype":"F64","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}})";
  const std::string zero = MakeFile(zero_header, 0);
  auto zero_parsed =
      ParseSafetensors(reinterpret_cast<const uint8_t*>(zero.data()), zero.size(), "z");
  ASSERT_TRUE(zero_parsed.ok()) << zero_parsed.status();
  EXPECT_EQ(zero_parsed->tensors.at(0).numel(), 0);

  const std::string empty = MakeFile("{}", 0);
  auto none = ParseSafetensors(reinterpret_cast<const uint8_t*>(empty.data()), empty.size(), "e");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->tensors.empty());
}

TEST(SafetensorsParseTest, HeaderOnlyEntryPoint) {
  auto ok = ParseSafetensorsHeader(R"({"a":{"dtype":"I16","shape":[3],"data_offsets":[0,6]}})",
                                   6, "hdr");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tensors.at(0).dtype, DType::kI16);
  ExpectError(ParseSafetensorsHeader(R"({"a":{"dtype":"I16","shape":[3],"data_offsets":[0,6]}})",
                                     4, "hdr")
                  .status(),
              kInvalid, {"hdr: tensor 'a'", "extend past the end"});
}

// ---------------------------------------------------------------------------------------------
// Writer round trips
// ---------------------------------------------------------------------------------------------

TEST_F(TempDirTest, RoundTripEveryDTypeWithMetadata) {
  const DType all[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kI64,
                       DType::kI32, DType::kI16, DType::kI8,  DType::kU64,  DType::kU32,
                       DType::kU16, DType::kU8,  DType::kBool};
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  SafetensorsWriter writer;
  std::map<std::string, std::string> expected_bytes;
  uint64_t total = 0;
  for (DType dtype : all) {
    const std::string name = "layer." + std::string(DTypeName(dtype)) + ".weight";
    const std::vector<int64_t> shape = {3, 5};
    std::string bytes(15 * DTypeSize(dtype), '\0');
    for (char& c : bytes) c = static_cast<char>(rng() & 0xff);
    if (dtype == DType::kBool) {
      for (char& c : bytes) c = static_cast<char>(c & 1);
    }
    ASSERT_TRUE(writer.Add(name, dtype, shape, bytes.data(), bytes.size()).ok());
    expected_bytes[name] = bytes;
    total += bytes.size();
  }
  ASSERT_TRUE(writer.Add("scalar", DType::kF32, {}, "\0\0\x80\x3f", 4).ok());
  ASSERT_TRUE(writer.Add("empty", DType::kF16, {0, 7}, nullptr, 0).ok());
  total += 4;
  EXPECT_EQ(writer.data_bytes(), total);
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("qcal.recipe", "quip#-e8p \xc3\xa9");  // UTF-8 survives
  const std::string path = Path("model.safetensors");
  // The checksum computed while writing (fed in pieces) is the FNV-1a of the file's bytes, as a
  // later read computes it (resume and commit compare the two).
  StatusOr<std::string> written_sum = writer.WriteWithChecksum(path);
  ASSERT_TRUE(written_sum.ok()) << written_sum.status();
  StatusOr<std::string> file_bytes = ReadFile(path);
  ASSERT_TRUE(file_bytes.ok());
  EXPECT_EQ(*written_sum, Fnv1aHex(*file_bytes));
  Fnv1a pieces;
  for (size_t i = 0; i < file_bytes->size(); i += 1000) {
    pieces.Update(file_bytes->data() + i, std::min<size_t>(1000, file_bytes->size() - i));
  }
  EXPECT_EQ(pieces.Hex(), *written_sum);

  // Layout: the header is padded with spaces so the data section is 8-byte aligned.
  auto raw = ReadFile(path);
  ASSERT_TRUE(raw.ok()) << raw.status();
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>((*raw)[i]);
  EXPECT_EQ((8 + header_len) % 8, 0u);
  EXPECT_EQ(raw->size(), 8 + header_len + total);
  const std::string header = raw->substr(8, header_len);
  EXPECT_EQ(header.front(), '{');
  const size_t last_brace = header.find_last_of('}');
  EXPECT_EQ(header.find_first_not_of(' ', last_brace + 1), std::string::npos) << header;
  EXPECT_LT(header.size() - last_brace - 1, 8u);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), std::size(all) + 2);
  for (const auto& [name, bytes] : expected_bytes) {
    const TensorInfo* info = (*file)->Find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(DTypeName(info->dtype) , name.substr(6, name.size() - 6 - 7)) << name;
    EXPECT_EQ(info->shape, (std::vector<int64_t>{3, 5}));
    EXPECT_EQ(info->numel(), 15);
    ASSERT_EQ(info->nbytes(), bytes.size());
    EXPECT_EQ(std::memcmp((*file)->Data(*info), bytes.data(), bytes.size()), 0) << name;
  }
  const TensorInfo* scalar = (*file)->Find("scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_TRUE(scalar->shape.empty());
  auto scalar_value = (*file)->ReadF32("scalar");
  ASSERT_TRUE(scalar_value.ok());
  EXPECT_EQ(*scalar_value, std::vector<float>{1.0f});
  const TensorInfo* empty = (*file)->Find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->nbytes(), 0u);
  EXPECT_EQ(empty->shape, (std::vector<int64_t>{0, 7}));
  EXPECT_EQ((*file)->Find("absent"), nullptr);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->metadata().at("qcal.recipe"), "quip#-e8p \xc3\xa9");
  // Tensors are sorted by offset and the writer kept insertion order.
  for (size_t i = 1; i < (*file)->tensors().size(); ++i) {
    EXPECT_LE((*file)->tensors()[i - 1].end, (*file)->tensors()[i].begin);
  }
  EXPECT_EQ((*file)->tensors().front().name, "layer.F64.weight");
  // The atomic write left no temporary files behind.
  EXPECT_EQ(ListDir(), std::vector<std::string>{"model.safetensors"});
}

TEST_F(TempDirTest, ReadF32ConvertsFloatingTypes) {
  const std::vector<float> values = {1.0f, -2.5f, 0.099975586f, 65504.0f, -0.0f, 3.0e-5f};
  std::vector<uint16_t> f16, bf16;
  std::vector<double> f64;
  for (float v : values) {
    f16.push_back(FloatToHalf(v));
    bf16.push_back(FloatToBFloat16(v));
    f64.push_back(static_cast<double>(v));
  }
  const int64_t n = static_cast<int64_t>(values.size());
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("h", DType::kF16, {n}, f16.data(), f16.size() * 2).ok());
  // An odd-sized tensor first shifts the following data off 4-byte alignment.
  ASSERT_TRUE(writer.Add("pad", DType::kU8, {3}, "abc", 3).ok());
  ASSERT_TRUE(writer.Add("b", DType::kBF16, {2, n / 2}, bf16.data(), bf16.size() * 2).ok());
  ASSERT_TRUE(writer.AddF32("f", {n}, values.data()).ok());
  ASSERT_TRUE(writer.Add("d", DType::kF64, {n}, f64.data(), f64.size() * 8).ok());
  const int32_t ints[2] = {1, 2};
  ASSERT_TRUE(writer.Add("i", DType::kI32, {2}, ints, sizeof(ints)).ok());
  ASSERT_TRUE(writer.Write(Path("x.safetensors")).ok());

  auto file = SafetensorsFile::Open(Path("x.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  auto h = (*file)->ReadF32("h");
  ASSERT_TRUE(h.ok()) << h.status();
  auto b = (*file)->ReadF32("b");
  ASSERT_TRUE(b.ok()) << b.status();
  auto f = (*file)->ReadF32("f");
  ASSERT_TRUE(f.ok()) << f.status();
  auto d = (*file)->ReadF32("d");
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(h->size(), values.size());
  ASSERT_EQ(b->size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ((*h)[i], HalfToFloat(f16[i])) << i;
    EXPECT_NEAR((*h)[i], values[i], std::abs(values[i]) * 1e-3f + 1e-7f) << i;
    EXPECT_EQ((*b)[i], BFloat16ToFloat(bf16[i])) << i;
    EXPECT_NEAR((*b)[i], values[i], std::abs(values[i]) * 8e-3f) << i;
    EXPECT_EQ(BitsOf((*f)[i]), BitsOf(values[i])) << i;
    EXPECT_EQ(BitsOf((*d)[i]), BitsOf(values[i])) << i;
  }
  EXPECT_EQ((*h)[0], 1.0f);
  EXPECT_EQ((*b)[1], -2.5f);
  ExpectError((*file)->ReadF32("i").status(), kInvalid,
              {"x.safetensors", "tensor 'i' has dtype I32"});
  ExpectError((*file)->ReadF32("nope").status(), absl::StatusCode::kNotFound,
              {"x.safetensors", "no tensor named 'nope'"});
}

TEST_F(TempDirTest, WriterRejectsBadInput) {
  SafetensorsWriter writer;
  const float data[6] = {};
  ASSERT_TRUE(writer.AddF32("a", {2, 3}, data).ok());
  ExpectError(writer.AddF32("a", {2, 3}, data), kInvalid, {"duplicate tensor name 'a'"});
  ExpectError(writer.Add("b", DType::kF32, {2, 3}, data, 20), kInvalid,
              {"tensor 'b'", "20 bytes given for shape [2, 3] x F32 (24 bytes)"});
  ExpectError(writer.Add("", DType::kF32, {1}, data, 4), kInvalid, {"empty tensor name"});
  ExpectError(writer.Add("__metadata__", DType::kF32, {1}, data, 4), kInvalid, {"reserved"});
  ExpectError(writer.AddF32("n", {-1, 3}, data), kInvalid, {"tensor 'n'", "negative dimension"});
  ExpectError(writer.Add("z", DType::kU8, {4}, nullptr, 4), kInvalid, {"null data"});
  ExpectError(writer.Add("\xff", DType::kU8, {1}, data, 1), kInvalid, {"not valid UTF-8"});
  EXPECT_EQ(writer.data_bytes(), 24u);
  // Writing into a directory that does not exist names the path.
  ExpectError(writer.Write(Path("missing/out.safetensors")), absl::StatusCode::kNotFound,
              {"missing/out.safetensors"});
}

TEST_F(TempDirTest, StreamedTensorsWriteTheSameBytesAsCopiedOnes) {
  std::vector<uint16_t> table(1000 * 3);
  for (size_t i = 0; i < table.size(); ++i) table[i] = FloatToBFloat16(0.25f * (i % 97) - 7.0f);
  const float norm[3] = {1.0f, 0.5f, -2.0f};
  SafetensorsWriter copied, streamed;
  for (SafetensorsWriter* w : {&copied, &streamed}) w->SetMetadata("format", "pt");
  ASSERT_TRUE(copied.Add("t", DType::kBF16, {1000, 3}, table.data(), table.size() * 2).ok());
  ASSERT_TRUE(copied.AddF32("n", {3}, norm).ok());
  // In uneven pieces, including an empty one.
  ASSERT_TRUE(streamed
                  .AddStreamed("t", DType::kBF16, {1000, 3},
                               [&](const SafetensorsWriter::ByteSink& sink) -> Status {
                                 const char* p = reinterpret_cast<const char*>(table.data());
                                 QCAL_RETURN_IF_ERROR(sink(p, 7));
                                 QCAL_RETURN_IF_ERROR(sink(p + 7, 0));
                                 return sink(p + 7, table.size() * 2 - 7);
                               })
                  .ok());
  ASSERT_TRUE(streamed.AddF32("n", {3}, norm).ok());
  EXPECT_EQ(streamed.data_bytes(), copied.data_bytes());
  auto a = copied.WriteWithChecksum(Path("a.safetensors"));
  auto b = streamed.WriteWithChecksum(Path("b.safetensors"));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  auto bytes_a = ReadFile(Path("a.safetensors"));
  auto bytes_b = ReadFile(Path("b.safetensors"));
  ASSERT_TRUE(bytes_a.ok() && bytes_b.ok());
  EXPECT_EQ(*bytes_a, *bytes_b);
  auto sum = FileFnv1aHex(Path("b.safetensors"));
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, *b);

  // AddCopiedTensor: the stored dtype and bytes, through a file opened for reading.
  auto file = SafetensorsFile::Open(Path("a.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  SafetensorsWriter copy;
  copy.SetMetadata("format", "pt");
  ASSERT_TRUE(AddCopiedTensor(&copy, "t", **file, *(*file)->Find("t")).ok());
  ASSERT_TRUE(AddCopiedTensor(&copy, "n", **file, *(*file)->Find("n")).ok());
  ASSERT_TRUE(copy.Write(Path("c.safetensors")).ok());
  auto bytes_c = ReadFile(Path("c.safetensors"));
  ASSERT_TRUE(bytes_c.ok());
  EXPECT_EQ(*bytes_c, *bytes_a);
}

TEST_F(TempDirTest, StreamedTensorWithTheWrongByteCountOrAnErrorWritesNothing) {
  const std::string data(24, 'x');
  auto producer = [&](size_t n) {
    return [&data, n](const SafetensorsWriter::ByteSink& sink) { return sink(data.data(), n); };
  };
  {
    SafetensorsWriter w;
    ASSERT_TRUE(w.AddStreamed("short", DType::kF32, {2, 3}, producer(20)).ok());
    ExpectError(w.Write(Path("short.safetensors")), absl::StatusCode::kInternal,
                {"short.safetensors", "tensor 'short'", "handed 20 of its 24 bytes"});
  }
  {
    SafetensorsWriter w;
    ASSERT_TRUE(w.AddStreamed("long", DType::kF32, {1, 5}, producer(24)).ok());
    ExpectError(w.Write(Path("long.safetensors")), absl::StatusCode::kInternal,
                {"tensor 'long'", "more than its 20 bytes"});
  }
  {
    SafetensorsWriter w;
    ASSERT_TRUE(w.AddStreamed("bad", DType::kU8, {3},
                              [](const SafetensorsWriter::ByteSink&) -> Status {
                                return absl::DataLossError("source shard changed");
                              })
                    .ok());
    ExpectError(w.Write(Path("bad.safetensors")), absl::StatusCode::kDataLoss,
                {"bad.safetensors", "tensor 'bad'", "source shard changed"});
  }
  SafetensorsWriter w;
  ExpectError(w.AddStreamed("none", DType::kU8, {3}, nullptr), kInvalid, {"no producer"});
  ExpectError(w.AddStreamed("neg", DType::kU8, {-3}, producer(3)), kInvalid,
              {"negative dimension"});
  // No file, no temporary file.
  EXPECT_TRUE(ListDir().empty());
}

TEST(DTypeTest, ConvertToAndFromF32) {
  const std::vector<float> values = {1.0f, -2.5f, 0.099975586f, 65504.0f, -0.0f, 3.0e-5f};
  for (DType d : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> bytes(values.size() * DTypeSize(d) + 1);
    // At an odd address: conversions take any alignment.
    ConvertFromF32(d, values.data(), values.size(), bytes.data() + 1);
    std::vector<float> back(values.size());
    ConvertToF32(d, bytes.data() + 1, values.size(), back.data());
    for (size_t i = 0; i < values.size(); ++i) {
      float expected = values[i];
      if (d == DType::kF16) expected = HalfToFloat(FloatToHalf(values[i]));
      if (d == DType::kBF16) expected = BFloat16ToFloat(FloatToBFloat16(values[i]));
      EXPECT_EQ(BitsOf(back[i]), BitsOf(expected)) << DTypeName(d) << " " << i;
    }
  }
  EXPECT_TRUE(IsFloatingDType(DType::kBF16));
  EXPECT_FALSE(IsFloatingDType(DType::kI32));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

class CheckpointTest : public TempDirTest {
 protected:
  // Shard 1: a (2x2 F32), b (3 F16). Shard 2: c (BF16 [2]).
  void WriteTwoShards() {
    const float a[4] = {1, 2, 3, 4};
    const uint16_t b[3] = {FloatToHalf(0.5f), FloatToHalf(-1.0f), FloatToHalf(2.0f)};
    const uint16_t c[2] = {FloatToBFloat16(7.0f), FloatToBFloat16(-8.0f)};
    SafetensorsWriter shard1;
    ASSERT_TRUE(shard1.AddF32("model.a", {2, 2}, a).ok());
    ASSERT_TRUE(shard1.Add("model.b", DType::kF16, {3}, b, sizeof(b)).ok());
    ASSERT_TRUE(shard1.Write(Path("model-00001-of-00002.safetensors")).ok());
    SafetensorsWriter shard2;
    ASSERT_TRUE(shard2.Add("lm_head.c", DType::kBF16, {2}, c, sizeof(c)).ok());
    ASSERT_TRUE(shard2.Write(Path("model-00002-of-00002.safetensors")).ok());
    total_size_ = shard1.data_bytes() + shard2.data_bytes();
  }
  std::map<std::string, std::string> TwoShardMap() const {
    return {{"model.a", "model-00001-of-00002.safetensors"},
            {"model.b", "model-00001-of-00002.safetensors"},
            {"lm_head.c", "model-00002-of-00002.safetensors"}};
  }
  uint64_t total_size_ = 0;
};

TEST_F(CheckpointTest, IndexWithTwoShards) {
  WriteTwoShards();
  ASSERT_TRUE(WriteCheckpointIndex(dir_, TwoShardMap(), total_size_).ok());

  auto text = ReadFile(Path("model.safetensors.index.json"));
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string expected_text =
      "{\n"
      "  \"metadata\": {\n"
      "    \"total_size\": 26\n"
      "  },\n"
      "  \"weight_map\": {\n"
      "    \"lm_head.c\": \"model-00002-of-00002.safetensors\",\n"
      "    \"model.a\": \"model-00001-of-00002.safetensors\",\n"
      "    \"model.b\": \"model-00001-of-00002.safetensors\"\n"
      "  }\n"
      "}\n";
  EXPECT_EQ(total_size_, 26u);
  EXPECT_EQ(*text, expected_text);

  auto reader = CheckpointReader::Open(dir_);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->dir(), dir_);
  EXPECT_EQ((*reader)->TensorNames(),
            (std::vector<std::string>{"lm_head.c", "model.a", "model.b"}));
  EXPECT_TRUE((*reader)->Has("model.b"));
  EXPECT_FALSE((*reader)->Has("model.z"));
  auto a = (*reader)->ReadF32("model.a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, (std::vector<float>{1, 2, 3, 4}));
  auto b = (*reader)->ReadF32("model.b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<float>{0.5f, -1.0f, 2.0f}));
  auto c = (*reader)->ReadF32("lm_head.c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<float>{7.0f, -8.0f}));
  auto found = (*reader)->Find("lm_head.c");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->first->path(), Path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(found->second->dtype, DType::kBF16);
  ExpectError((*reader)->Find("model.z").status(), absl::StatusCode::kNotFound,
              {dir_, "no tensor named 'model.z'"});
  EXPECT_TRUE((*reader)->Validate().ok());
}

TEST_F(CheckpointTest, OpenShardsReadsNamedShardsWithoutAnIndex) {
  WriteTwoShards();
  auto reader = CheckpointReader::OpenShards(
      dir_, {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->TensorNames(),
            (std::vector<std::string>{"lm_head.c", "model.a", "model.b"}));
  auto first = CheckpointReader::OpenShards(dir_, {"model-00001-of-00002.safetensors"});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE((*first)->Has("model.a"));
  EXPECT_FALSE((*first)->Has("lm_head.c"));
  ExpectError(CheckpointReader::OpenShards(dir_, {"../x.safetensors"}).status(), kInvalid,
              {"not a plain file name"});
  ExpectError(CheckpointReader::OpenShards(dir_, {"model-00001-of-00002.safetensors",
                                                  "model-00001-of-00002.safetensors"})
                  .status(),
              kInvalid, {"also in another shard"});
  EXPECT_FALSE(CheckpointReader::OpenShards(dir_, {"missing.safetensors"}).ok());
}

TEST_F(CheckpointTest, SingleFile) {
  SafetensorsWriter writer;
  const float w[2] = {3, 4};
  ASSERT_TRUE(writer.AddF32("w", {2}, w).ok());
  ASSERT_TRUE(writer.Write(Path("model.safetensors")).ok());
  auto reader = CheckpointReader::Open(dir_ + "/");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->TensorNames(), std::vector<std::string>{"w"});
  auto values = (*reader)->ReadF32("w");
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<float>{3, 4}));
  EXPECT_TRUE((*reader)->Validate().ok());
}

TEST_F(CheckpointTest, SingleFileThatIsMalformedFailsOpen) {
  WriteRaw("model.safetensors", "short");
  ExpectError(CheckpointReader::Open(dir_).status(), kDataLoss, {"model.safetensors", "too short"});
}

TEST_F(CheckpointTest, IndexNamesMissingShard) {
  WriteTwoShards();
  auto map = TwoShardMap();
  map["model.extra"] = "model-00003-of-00003.safetensors";
  ASSERT_TRUE(WriteCheckpointIndex(dir_, map, total_size_).ok());
  ExpectError(CheckpointReader::Open(dir_).status(), absl::StatusCode::kNotFound,
              {"model.safetensors.index.json", "names shard 'model-00003-of-00003.safetensors'",
               "tensor 'model.extra'", "does not exist"});
}

TEST_F(CheckpointTest, TensorListedInIndexButMissingInShard) {
  WriteTwoShards();
  auto map = TwoShardMap();
  map["model.ghost"] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(WriteCheckpointIndex(dir_, map, total_size_).ok());
  auto reader = CheckpointReader::Open(dir_);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ExpectError((*reader)->Find("model.ghost").status(), kInvalid,
              {"model.safetensors.index.json", "tensor 'model.ghost'",
               "shard 'model-00002-of-00002.safetensors'", "has no such tensor"});
  ExpectError((*reader)->Validate(), kInvalid, {"tensor 'model.ghost'", "has no such tensor"});
  // Other tensors still read.
  EXPECT_TRUE((*reader)->ReadF32("model.a").ok());
}

TEST_F(CheckpointTest, ShardHoldsTensorNotInIndex) {
  WriteTwoShards();
  auto map = TwoShardMap();
  map.erase("model.b");
  ASSERT_TRUE(WriteCheckpointIndex(dir_, map, total_size_).ok());
  auto reader = CheckpointReader::Open(dir_);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ExpectError((*reader)->Validate(), kInvalid,
              {"model-00001-of-00002.safetensors", "holds tensor 'model.b'"});
}

TEST_F(CheckpointTest, NoCheckpointFiles) {
  WriteRaw("config.json", "{}");
  ExpectError(CheckpointReader::Open(dir_).status(), absl::StatusCode::kNotFound,
              {dir_, "no checkpoint files found", "model.safetensors.index.json"});
  ExpectError(CheckpointReader::Open(Path("nonexistent")).status(), absl::StatusCode::kNotFound,
              {"nonexistent"});
  ExpectError(CheckpointReader::Open(Path("config.json")).status(), kInvalid,
              {"config.json", "not a directory"});
}

TEST_F(CheckpointTest, MalformedIndex) {
  WriteRaw("model.safetensors.index.json", "{\"weight_map\": ");
  ExpectError(CheckpointReader::Open(dir_).status(), kInvalid,
              {"model.safetensors.index.json", "not valid JSON"});
  WriteRaw("model.safetensors.index.json", "[]");
  ExpectError(CheckpointReader::Open(dir_).status(), kInvalid,
              {"model.safetensors.index.json", "must be a JSON object, got array"});
  WriteRaw("model.safetensors.index.json", R"({"metadata": {}})");
  ExpectError(CheckpointReader::Open(dir_).status(), kInvalid,
              {"model.safetensors.index.json", "missing required field 'weight_map'"});
  WriteRaw("model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  ExpectError(CheckpointReader::Open(dir_).status(), kInvalid,
              {"weight_map entry for tensor 'a'", "got integer"});
  WriteRaw("model.safetensors.index.json", R"({"weight_map": {"a": "../escape.safetensors"}})");
  ExpectError(CheckpointReader::Open(dir_).status(), kInvalid,
              {"weight_map entry for tensor 'a'", "'../escape.safetensors'"});
}

TEST_F(CheckpointTest, WriteIndexRejectsPathsAsShardNames) {
  ExpectError(WriteCheckpointIndex(dir_, {{"a", "sub/x.safetensors"}}, 0), kInvalid,
              {"shard 'sub/x.safetensors'", "plain file name"});
  ExpectError(WriteCheckpointIndex(Path("missing"), {{"a", "x.safetensors"}}, 0),
              absl::StatusCode::kNotFound, {"missing/model.safetensors.index.json"});
}

}  // namespace
}  // namespace qcal
