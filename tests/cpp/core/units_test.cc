#include "deepnex/units.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = kKiB * 1024;
constexpr uint64_t kGiB = kMiB * 1024;
constexpr uint64_t kTiB = kGiB * 1024;
constexpr uint64_t kPiB = kTiB * 1024;
constexpr uint64_t kEiB = kPiB * 1024;
constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

struct Good {
  const char* text;
  uint64_t bytes;
};

class ParseByteSizeGoodTest : public ::testing::TestWithParam<Good> {};

TEST_P(ParseByteSizeGoodTest, Parses) {
  absl::StatusOr<uint64_t> got = ParseByteSize(GetParam().text, "memory");
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(*got, GetParam().bytes) << GetParam().text;
}

INSTANTIATE_TEST_SUITE_P(
    Units, ParseByteSizeGoodTest,
    ::testing::Values(
        Good{"0", 0}, Good{"4096", 4096}, Good{"0B", 0}, Good{"17B", 17},
        Good{"8GiB", 8 * kGiB}, Good{"512M", 512 * kMiB},
        Good{"1.5G", 3 * kGiB / 2}, Good{"10 KiB", 10 * kKiB},
        Good{"10   KiB", 10 * kKiB}, Good{"  7k  ", 7 * kKiB},
        Good{"1KB", 1000}, Good{"1kb", 1000}, Good{"3MB", 3000000},
        Good{"2GB", 2000000000}, Good{"1TB", 1000000000000},
        // Decimal units, any case, a space or none: what the CLI's
        // "--gpu-memory 10gb" and a nodes file's "24 GB" mean.
        Good{"10gb", 10000000000}, Good{"10GB", 10000000000},
        Good{"24 GB", 24000000000}, Good{" 24 GB", 24000000000},
        Good{"24GB", 24000000000}, Good{"24 gB", 24000000000},
        Good{"1PB", 1000000000000000}, Good{"1EB", 1000000000000000000},
        Good{"1K", kKiB}, Good{"1kib", kKiB}, Good{"1KIB", kKiB},
        Good{"2Mi", 2 * kMiB}, Good{"1T", kTiB}, Good{"1TiB", kTiB},
        Good{"1P", kPiB}, Good{"1PiB", kPiB}, Good{"1E", kEiB},
        Good{"15EiB", 15 * kEiB},
        // Fractions round down to whole bytes.
        Good{"0.5KiB", 512}, Good{"1.0009765625K", 1025},
        Good{"1.0009765624K", 1024}, Good{"0.001KB", 1}, Good{"0.0009KB", 0},
        Good{"007", 7}, Good{"1.0", 1}, Good{"2.000B", 2},
        // 1/3 GiB, to many more digits than a double holds.
        Good{"0.333333333333333333333333333333333333G", kGiB / 3},
        // Exactly 2^-60 EiB is one byte; one digit less is not.
        Good{"0.000000000000000000867361737988403547205962240695953369140625E",
             1},
        Good{"0.00000000000000000086736173798840354720596224069595336914062E",
             0},
        // Large integers stay exact (a double would round these).
        Good{"18446744073709551615", kMax},
        Good{"9007199254740993", 9007199254740993ULL},
        Good{"15.999999999999999999EiB", 18446744073709551614ULL},
        Good{"16383.999999999999999PiB", kMax - 1}));

TEST(ParseByteSizeTest, LargestValues) {
  EXPECT_THAT(ParseByteSize("18014398509481983K"), IsOk());
  EXPECT_EQ(*ParseByteSize("18014398509481983K"), kMax - 1023);
  EXPECT_EQ(*ParseByteSize("18446744073709551.615KB"), kMax);
}

struct Bad {
  const char* text;
  const char* why;  // the parenthesised reason, or a part of it
};

class ParseByteSizeBadTest : public ::testing::TestWithParam<Bad> {};

TEST_P(ParseByteSizeBadTest, IsInvalidArgumentNamingFieldAndValue) {
  const Bad& bad = GetParam();
  EXPECT_THAT(ParseByteSize(bad.text, "memory"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(std::string("memory: \"") + bad.text +
                                       "\" is not a byte size ("),
                             HasSubstr(bad.why))));
}

constexpr char kTooLarge[] =
    "too large; the largest byte size is "
    "18446744073709551615";

