#include "gpu/invariants.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace deepnex::gpu {

absl::Status CheckInvariants(const Placement& placement,
                             const std::map<uint64_t, AllocRec>& allocs,
                             const std::unordered_map<std::string, Usage>& usage_of) {
  auto fail = [](auto... parts) { return absl::InternalError(absl::StrCat(parts...)); };
  std::map<const NodeState*, std::vector<uint64_t>> mem;
  std::map<const NodeState*, std::vector<int>> count, excl;
  std::map<const NodeState*, std::pair<int64_t, uint64_t>> host;
  std::map<std::string, Usage> usage;
  for (const auto& [name, n] : placement.nodes()) {
    mem[n].assign(n->spec.gpus.size(), 0);
    count[n].assign(n->spec.gpus.size(), 0);
    excl[n].assign(n->spec.gpus.size(), 0);
    host[n] = {0, 0};
  }
  for (const auto& [num, r] : allocs) {
    const NodeState* n = placement.Find(r.a.node);
    if (n == nullptr) return fail(r.a.id, " is on unknown node ", r.a.node);
    if (!n->allocs.count(num)) return fail(r.a.id, " missing from node ", r.a.node);
    Usage& u = usage[r.a.user];
    for (size_t i = 0; i < r.pos.size(); ++i) {
      int p = r.pos[i];
      mem[n][p] += r.a.gpus[i].memory;
      ++count[n][p];
      if (r.a.gpus[i].exclusive) {
        ++excl[n][p];
        if (r.a.gpus[i].memory != n->spec.gpus[p].memory) {
          return fail(r.a.id, ": exclusive GPU ", p, " granted with partial memory");
        }
      }
      u.gpu_memory += r.a.gpus[i].memory;
    }
    u.gpus += r.pos.size();
    u.cpus += r.a.cpus;
    u.memory += r.a.memory;
    host[n].first += r.a.cpus;
    host[n].second += r.a.memory;
  }
  std::set<std::pair<int, int>> want_excl;
  std::set<std::tuple<uint64_t, int, int>> want_shared;
  for (const auto& [name, n] : placement.nodes()) {
    int free = 0, gpu_allocs = 0;
    for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
      if (excl[n][i] > 0 && count[n][i] != 1) {
        return fail("node ", name, " GPU ", i, " is exclusive and held by ", count[n][i],
                    " allocations");
      }
      if (mem[n][i] > n->spec.gpus[i].memory) {
        return fail("node ", name, " GPU ", i, " is overcommitted: ", mem[n][i], " > ",
                    n->spec.gpus[i].memory);
      }
      if (mem[n][i] != n->used_mem[i] || count[n][i] != n->count[i]) {
        return fail("node ", name, " GPU ", i, " counters disagree with its allocations");
      }
      free += count[n][i] == 0;
    }
    for (uint64_t num : n->allocs) gpu_allocs += !allocs.at(num).pos.empty();
    if (free != n->free_gpus || gpu_allocs != n->gpu_allocs) {
      return fail("node ", name, " free GPU / allocation counters are wrong");
    }
    if (host[n].first != n->cpus_used || host[n].second != n->mem_used ||
        n->cpus_used > n->spec.cpus || n->mem_used > n->spec.memory) {
      return fail("node ", name, " cpu/memory accounting is wrong: cpus ", n->cpus_used, "/",
                  n->spec.cpus);
    }
    if (n->allocs.size() != static_cast<size_t>(std::count_if(
                                allocs.begin(), allocs.end(),
                                [&](const auto& kv) { return kv.second.a.node == name; }))) {
      return fail("node ", name, " allocation list is wrong");
    }
    if (n->cordoned || n->pending) continue;
    if (n->mode == Mode::kExclusive) {
      if (free > 0) want_excl.emplace(free, n->id);
      for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
        if (count[n][i] > 0 && excl[n][i] == 0) {
          return fail("node ", name, " is exclusive and GPU ", i, " is shared");
        }
      }
    } else {
      for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
        uint64_t f = n->spec.gpus[i].memory - mem[n][i];
        if (f > 0) want_shared.emplace(f, n->id, static_cast<int>(i));
      }
    }
  }
  if (want_excl != placement.exclusive_index() || want_shared != placement.shared_index()) {
    return fail("placement index is stale");
  }
  for (const auto& [user, u] : usage) {
    auto it = usage_of.find(user);
    if (it == usage_of.end() || it->second.gpus != u.gpus || it->second.cpus != u.cpus ||
        it->second.memory != u.memory || it->second.gpu_memory != u.gpu_memory) {
      return fail("usage of ", user, " is wrong");
    }
  }
  if (usage.size() != usage_of.size()) return fail("usage has stale users");
  return absl::OkStatus();
}

}  // namespace deepnex::gpu
