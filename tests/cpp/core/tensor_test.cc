#include "deepnex/tensor.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kInt32), 4u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_EQ(DTypeSize(DType::kUInt8), 1u);
  EXPECT_STREQ(DTypeName(DType::kFloat32), "float32");
  EXPECT_STREQ(DTypeName(DType::kFloat64), "float64");
  EXPECT_STREQ(DTypeName(DType::kFloat16), "float16");
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(DTypeName(DType::kInt32), "int32");
  EXPECT_STREQ(DTypeName(DType::kInt64), "int64");
  EXPECT_STREQ(DTypeName(DType::kUInt8), "uint8");
  EXPECT_STREQ(DTypeName(static_cast<DType>(0)), "invalid");
  EXPECT_EQ(DTypeSize(static_cast<DType>(99)), 0u);
}

TEST(DTypeTest, WireValuesAreStable) {
  EXPECT_EQ(static_cast<int>(DType::kFloat32), 1);
  EXPECT_EQ(static_cast<int>(DType::kBFloat16), 4);
  EXPECT_EQ(static_cast<int>(DType::kUInt8), 7);
  EXPECT_FALSE(IsValidDType(0));
  EXPECT_FALSE(IsValidDType(-1));
  EXPECT_FALSE(IsValidDType(8));
  for (int v = 1; v <= 7; ++v) EXPECT_TRUE(IsValidDType(v)) << v;
}

TEST(DTypeTest, ParseIsTheInverseOfName) {
  for (int v = 1; v <= 7; ++v) {
    DType d = static_cast<DType>(v);
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(d));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, d);
  }
}

TEST(DTypeTest, ParseRefusesOtherNames) {
  for (const char* name :
       {"", "f4", "<f4", "float", "Float32", "int8", "float32 ", "invalid"}) {
    EXPECT_THAT(ParseDType(name),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         std::string("dtype \"") + name +
                             "\" is unknown (use float32, float64, float16, "
                             "bfloat16, int32, int64 or uint8)"))
        << name;
  }
}

TEST(DTypeTest, IsFloatingPoint) {
  EXPECT_TRUE(IsFloatingPoint(DType::kFloat32));
  EXPECT_TRUE(IsFloatingPoint(DType::kFloat64));
  EXPECT_TRUE(IsFloatingPoint(DType::kFloat16));
  EXPECT_TRUE(IsFloatingPoint(DType::kBFloat16));
  EXPECT_FALSE(IsFloatingPoint(DType::kInt32));
  EXPECT_FALSE(IsFloatingPoint(DType::kInt64));
  EXPECT_FALSE(IsFloatingPoint(DType::kUInt8));
}

TEST(HalfTest, ExactValues) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.5f), 0x3800);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);               // largest half
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1023.0f, -24)), 0x03FF);
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Bits(HalfToFloat(0x8000)), 0x80000000u);
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(HalfTest, RoundsToNearestEven) {
  // Between 1 and 1 + 2^-10 (0x3C00, 0x3C01): halfway ties to even 0x3C00.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)),
            0x3C01);
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + std::ldexp(1.0f, -11), 0.0f)),
            0x3C00);
  // Between 0x3C01 and 0x3C02: halfway ties to even 0x3C02.
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Mantissa carry into the exponent: just under 2 rounds up to 2.
  EXPECT_EQ(FloatToHalf(std::nextafter(2.0f, 0.0f)), 0x4000);
  // Subnormals: half of the smallest subnormal ties to even (zero), a bit
  // more rounds up, 1.5 units ties to 2 units.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToHalf(-std::ldexp(3.0f, -25)), 0x8002);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(FloatToHalf(-std::ldexp(1.0f, -30)), 0x8000);
  // The largest subnormal rounds up to the smallest normal.
  EXPECT_EQ(FloatToHalf(std::ldexp(1023.75f, -24)), 0x0400);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(HalfTest, OverflowInfinityAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);  // below the tie: rounds down
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie: to even, which is inf
  EXPECT_EQ(FloatToHalf(1e10f), 0x7C00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xFC00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(FloatToHalf(inf), 0x7C00);
  EXPECT_EQ(FloatToHalf(-inf), 0xFC00);
  EXPECT_EQ(HalfToFloat(0x7C00), inf);
  EXPECT_EQ(HalfToFloat(0xFC00), -inf);

  uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x03FF, 0);
  // A signalling NaN whose payload is only in the low bits stays a NaN.
  uint16_t snan = FloatToHalf(FromBits(0x7F800001u));
  EXPECT_EQ(snan & 0x7C00, 0x7C00);
  EXPECT_NE(snan & 0x03FF, 0);
  EXPECT_EQ(FloatToHalf(FromBits(0xFFC00000u)) & 0x8000, 0x8000);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
  // The payload's top bits survive widening and narrowing.
  EXPECT_EQ(FloatToHalf(HalfToFloat(0x7E15)), 0x7E15);
}

