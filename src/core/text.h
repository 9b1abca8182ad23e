// Text cut to a size for where it is kept or carried.
#ifndef DEEPNEX_CORE_TEXT_H_
#define DEEPNEX_CORE_TEXT_H_

#include <charconv>
#include <cstdint>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace deepnex {

// The shortest text that reads back as `v` (%g keeps six digits: an lr of
// 0.0012345678 showed, and went to the servers, as 0.00123457).
inline std::string ShortestDouble(double v) {
  char text[32];
  return std::string(text, std::to_chars(text, text + sizeof(text), v).ptr);
}

// `text` kept to its first `max` bytes or fewer, never inside a UTF-8
// character, with "... (N more bytes)" after it where it was cut: its start,
// which names what it is about, stays.
inline std::string CutText(std::string text, size_t max) {
  if (text.size() <= max) return text;
  size_t keep = max;
  while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  const size_t cut = text.size() - keep;
  text.resize(keep);
  absl::StrAppend(&text, "... (", cut, " more bytes)");
  return text;
}

// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or
// code points past U+10FFFF), as protobuf's string fields must be.
inline bool IsUtf8(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned char c = *p;
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || static_cast<size_t>(end - p) < n) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t i = 1; i < n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    static constexpr uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += n;
  }
  return true;
}

// A refused value as an error message quotes it: in double quotes and
// C-escaped, so that a newline, an escape sequence or a quote in it cannot
// break the message (or the terminal that shows it), its first `max` bytes
// with "..." after the quotes where it was cut.
inline std::string Quoted(const std::string& text, size_t max = 64) {
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, max)), "\"",
                      text.size() > max ? "..." : "");
}

// A refused path quoted as Quoted does, but whole up to 1 KiB: cut at 64
// bytes a real path (a CI run's tmp_path) lost the end that tells which file
// it was.
inline std::string QuotedPath(const std::string& path) { return Quoted(path, 1024); }

}  // namespace deepnex

#endif  // DEEPNEX_CORE_TEXT_H_
