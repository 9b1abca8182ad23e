#include "deepnex/units.h"

#include <cctype>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace deepnex {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

struct Unit {
  const char* name;  // lower case
  uint64_t multiplier;
};

constexpr uint64_t kKi = uint64_t{1} << 10;
constexpr uint64_t kK = 1000;

// Every accepted suffix, compared case-insensitively.
constexpr Unit kUnits[] = {
    {"b", 1},
    {"k", kKi},
    {"m", kKi* kKi},
    {"g", kKi* kKi* kKi},
    {"t", kKi* kKi* kKi* kKi},
    {"p", kKi* kKi* kKi* kKi* kKi},
    {"e", kKi* kKi* kKi* kKi* kKi* kKi},
    {"ki", kKi},
    {"mi", kKi* kKi},
    {"gi", kKi* kKi* kKi},
    {"ti", kKi* kKi* kKi* kKi},
    {"pi", kKi* kKi* kKi* kKi* kKi},
    {"ei", kKi* kKi* kKi* kKi* kKi* kKi},
    {"kib", kKi},
    {"mib", kKi* kKi},
    {"gib", kKi* kKi* kKi},
    {"tib", kKi* kKi* kKi* kKi},
    {"pib", kKi* kKi* kKi* kKi* kKi},
    {"eib", kKi* kKi* kKi* kKi* kKi* kKi},
    {"kb", kK},
    {"mb", kK* kK},
    {"gb", kK* kK* kK},
    {"tb", kK* kK* kK* kK},
    {"pb", kK* kK* kK* kK* kK},
    {"eb", kK* kK* kK* kK* kK* kK},
};

absl::Status NotAByteSize(const std::string& field, const std::string& text,
                          absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": \"", absl::CEscape(text), "\" is not a byte size (", why, ")"));
}

// floor(multiplier * 0.<digits>), exactly. Horner's scheme from the last
// digit, using floor(floor(x) / 10) == floor(x / 10): every intermediate
// stays below 10 * multiplier, which fits in 128 bits.
uint64_t FractionTimes(absl::string_view digits, uint64_t multiplier) {
  unsigned __int128 t = 0;
  for (size_t i = digits.size(); i-- > 0;) {
    t = static_cast<unsigned __int128>(digits[i] - '0') * multiplier + t / 10;
  }
  return static_cast<uint64_t>(t / 10);
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(const std::string& text,
                                       const std::string& field) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  if (s.empty()) return NotAByteSize(field, text, "empty");
  if (s[0] == '-') return NotAByteSize(field, text, "negative");

  size_t i = 0;
  while (i < s.size() && absl::ascii_isdigit(s[i])) ++i;
  absl::string_view whole = s.substr(0, i);
  absl::string_view fraction;
  bool has_point = false;
  if (i < s.size() && s[i] == '.') {
    has_point = true;
    size_t start = ++i;
    while (i < s.size() && absl::ascii_isdigit(s[i])) ++i;
    fraction = s.substr(start, i - start);
  }
  if (whole.empty() && fraction.empty()) {
    return NotAByteSize(field, text,
                        "no number; write e.g. \"8GiB\", \"512M\" or \"4096\"");
  }
  if (whole.empty() || (has_point && fraction.empty())) {
    return NotAByteSize(field, text,
                        "a number needs digits on both sides of '.'");
  }

  if (i < s.size() && s[i] == '.') {
    return NotAByteSize(field, text, "a number has at most one '.'");
  }
  absl::string_view suffix = absl::StripLeadingAsciiWhitespace(s.substr(i));
  uint64_t multiplier = 1;
  if (!suffix.empty()) {
    std::string lower = absl::AsciiStrToLower(suffix);
    const Unit* unit = nullptr;
    for (const Unit& u : kUnits) {
      if (lower == u.name) unit = &u;
    }
    // "1e9": a number written as C or Python would, not a unit.
    if (unit == nullptr && lower.size() > 1 && lower[0] == 'e' &&
        lower.find_first_not_of("0123456789", lower[1] == '+' || lower[1] == '-' ? 2 : 1) ==
            std::string::npos &&
        lower.size() > (lower[1] == '+' || lower[1] == '-' ? 2u : 1u)) {
      return NotAByteSize(field, text,
                          "an exponent is not taken; write the digits, or use a unit such as "
                          "\"1G\" or \"1GB\"");
    }
    if (unit == nullptr) {
      return NotAByteSize(
          field, text,
          absl::StrCat("unknown unit \"", absl::CEscape(suffix),
                       "\"; use B, KiB, MiB, GiB, TiB, PiB, EiB, K, M, G, T, "
                       "P, E, KB, MB, GB, TB, PB or EB"));
    }
    multiplier = unit->multiplier;
  }
  if (multiplier == 1 && !fraction.empty() &&
      fraction.find_first_not_of('0') != absl::string_view::npos) {
    return NotAByteSize(field, text,
                        "a fraction of a byte; give whole bytes or a unit");
  }

  constexpr char kTooLarge[] =
      "too large; the largest byte size is 18446744073709551615 (16EiB - 1)";
  uint64_t value = 0;
  for (char c : whole) {
    uint64_t digit = static_cast<uint64_t>(c - '0');
    if (value > (kMax - digit) / 10)
      return NotAByteSize(field, text, kTooLarge);
    value = value * 10 + digit;
  }
  if (value != 0 && multiplier > kMax / value) {
    return NotAByteSize(field, text, kTooLarge);
  }
  value *= multiplier;
  uint64_t extra = fraction.empty() ? 0 : FractionTimes(fraction, multiplier);
  if (extra > kMax - value) return NotAByteSize(field, text, kTooLarge);
  return value + extra;
}

