// Byte sizes as users write them: "8GiB", "512M", "1.5G", "4096".
#ifndef DEEPNEX_UNITS_H_
#define DEEPNEX_UNITS_H_

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

// Shortest exact form in binary units, an integer count of the largest unit
// that divides `bytes`: 8589934592 -> "8GiB", 1536 -> "1536B", 1000 -> "1000B",
// 0 -> "0B". ParseByteSize reads it back.
std::string FormatByteSize(uint64_t bytes);

}  // namespace deepnex

#endif  // DEEPNEX_UNITS_H_
