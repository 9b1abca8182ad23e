// Error handling shared by every part of deepnex.
//
// Every fallible public function returns absl::Status or absl::StatusOr<T>;
// no exception crosses the C++ API. Codes are gRPC's (see ARCHITECTURE.md).
#ifndef DEEPNEX_STATUS_H_
#define DEEPNEX_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DEEPNEX_STATUS_CONCAT_INNER_(a, b) a##b
#define DEEPNEX_STATUS_CONCAT_(a, b) DEEPNEX_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define DEEPNEX_RETURN_IF_ERROR(expr)                   \
  do {                                                  \
    ::absl::Status deepnex_status_ = (expr);            \
    if (!deepnex_status_.ok()) return deepnex_status_;  \
  } while (0)

// `lhs` is a declaration or an lvalue; `rexpr` a StatusOr<T>. Returns the
// error from the enclosing function, or moves the value into `lhs`.
#define DEEPNEX_ASSIGN_OR_RETURN(lhs, rexpr)                                  \
  DEEPNEX_ASSIGN_OR_RETURN_IMPL_(                                             \
      DEEPNEX_STATUS_CONCAT_(deepnex_statusor_, __LINE__), lhs, rexpr)
#define DEEPNEX_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // DEEPNEX_STATUS_H_