INSTANTIATE_TEST_SUITE_P(
    Inputs, ParseByteSizeBadTest,
    ::testing::Values(
        Bad{"", "empty"}, Bad{"   ", "empty"}, Bad{"-1G", "negative"},
        Bad{"-0", "negative"}, Bad{"+1G", "no number"}, Bad{"abc", "no number"},
        Bad{"G", "no number"}, Bad{"nan", "no number"}, Bad{"NaN", "no number"},
        Bad{"inf", "no number"}, Bad{"-inf", "negative"},
        Bad{"infinity", "no number"}, Bad{".5G", "digits on both sides"},
        Bad{"1.G", "digits on both sides"}, Bad{"1.5", "a fraction of a byte"},
        Bad{"1.5B", "a fraction of a byte"}, Bad{"0.1", "a fraction of a byte"},
        Bad{"1e9", "an exponent is not taken; write the digits"},
        Bad{"1E+30", "an exponent is not taken"}, Bad{"0x10", "unknown unit \"x10\""},
        Bad{"1,5G", "unknown unit \",5G\""},
        Bad{"1.2.3G", "a number has at most one '.'"},
        Bad{"1.5.2G", "a number has at most one '.'"},
        Bad{"10 XB", "unknown unit \"XB\""},
        Bad{"99999999999999TiB", kTooLarge},
        Bad{"5 G B", "unknown unit \"G B\""}, Bad{"20000PiB", kTooLarge},
        Bad{"18446744073709551616", kTooLarge},
        Bad{"99999999999999999999999", kTooLarge}, Bad{"16EiB", kTooLarge},
        Bad{"16E", kTooLarge}, Bad{"18446744073709551.616KB", kTooLarge},
        Bad{"16384PiB", kTooLarge}));

TEST(ParseByteSizeTest, UnknownUnitMessageListsUnits) {
  EXPECT_THAT(
      ParseByteSize("12XB", "memory"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               "memory: \"12XB\" is not a byte size (unknown unit \"XB\"; use "
               "B, KiB, MiB, GiB, TiB, PiB, EiB, K, M, G, T, P, E, KB, MB, "
               "GB, TB, PB or EB)"));
}

TEST(ParseByteSizeTest, DefaultFieldIsSize) {
  EXPECT_THAT(ParseByteSize("-1G"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "size: \"-1G\" is not a byte size (negative)"));
}

TEST(ParseByteSizeTest, QuotesUnprintableTextEscaped) {
  EXPECT_THAT(ParseByteSize(std::string("1\"G\n", 4), "m"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("m: \"1\\\"G\\n\" is not a byte size")));
}

TEST(FormatByteSizeTest, BytesBelowOneKiB) {
  EXPECT_EQ(FormatByteSize(0), "0B");
  EXPECT_EQ(FormatByteSize(1), "1B");
  EXPECT_EQ(FormatByteSize(1000), "1000B");
  EXPECT_EQ(FormatByteSize(1023), "1023B");
}

TEST(FormatByteSizeTest, ExactMultiplesAreIntegers) {
  EXPECT_EQ(FormatByteSize(1024), "1KiB");
  EXPECT_EQ(FormatByteSize(3 * kKiB), "3KiB");
  EXPECT_EQ(FormatByteSize(512 * kMiB), "512MiB");
  EXPECT_EQ(FormatByteSize(8 * kGiB), "8GiB");
  EXPECT_EQ(FormatByteSize(8589934592ULL), "8GiB");
  EXPECT_EQ(FormatByteSize(16 * kGiB), "16GiB");
  EXPECT_EQ(FormatByteSize(2 * kTiB), "2TiB");
  EXPECT_EQ(FormatByteSize(kPiB), "1PiB");
  EXPECT_EQ(FormatByteSize(15 * kEiB), "15EiB");
  EXPECT_EQ(FormatByteSize(1024 * kPiB), "1EiB");
}

TEST(FormatByteSizeTest, OthersOneDecimalInTheLargestUnitThatFits) {
  EXPECT_EQ(FormatByteSize(10000000000), "9.3GiB");  // "10GB"
  EXPECT_EQ(FormatByteSize(24000000000), "22.4GiB");  // "24 GB"
  EXPECT_EQ(FormatByteSize(1536), "1.5KiB");
  EXPECT_EQ(FormatByteSize(1536 * kMiB), "1.5GiB");
  EXPECT_EQ(FormatByteSize(1000000), "976.6KiB");  // "1MB"
  EXPECT_EQ(FormatByteSize(100000000), "95.4MiB");  // "100MB"
  // Rounded, and so not exact: the ".0" says so.
  EXPECT_EQ(FormatByteSize(1025), "1.0KiB");
  EXPECT_EQ(FormatByteSize(kGiB + 1), "1.0GiB");
  EXPECT_EQ(FormatByteSize(1025 * kKiB), "1.0MiB");  // was "1025KiB"
  // Half up: 1.05KiB is 1075.2 bytes.
  EXPECT_EQ(FormatByteSize(1075), "1.0KiB");
  EXPECT_EQ(FormatByteSize(1076), "1.1KiB");
  // Rounding up to 1024 of a unit shows the next unit.
  EXPECT_EQ(FormatByteSize(kGiB - 1), "1.0GiB");
  EXPECT_EQ(FormatByteSize(kMiB - 1), "1.0MiB");
  EXPECT_EQ(FormatByteSize(kMiB - 52), "1023.9KiB");
  EXPECT_EQ(FormatByteSize(kMax), "16.0EiB");
  EXPECT_EQ(FormatByteSize(kMax - 1023), "16.0EiB");
}

