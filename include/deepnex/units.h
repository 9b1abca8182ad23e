// Byte sizes as users write them: "8GiB", "512M", "1.5G", "4096".
#ifndef DEEPNEX_UNITS_H_
#define DEEPNEX_UNITS_H_

#include <cstdint>
#include <string>

#include "deepnex/status.h"

namespace deepnex {

// Parses a non-negative byte size. Suffixes (case-insensitive): B; K, M, G,
// T, P and KiB..PiB are powers of 1024; KB, MB, GB, TB, PB are powers of 1000.
// Fractions are allowed ("1.5G") and rounded down to whole bytes.
// InvalidArgument, naming `field` and the text, for "", negatives, unknown
// suffixes ("12XB") and values that overflow uint64.
absl::StatusOr<uint64_t> ParseByteSize(const std::string& text,
                                       const std::string& field = "size");

// Shortest exact form in binary units: 8589934592 -> "8GiB", 1000 -> "1000B".
std::string FormatByteSize(uint64_t bytes);

}  // namespace deepnex

#endif  // DEEPNEX_UNITS_H_
