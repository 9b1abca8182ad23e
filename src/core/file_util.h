// Durable files: checksums and atomic replacement, for checkpoints and logs.
// Private to libdeepnex.
#ifndef DEEPNEX_CORE_FILE_UTIL_H_
#define DEEPNEX_CORE_FILE_UTIL_H_

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

// Replaces `path` with `data` atomically: writes a temporary file beside it,
// fsyncs it, renames it over `path` and fsyncs the directory. A crash leaves
// either the old file or the new one, never a mix.
absl::Status WriteFileAtomically(const std::string& path, const std::string& data);

// The whole file; NotFound naming `what` and the path if it cannot be read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path,
                                          const std::string& what);

// Creates `dir` and its parents if needed.
absl::Status MakeDirectories(const std::string& dir);

}  // namespace deepnex

#endif  // DEEPNEX_CORE_FILE_UTIL_H_