std::string FormatByteSize(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B",   "KiB", "MiB", "GiB",
                                           "TiB", "PiB", "EiB"};
  int unit = 0;
  while (unit < 6 && bytes >= (uint64_t{1} << (10 * (unit + 1)))) ++unit;
  if (unit == 0) return absl::StrCat(bytes, "B");
  const uint64_t size = uint64_t{1} << (10 * unit);
  if (bytes % size == 0) return absl::StrCat(bytes / size, kNames[unit]);
  // Tenths, rounded half up; 1023.96MiB rounds to 1024.0MiB, shown as the
  // next unit's "1.0GiB" so that a unit never reaches 1024 of itself.
  auto tenths = [&](uint64_t unit_size) {
    return static_cast<uint64_t>(
        (static_cast<unsigned __int128>(bytes) * 10 + unit_size / 2) / unit_size);
  };
  uint64_t t = tenths(size);
  if (t >= 10240 && unit < 6) {
    ++unit;
    t = tenths(size << 10);
  }
  // An inexact size keeps its ".0" ("1.0GiB" is not exactly 1GiB).
  return absl::StrCat(t / 10, ".", t % 10, kNames[unit]);
}

absl::Status CheckMillis(std::chrono::milliseconds value, const std::string& field,
                         bool zero_ok) {
  if (zero_ok ? value.count() < 0 : value.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, "=", value.count(), "ms: must be ",
                                                   zero_ok ? ">= 0" : "positive"));
  }
  if (value > kMaxWait) {
    return absl::InvalidArgumentError(absl::StrCat(field, "=", value.count(),
                                                   "ms: must be at most ", kMaxWait.count(),
                                                   "ms (about 31 years)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::chrono::milliseconds> SecondsToMillis(double seconds,
                                                          const std::string& field,
                                                          bool zero_ok) {
  if (zero_ok ? !(seconds >= 0) : !(seconds > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(field, "=", std::to_string(seconds),
                                                   zero_ok ? ": must be >= 0 seconds"
                                                           : ": must be positive seconds"));
  }
  if (seconds > kMaxSeconds) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, "=", seconds, ": must be at most ", kMaxSeconds, " seconds (about 31 years)"));
  }
  // Whole milliseconds, rounded down; a positive time under one is one, not
  // 0 (which means "none" where it is allowed, and was refused as "0 ms").
  const auto ms = static_cast<int64_t>(seconds * 1000);
  return std::chrono::milliseconds(ms == 0 && seconds > 0 ? 1 : ms);
}

}  // namespace deepnex
