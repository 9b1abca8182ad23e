// CRC-32C and self-checking files (see checksum.h).
#include "core/checksum.h"

#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace deepnex {
namespace {

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    t[i] = c;
  }
  return t;
}

uint32_t Crc32cTable(const uint8_t* p, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* p, size_t n,
                                                          uint32_t crc) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
#endif

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? Crc32cHardware(p, n, crc) : Crc32cTable(p, n, crc);
#else
  crc = Crc32cTable(p, n, crc);
#endif
  return ~crc;
}

namespace {

template <typename T>
void PutLE(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

template <typename T>
T GetLE(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

constexpr size_t kChecksummedHeader = 8 + 4 + 8 + 4;

}  // namespace

std::string EncodeChecksummed(const std::string& magic, uint32_t version,
                              const std::string& body) {
  std::string out = magic.substr(0, 8);
  out.resize(8, '\0');
  PutLE<uint32_t>(&out, version);
  PutLE<uint64_t>(&out, body.size());
  PutLE<uint32_t>(&out, Crc32c(body.data(), body.size()));
  out += body;
  return out;
}

absl::StatusOr<std::string> DecodeChecksummed(const std::string& magic, uint32_t version,
                                              const std::string& file,
                                              const std::string& what) {
  std::string want = magic.substr(0, 8);
  want.resize(8, '\0');
  if (file.size() < kChecksummedHeader) {
    return absl::DataLossError(absl::StrCat(what, " is truncated: ", file.size(),
                                            " bytes, not even a header"));
  }
  if (file.compare(0, 8, want) != 0) {
    return absl::DataLossError(absl::StrCat(what, " is not a ", magic, " file"));
  }
  uint32_t got_version = GetLE<uint32_t>(file.data() + 8);
  if (got_version != version) {
    return absl::DataLossError(absl::StrCat(what, " has format version ", got_version,
                                            ", this build reads ", version));
  }
  uint64_t size = GetLE<uint64_t>(file.data() + 12);
  uint32_t crc = GetLE<uint32_t>(file.data() + 20);
  if (file.size() - kChecksummedHeader != size) {
    return absl::DataLossError(absl::StrCat(what, " is truncated or padded: the body has ",
                                            file.size() - kChecksummedHeader,
                                            " bytes, the header says ", size));
  }
  std::string body = file.substr(kChecksummedHeader);
  if (Crc32c(body.data(), body.size()) != crc) {
    return absl::DataLossError(absl::StrCat(what, " is damaged: checksum mismatch"));
  }
  return body;
}

}  // namespace deepnex
