// The job environment contract: what a launcher gives every process of a job
// (see ARCHITECTURE.md, "The job environment").
#ifndef DEEPNEX_ENV_H_
#define DEEPNEX_ENV_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex {

enum class Role { kWorker, kPs, kChief };
const char* RoleName(Role role);

// What this process is within its job. Plain value; thread-compatible.
struct Context {
  std::string job_id;
  Role role = Role::kWorker;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::vector<std::string> ps_addrs;         // host:port each
  std::string store_addr;                    // host:port, empty if none
  std::string token;                         // empty if none
  std::string cuda_visible_devices;          // as given, empty if unset
  std::string nvidia_visible_devices;        // as given, empty if unset
  std::optional<uint64_t> gpu_memory_limit;  // bytes per GPU (shared mode)

  // Reads the DEEPNEX_* variables from the process environment.
  // DEEPNEX_JOB_ID, DEEPNEX_ROLE (worker|ps|chief), DEEPNEX_RANK and
  // DEEPNEX_WORLD_SIZE (decimal, 0 <= rank < world_size) are required and
  // must not be empty; the rest are optional, and an empty optional variable
  // counts as unset. DEEPNEX_LOCAL_RANK (default 0) must be >= 0;
  // DEEPNEX_PS_ADDRS is comma-separated host:port ([v6addr]:port), port
  // 1..65535; DEEPNEX_GPU_MEMORY_LIMIT is a byte size (ParseByteSize). Other
  // variables are taken as given. A missing or malformed variable is
  // InvalidArgument naming it and its value, e.g.
  //   DEEPNEX_RANK="x" is not an integer
  static absl::StatusOr<Context> FromEnv();
  // Same, reading variables through `getenv` (for tests and launchers).
  static absl::StatusOr<Context> FromLookup(
      const std::function<std::optional<std::string>(const std::string&)>&
          getenv);

  // The variables that reproduce this context (FromLookup of the result
  // gives it back), omitting empty optional fields, plus torchrun's RANK,
  // WORLD_SIZE and LOCAL_RANK, and MASTER_ADDR/MASTER_PORT when store_addr
  // is host:port. Holds the token: do not log it.
  std::map<std::string, std::string> ToEnv() const;
};

}  // namespace deepnex

#endif  // DEEPNEX_ENV_H_
