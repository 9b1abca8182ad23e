// Text cut to a size for where it is kept or carried.
#ifndef DEEPNEX_CORE_TEXT_H_
#define DEEPNEX_CORE_TEXT_H_

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace deepnex {

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

// A refused value as an error message quotes it: in double quotes and
// C-escaped, so that a newline, an escape sequence or a quote in it cannot
// break the message (or the terminal that shows it), its first `max` bytes
// with "..." after the quotes where it was cut.
inline std::string Quoted(const std::string& text, size_t max = 64) {
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, max)), "\"",
                      text.size() > max ? "..." : "");
}

}  // namespace deepnex

#endif  // DEEPNEX_CORE_TEXT_H_