TEST(FormatByteSizeTest, ExactFormsRoundTrip) {
  for (uint64_t bytes : {uint64_t{0}, uint64_t{1}, uint64_t{1000}, kKiB,
                         1536 * kMiB, 8 * kGiB, 15 * kEiB}) {
    absl::StatusOr<uint64_t> back = ParseByteSize(FormatByteSize(bytes));
    ASSERT_THAT(back, IsOk()) << FormatByteSize(bytes);
    EXPECT_EQ(*back, bytes);
  }
  // A rounded form reads back within half a tenth of its unit.
  ASSERT_THAT(ParseByteSize(FormatByteSize(10000000000)), IsOk());
  EXPECT_EQ(*ParseByteSize(FormatByteSize(10000000000)), 9985798963ULL);  // 9.3GiB
}

// Milliseconds of SecondsToMillis(seconds, ...), -1 when it is refused.
int64_t Ms(double seconds, bool zero_ok = false) {
  return SecondsToMillis(seconds, "timeout", zero_ok)
      .value_or(std::chrono::milliseconds(-1))
      .count();
}

TEST(SecondsToMillisTest, ConvertsRoundingDown) {
  EXPECT_EQ(Ms(2.5), 2500);
  EXPECT_EQ(Ms(0.0019), 1);
  EXPECT_EQ(Ms(0, /*zero_ok=*/true), 0);
  // Under a millisecond is one: a positive time never becomes 0.
  EXPECT_EQ(Ms(1e-9), 1);
  EXPECT_EQ(Ms(1e-300, /*zero_ok=*/true), 1);
  EXPECT_EQ(Ms(kMaxSeconds), int64_t{1000000000000});
}

TEST(SecondsToMillisTest, RefusesWhatIsNoDurationNamingTheField) {
  EXPECT_THAT(SecondsToMillis(0, "timeout"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "timeout=0.000000: must be positive seconds"));
  EXPECT_THAT(SecondsToMillis(-1, "lease", true),
              StatusIs(absl::StatusCode::kInvalidArgument, "lease=-1.000000: must be >= 0 seconds"));
  EXPECT_THAT(SecondsToMillis(std::nan(""), "timeout"),
              StatusIs(absl::StatusCode::kInvalidArgument, "timeout=nan: must be positive seconds"));
  // Past about 31 years the conversion (and a deadline of now plus it)
  // would overflow: it was -9223372036854775808 ms, i.e. already expired.
  for (double huge : {1e300, std::numeric_limits<double>::infinity(), kMaxSeconds * 1.5}) {
    EXPECT_THAT(SecondsToMillis(huge, "lease", true),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("lease="),
                               HasSubstr(": must be at most 1e+09 seconds (about 31 years)"))))
        << huge;
  }
}

// Durations given as C++ milliseconds: the same rule (a probe's
// lease_timeout=milliseconds::max() expired every lease at once).
TEST(CheckMillisTest, RefusesNegativeZeroAndPastAbout31Years) {
  using std::chrono::milliseconds;
  EXPECT_OK(CheckMillis(milliseconds(1), "timeout"));
  EXPECT_OK(CheckMillis(milliseconds(0), "interval", true));
  EXPECT_OK(CheckMillis(kMaxWait, "timeout"));
  EXPECT_THAT(CheckMillis(milliseconds(0), "timeout"),
              StatusIs(absl::StatusCode::kInvalidArgument, "timeout=0ms: must be positive"));
  EXPECT_THAT(CheckMillis(milliseconds(-1), "interval", true),
              StatusIs(absl::StatusCode::kInvalidArgument, "interval=-1ms: must be >= 0"));
  EXPECT_THAT(CheckMillis(milliseconds::max(), "lease_timeout"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "lease_timeout=9223372036854775807ms: must be at most 1000000000000ms "
                       "(about 31 years)"));
}

TEST(CappedWaitTest, ForEverIsAbout31Years) {
  using std::chrono::milliseconds;
  EXPECT_EQ(CappedWait(milliseconds(5)), milliseconds(5));
  EXPECT_EQ(CappedWait(milliseconds::max()), kMaxWait);
  // Now plus it stays a time to come.
  EXPECT_GT(std::chrono::steady_clock::now() + CappedWait(milliseconds::max()),
            std::chrono::steady_clock::now());
}

}  // namespace
}  // namespace deepnex
