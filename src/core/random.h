// Unguessable names and tickets. Private to libdeepnex.
#ifndef DEEPNEX_CORE_RANDOM_H_
#define DEEPNEX_CORE_RANDOM_H_

#include <cstddef>
#include <string>

namespace deepnex {

// `bytes` random bytes from the kernel (getrandom) as 2 * bytes lowercase
// hex digits.
std::string RandomHex(size_t bytes);

}  // namespace deepnex

#endif  // DEEPNEX_CORE_RANDOM_H_
