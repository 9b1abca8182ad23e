// Text cut to a size for where it is kept or carried.
#ifndef DEEPNEX_CORE_TEXT_H_
#define DEEPNEX_CORE_TEXT_H_

#include <string>

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

}  // namespace deepnex

#endif  // DEEPNEX_CORE_TEXT_H_
