// CRC-32C (Castagnoli), the checksum of ledger records. Software, table
// driven; private to libdeepnex.
#ifndef DEEPNEX_GPU_CRC32C_H_
#define DEEPNEX_GPU_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace deepnex::gpu {

// Extends `crc` (0 to start) over `n` bytes. Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_CRC32C_H_
