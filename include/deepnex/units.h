// Byte sizes as users write them: "8GiB", "512M", "1.5G", "10GB", "4096";
// and durations given in seconds, as a number.
//
// The rule, the same for every flag, environment variable, Python argument
// and nodes file: K, M, G, T, P, E and KiB..EiB (also Ki..Ei) are powers of
// 1024; KB, MB, GB, TB, PB, EB are powers of 1000 ("10GB" is 10000000000
// bytes); units are case-insensitive and may follow the number after spaces
// ("24 GB" == "24GB"). Sizes are shown in binary units with one decimal:
// "9.3GiB" for 10GB, "16GiB" when exact.
#ifndef DEEPNEX_UNITS_H_
#define DEEPNEX_UNITS_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "deepnex/status.h"

namespace deepnex {

// Parses a non-negative byte size: a decimal number, optionally followed
// (after optional spaces) by a unit. Units are case-insensitive: B; K, M, G, T,
// P, E, their "i" forms (Ki, Mi, ...) and KiB..EiB are powers of 1024; KB,
// MB, GB, TB, PB, EB are powers of 1000. A plain number counts bytes.
// Fractions are allowed with a unit ("1.5G") and rounded down to whole bytes;
// the arithmetic is exact (no floating point). InvalidArgument, naming
// `field` and quoting the text, for "", negatives, "nan"/"inf", a fraction of
// a byte ("1.5"), unknown units ("12XB") and values that overflow uint64:
//   memory: "12XB" is not a byte size (unknown unit "XB"; use B, KiB, ...)
absl::StatusOr<uint64_t> ParseByteSize(const std::string& text,
                                       const std::string& field = "size");

// For people: below 1KiB, bytes ("1000B", "0B"); otherwise the largest of
// KiB, MiB, GiB, TiB, PiB, EiB that is at most `bytes`, as an integer when
// exact (8589934592 -> "8GiB") and else rounded to one decimal, half up
// (10000000000 -> "9.3GiB", 1536 -> "1.5KiB", 1025 -> "1.0KiB": the ".0"
// marks a rounded figure). ParseByteSize reads it back exactly only when
// it is exact.
std::string FormatByteSize(uint64_t bytes);

// The longest duration deepnex takes in seconds, about 31 years: a deadline
// of now plus much more would overflow the clocks' int64 nanoseconds (a
// timeout of 1e300 s became -9223372036854775808 ms).
inline constexpr double kMaxSeconds = 1e9;

// kMaxSeconds as a C++ duration: the longest wait deepnex takes.
inline constexpr std::chrono::milliseconds kMaxWait{int64_t{1000} * 1000 * 1000 * 1000};

// A duration option (a timeout, a lease, an interval) checked as
// SecondsToMillis checks seconds: InvalidArgument naming `field` and the
// value when negative, 0 unless `zero_ok`, or over kMaxWait:
//   timeout=0ms: must be positive
//   lease_timeout=9223372036854775807ms: must be at most 1000000000000ms (about 31 years)
absl::Status CheckMillis(std::chrono::milliseconds value, const std::string& field,
                         bool zero_ok = false);

// A caller's wait capped at kMaxWait, which is for ever in practice:
// milliseconds::max(), C++'s usual "no limit", waits rather than
// overflowing the clock into a deadline already past.
inline std::chrono::milliseconds CappedWait(std::chrono::milliseconds wait) {
  return wait < kMaxWait ? wait : kMaxWait;
}

// `seconds` (a flag's value, a Python float) as whole milliseconds, rounded
// down, and at least 1 when positive. InvalidArgument naming `field` and the value for NaN, a negative
// number, 0 unless `zero_ok`, and more than kMaxSeconds (inf included):
//   timeout=-1.000000: must be positive seconds
//   lease=inf: must be at most 1e+09 seconds (about 31 years)
absl::StatusOr<std::chrono::milliseconds> SecondsToMillis(double seconds,
                                                          const std::string& field,
                                                          bool zero_ok = false);

}  // namespace deepnex

#endif  // DEEPNEX_UNITS_H_
