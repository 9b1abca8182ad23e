#include "deepnex/gpu/types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deepnex/units.h"

namespace deepnex::gpu {

const char* ModeName(Mode mode) {
  return mode == Mode::kShared ? "shared" : "exclusive";
}

absl::StatusOr<Mode> ParseMode(const std::string& text, const std::string& field) {
  if (text == "exclusive") return Mode::kExclusive;
  if (text == "shared") return Mode::kShared;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown mode \"", text, "\" (one of exclusive, shared)"));
}

std::string Allocation::ToString() const {
  std::vector<std::string> g;
  for (const auto& gpu : gpus) {
    g.push_back(absl::StrCat(gpu.index, gpu.exclusive ? "" : ":", 
                             gpu.exclusive ? "" : FormatByteSize(gpu.memory)));
  }
  std::string s = absl::StrCat(id, " user=", user, job.empty() ? "" : " job=", job,
                               " node=", node, " gpus=[",
                               absl::StrJoin(g, ","), "] cpus=", cpus,
                               " memory=", FormatByteSize(memory));
  if (!gang.empty()) absl::StrAppend(&s, " gang=", gang, "/", replica);
  if (lease_ms > 0) absl::StrAppend(&s, " lease=", lease_ms, "ms");
  return s;
}

std::string Quota::ToString() const {
  auto count = [](const std::optional<int64_t>& v) {
    return v ? std::to_string(*v) : std::string("unlimited");
  };
  auto bytes = [](const std::optional<uint64_t>& v) {
    return v ? FormatByteSize(*v) : std::string("unlimited");
  };
  return absl::StrCat("gpus=", count(gpus), " gpu_memory=", bytes(gpu_memory),
                      " cpus=", count(cpus), " memory=", bytes(memory),
                      " max_priority=", max_priority);
}

int NodeInfo::gpus_free() const {
  int n = 0;
  for (int c : gpu_allocations) n += c == 0;
  return n;
}

}  // namespace deepnex::gpu