TEST(BFloat16Test, ExactValues) {
  EXPECT_EQ(FloatToBFloat16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBFloat16(3.0f), 0x4040);
  EXPECT_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
  EXPECT_EQ(FloatToBFloat16(3.140625f), 0x4049);
  // A float subnormal keeps its top bits.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00010000u)), 0x0001);
}

TEST(BFloat16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 0x3F80 and 0x3F81: ties to even 0x3F80.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3F808000u)), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3F807FFFu)), 0x3F80);
  // Halfway between 0x3F81 and 0x3F82: ties to even 0x3F82.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3F818000u)), 0x3F82);
  EXPECT_EQ(FloatToBFloat16(FromBits(0xBF818000u)), 0xBF82);
}

TEST(BFloat16Test, EveryBFloat16RoundTrips) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(f)))) << b;
      continue;
    }
    EXPECT_EQ(FloatToBFloat16(f), b) << b;
  }
}

TEST(BFloat16Test, OverflowInfinityAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBFloat16(inf), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(-inf), 0xFF80);
  EXPECT_EQ(BFloat16ToFloat(0x7F80), inf);
  // The largest float rounds past the largest bfloat16 to infinity.
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x7F7F7FFFu)), 0x7F7F);
  // NaNs, including one whose payload is only in the low 16 bits (plain
  // truncation would turn it into infinity), stay NaN.
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0x7F800001u)))));
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0xFFFFFFFFu)))));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(
      FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FloatToBFloat16(FromBits(0xFF800001u)) & 0x8000, 0x8000);
}

TEST(TensorViewTest, ElementsAndBytes) {
  float data[12] = {};
  TensorView v(data, DType::kFloat32, {4, 3});
  EXPECT_EQ(v.data, data);
  EXPECT_EQ(v.NumElements(), 12);
  EXPECT_EQ(v.NumBytes(), 48u);
  TensorView scalar(data, DType::kFloat64, {});
  EXPECT_EQ(scalar.NumElements(), 1);
  EXPECT_EQ(scalar.NumBytes(), 8u);
  TensorView empty(data, DType::kBFloat16, {5, 0, 2});
  EXPECT_EQ(empty.NumElements(), 0);
  EXPECT_EQ(empty.NumBytes(), 0u);
  TensorView defaulted;
  EXPECT_EQ(defaulted.data, nullptr);
  EXPECT_EQ(defaulted.dtype, DType::kFloat32);
  EXPECT_EQ(defaulted.NumElements(), 1);
}

TEST(TensorViewTest, DescribeShape) {
  EXPECT_EQ(DescribeShape({4, 3}, DType::kFloat32), "[4, 3] float32");
  EXPECT_EQ(DescribeShape({}, DType::kInt64), "[] int64");
  EXPECT_EQ(DescribeShape({7}, DType::kBFloat16), "[7] bfloat16");
}

}  // namespace
}  // namespace deepnex
