// Checksums: CRC-32C, and files that prove their own integrity (checkpoints,
// the GPU ledger). Private to libdeepnex; thread-safe.
#ifndef DEEPNEX_CORE_CHECKSUM_H_
#define DEEPNEX_CORE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "deepnex/status.h"

namespace deepnex {

// CRC-32C (Castagnoli), continuing from `crc` (0 to start). Uses the SSE4.2
// instruction where the CPU has it.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// A file that proves its own integrity: an 8-byte `magic`, a u32 format
// version, the body's u64 size and u32 CRC-32C (little-endian), the body.
std::string EncodeChecksummed(const std::string& magic, uint32_t version,
                              const std::string& body);
// The body, or DataLoss naming `what` when the file is truncated, has
// another magic or version, or fails its checksum.
absl::StatusOr<std::string> DecodeChecksummed(const std::string& magic,
                                              uint32_t version,
                                              const std::string& file,
                                              const std::string& what);

}  // namespace deepnex

#endif  // DEEPNEX_CORE_CHECKSUM_H_
