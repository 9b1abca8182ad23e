#include "gpu/placement.h"

#include <algorithm>
#include <cctype>
#include <climits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/text.h"
#include "deepnex/units.h"

namespace deepnex::gpu {
namespace {

std::string Selector(const std::map<std::string, std::string>& sel) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : sel) parts.push_back(absl::StrCat(k, "=", v));
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

// What is free on `n` for others than the head of the queue: its free
// capacity less what `h` keeps for the head there.
int FreeCpus(const NodeState* n, const Hold* h) {
  return n->spec.cpus - n->cpus_used - (h ? h->cpus : 0);
}

uint64_t FreeMemory(const NodeState* n, const Hold* h) {
  const uint64_t free = n->spec.memory - n->mem_used, held = h ? h->memory : 0;
  return free > held ? free - held : 0;
}

uint64_t FreeGpuMemory(const NodeState* n, const Hold* h, int i) {
  const uint64_t free = n->spec.gpus[i].memory - n->used_mem[i];
  const uint64_t held = h && !h->gpu.empty() ? h->gpu[i] : 0;
  return free > held ? free - held : 0;
}

// How many parts of `r` node `spec` could hold at once when empty. A part
// needs r.gpus distinct GPUs with room for it, so P parts fit when the GPUs'
// room, each counted at most P times, adds up to P * r.gpus.
int64_t PartsThatFit(const Node& spec, const Request& r) {
  int64_t parts = r.replicas;
  if (r.cpus > 0) parts = std::min<int64_t>(parts, spec.cpus / r.cpus);
  if (r.memory > 0) parts = std::min<int64_t>(parts, static_cast<int64_t>(spec.memory / r.memory));
  if (r.gpus == 0) return parts;
  std::vector<int64_t> room;
  for (const Gpu& g : spec.gpus) {
    if (g.memory < r.gpu_memory) continue;
    room.push_back(r.mode == Mode::kExclusive || r.gpu_memory == 0
                       ? 1
                       : static_cast<int64_t>(std::min<uint64_t>(g.memory / r.gpu_memory,
                                                                 r.replicas)));
  }
  auto fits = [&](int64_t p) {
    int64_t sum = 0;
    for (int64_t x : room) sum += std::min(x, p);
    return sum >= p * r.gpus;
  };
  // fits holds from 0 up to the answer and not beyond (its slack is concave).
  int64_t lo = 0, hi = parts;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

bool GpuHeld(const Hold* h, int i) { return h && !h->gpu.empty() && h->gpu[i] > 0; }

// `n` could take a part of `r` by its name, labels, state and mode.
bool Eligible(const NodeState& n, const Request& r) {
  if (!r.node.empty() && n.spec.name != r.node) return false;
  for (const auto& [k, v] : r.selector) {
    auto it = n.spec.labels.find(k);
    if (it == n.spec.labels.end() || it->second != v) return false;
  }
  return !n.cordoned && n.ready && (r.gpus == 0 || (!n.pending && n.mode == r.mode));
}

// The id, GPU indices and UUIDs and env of `r`, booked on `n`.
void FillAllocation(const NodeState& n, AllocRec* r) {
  Allocation& a = r->a;
  a.id = AllocId(r->num);
  std::vector<std::string> idx, uuids;
  bool shared = false;
  for (size_t i = 0; i < r->pos.size(); ++i) {
    const Gpu& g = n.spec.gpus[r->pos[i]];
    a.gpus[i].index = g.index;
    a.gpus[i].uuid = g.uuid;
    idx.push_back(std::to_string(g.index));
    uuids.push_back(g.uuid);
    shared |= !a.gpus[i].exclusive;
  }
  a.env.clear();
  a.env["CUDA_VISIBLE_DEVICES"] = absl::StrJoin(idx, ",");
  a.env["NVIDIA_VISIBLE_DEVICES"] = uuids.empty() ? "void" : absl::StrJoin(uuids, ",");
  if (shared) a.env["DEEPNEX_GPU_MEMORY_LIMIT"] = std::to_string(a.gpus[0].memory);
}

}  // namespace

bool ValidName(const std::string& s) {
  if (s.empty() || s.size() > 253) return false;
  for (char c : s) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '@')) {
      return false;
    }
  }
  return true;
}

absl::Status CheckLabel(const std::string& where, const std::string& key,
                        const std::string& value) {
  // As Kubernetes labels (prefix/name keys), so that a selector written for
  // a cluster's nodes means the same here; 253 bounds what every node record
  // and every NodeInfo carries.
  auto plain = [](const std::string& s, bool slash) {
    for (char c : s) {
      if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
            (slash && c == '/'))) {
        return false;
      }
    }
    return s.size() <= 253;
  };
  if (key.empty() || !plain(key, true)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": label key ", Quoted(key),
                     ": use 1-253 letters, digits, '-', '_', '.', '/'"));
  }
  if (!plain(value, false)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": label ", key, "=", Quoted(value),
                     ": use at most 253 letters, digits, '-', '_', '.'"));
  }
  return absl::OkStatus();
}

absl::Status CheckMode(Mode mode, const std::string& field) {
  if (mode == Mode::kExclusive || mode == Mode::kShared) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, "=", static_cast<int>(mode), " is not a Mode (exclusive, shared)"));
}

absl::Status ValidateRequest(const Request& r) {
  auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!ValidName(r.user)) {
    return bad("user ", Quoted(r.user), ": use 1-253 letters, digits, '-', '_', '.', '@'");
  }
  if (!r.job.empty() && !ValidName(r.job)) {
    return bad("job ", Quoted(r.job), ": use 1-253 letters, digits, '-', '_', '.', '@'");
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMode(r.mode, "mode"));
  if (r.gpus < 0) return bad("gpus=", r.gpus, " must be >= 0");
  if (r.gpus > 4096) return bad("gpus=", r.gpus, " is more than any node has");
  if (r.cpus < 0) return bad("cpus=", r.cpus, " must be >= 0");
  if (r.replicas < 1) return bad("replicas=", r.replicas, " must be >= 1");
  if (r.replicas > 100000) return bad("replicas=", r.replicas, " is too many");
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(r.lease, "lease", true));
  if (r.gpus > 0 && r.mode == Mode::kShared && r.gpu_memory == 0) {
    return bad("gpu_memory=0B: a shared request must give the GPU memory it needs per GPU "
               "(--gpu-memory)");
  }
  if (r.gpus == 0 && r.gpu_memory > 0) {
    return bad("gpu_memory=", FormatByteSize(r.gpu_memory),
               " with gpus=0: GPU memory is asked per GPU (--gpu-memory with --gpus or "
               "--gpus-per-worker); ask for GPUs, or leave it out");
  }
  if (r.gpus == 0 && r.cpus == 0 && r.memory == 0) {
    return bad("the request asks for nothing (gpus=0, cpus=0, memory=0B)");
  }
  for (const auto& [k, v] : r.selector) DEEPNEX_RETURN_IF_ERROR(CheckLabel("selector", k, v));
  return absl::OkStatus();
}

std::string NameList(const std::vector<std::string>& names, size_t max) {
  std::vector<std::string> shown(names.begin(),
                                 names.begin() + std::min(names.size(), max));
  std::string s = absl::StrJoin(shown, ", ");
  if (names.size() > max) absl::StrAppend(&s, ", ... (", names.size(), " in all)");
  return s;
}

namespace {

// "1 exclusive GPU", "2 shared GPUs".
std::string GpusOf(const Request& r) {
  return absl::StrCat(r.gpus, " ", ModeName(r.mode), r.gpus == 1 ? " GPU" : " GPUs");
}

}  // namespace

std::string Describe(const Request& r) {
  std::string s = absl::StrCat(r.user, " asks ");
  if (r.replicas > 1) absl::StrAppend(&s, r.replicas, " x (");
  absl::StrAppend(&s, GpusOf(r));
  if (r.gpu_memory > 0) absl::StrAppend(&s, " of ", FormatByteSize(r.gpu_memory));
  absl::StrAppend(&s, ", ", r.cpus, " cpus, ", FormatByteSize(r.memory), " memory");
  if (r.replicas > 1) absl::StrAppend(&s, ")");
  return s;
}

NodeState* Placement::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

absl::Status Placement::Validate(Node* node) const {
  const std::string& name = node->name;
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node name ", Quoted(name), ": use 1-253 letters, digits, '-', '_', '.'"));
  }
  if (Find(name) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("node ", name, " already exists"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMode(node->mode, absl::StrCat("node ", name, ": mode")));
  if (node->cpus <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("node ", name, ": cpus=", node->cpus, " must be positive"));
  }
  if (node->memory == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("node ", name, ": memory=0 must be positive"));
  }
  std::set<int> indices;
  std::set<std::string> uuids;
  for (size_t i = 0; i < node->gpus.size(); ++i) {
    Gpu& g = node->gpus[i];
    if (g.memory == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", name, ": gpus[", i, "].memory=0 must be positive"));
    }
    if (g.index < 0) g.index = static_cast<int>(i);
    if (!indices.insert(g.index).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", name, ": gpus[", i, "].index=", g.index, " is used twice"));
    }
    if (g.uuid.empty()) g.uuid = absl::StrCat("GPU-", name, "-", g.index);
    if (!uuids.insert(g.uuid).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("node ", name, ": gpus[", i, "].uuid=", g.uuid, " is used twice"));
    }
    auto other = uuids_.find(g.uuid);
    if (other != uuids_.end()) {
      return absl::AlreadyExistsError(absl::StrCat("node ", name, ": gpus[", i, "].uuid=",
                                                   g.uuid, " is already on node ",
                                                   other->second));
    }
  }
  uint64_t gpu_memory = 0;
  for (const Gpu& g : node->gpus) {
    if (__builtin_add_overflow(gpu_memory, g.memory, &gpu_memory)) gpu_memory = UINT64_MAX;
  }
  if (gpu_memory > kMaxTotalBytes - gpu_memory_ || node->memory > kMaxTotalBytes - memory_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node ", name, ": ", FormatByteSize(gpu_memory), " of GPU memory and ",
        FormatByteSize(node->memory), " of memory would take the nodes' total past ",
        FormatByteSize(kMaxTotalBytes), " (they hold ", FormatByteSize(gpu_memory_), " and ",
        FormatByteSize(memory_), ")"));
  }
  for (const auto& [k, v] : node->labels) {
    DEEPNEX_RETURN_IF_ERROR(CheckLabel(absl::StrCat("node ", name), k, v));
  }
  return absl::OkStatus();
}

void Placement::Add(std::unique_ptr<NodeState> n) {
  const size_t g = n->spec.gpus.size();
  n->shared_free.assign(g, 0);
  n->used_mem.assign(g, 0);
  n->count.assign(g, 0);
  n->free_gpus = static_cast<int>(g);
  n->id = static_cast<int>(slots_.size());
  for (const auto& gpu : n->spec.gpus) {
    uuids_[gpu.uuid] = n->spec.name;
    gpu_memory_ += gpu.memory;
  }
  memory_ += n->spec.memory;
  by_name_[n->spec.name] = n.get();
  Index(n.get());
  slots_.push_back(std::move(n));
}

void Placement::Remove(NodeState* n) {
  Unindex(n);
  for (const auto& gpu : n->spec.gpus) {
    uuids_.erase(gpu.uuid);
    gpu_memory_ -= gpu.memory;
  }
  memory_ -= n->spec.memory;
  by_name_.erase(n->spec.name);
  slots_[n->id].reset();
}

void Placement::SetMode(NodeState* n, Mode mode, bool pending) {
  Unindex(n);
  if (pending) {
    n->pending = mode;
  } else {
    n->mode = mode;
    n->spec.mode = mode;
    n->pending.reset();
  }
  Index(n);
}

void Placement::SetFlags(NodeState* n, bool cordoned, bool draining) {
  Unindex(n);
  n->cordoned = cordoned;
  n->draining = draining;
  Index(n);
}

void Placement::SetReady(NodeState* n, bool ready) {
  Unindex(n);
  n->ready = ready;
  Index(n);
}

void Placement::Clear() {
  slots_.clear();
  by_name_.clear();
  uuids_.clear();
  excl_.clear();
  shared_.clear();
}

void Placement::Book(NodeState* n, AllocRec* r) {
  FillAllocation(*n, r);
  const bool fast = FastReindex(n);
  if (!fast) Unindex(n);
  for (size_t i = 0; i < r->pos.size(); ++i) {
    int p = r->pos[i];
    if (n->count[p] == 0) --n->free_gpus;
    ++n->count[p];
    n->used_mem[p] += r->a.gpus[i].memory;
  }
  n->cpus_used += r->a.cpus;
  n->mem_used += r->a.memory;
  if (!r->pos.empty()) ++n->gpu_allocs;
  n->allocs.insert(r->num);
  if (fast) {
    for (int p : r->pos) ReindexGpu(n, p);
  } else {
    Index(n);
  }
}

void Placement::Unbook(NodeState* n, const AllocRec& r) {
  const bool fast = FastReindex(n);
  if (!fast) Unindex(n);
  for (size_t i = 0; i < r.pos.size(); ++i) {
    int p = r.pos[i];
    --n->count[p];
    if (n->count[p] == 0) ++n->free_gpus;
    n->used_mem[p] -= r.a.gpus[i].memory;
  }
  n->cpus_used -= r.a.cpus;
  n->mem_used -= r.a.memory;
  if (!r.pos.empty()) --n->gpu_allocs;
  n->allocs.erase(r.num);
  if (fast) {
    for (int p : r.pos) ReindexGpu(n, p);
  } else {
    Index(n);
  }
}

NodeInfo Placement::Info(const NodeState& n) const {
  NodeInfo info;
  info.node = n.spec;
  info.node.mode = n.mode;
  info.mode = n.mode;
  info.pending_mode = n.pending;
  info.cordoned = n.cordoned;
  info.draining = n.draining;
  info.ready = n.ready;
  info.gpu_memory_used = n.used_mem;
  info.gpu_allocations = n.count;
  info.cpus_used = n.cpus_used;
  info.memory_used = n.mem_used;
  for (uint64_t num : n.allocs) info.allocation_ids.push_back(AllocId(num));
  return info;
}

void Placement::Unindex(NodeState* n) {
  if (n->in_excl) excl_.erase(n->excl_key);
  n->in_excl = false;
  for (size_t i = 0; i < n->shared_free.size(); ++i) {
    if (n->shared_free[i] > 0) shared_.erase({n->shared_free[i], n->id, static_cast<int>(i)});
    n->shared_free[i] = 0;
  }
}

void Placement::Index(NodeState* n) {
  if (n->cordoned || !n->ready || n->pending) return;
  if (n->mode == Mode::kExclusive) {
    if (n->free_gpus > 0) {
      n->excl_key = {n->free_gpus, n->id};
      excl_.insert(n->excl_key);
      n->in_excl = true;
    }
  } else {
    for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
      uint64_t free = n->spec.gpus[i].memory - n->used_mem[i];
      n->shared_free[i] = free;
      if (free > 0) shared_.emplace(free, n->id, static_cast<int>(i));
    }
  }
}

bool Placement::FastReindex(const NodeState* n) {
  return n->mode == Mode::kShared && !n->cordoned && n->ready && !n->pending;
}

void Placement::ReindexGpu(NodeState* n, int i) {
  uint64_t& key = n->shared_free[i];
  if (key > 0) shared_.erase({key, n->id, i});
  key = n->spec.gpus[i].memory - n->used_mem[i];
  if (key > 0) shared_.emplace(key, n->id, i);
}

const Hold* Placement::HoldOn(const NodeState* n) const {
  if (held_.empty()) return nullptr;
  auto it = held_.find(n);
  return it == held_.end() ? nullptr : &it->second;
}

bool Placement::FitOnNode(NodeState* n, const Request& r, std::vector<int>* pos) const {
  if (n->cordoned || !n->ready) return false;
  const Hold* h = HoldOn(n);
  if (FreeCpus(n, h) < r.cpus) return false;
  if (FreeMemory(n, h) < r.memory) return false;
  for (const auto& [k, v] : r.selector) {
    auto it = n->spec.labels.find(k);
    if (it == n->spec.labels.end() || it->second != v) return false;
  }
  pos->clear();
  if (r.gpus == 0) return true;
  if (n->pending || n->mode != r.mode) return false;
  const auto& gpus = n->spec.gpus;
  std::vector<int> cand;
  cand.reserve(gpus.size());
  const bool excl = r.mode == Mode::kExclusive;
  for (size_t i = 0; i < gpus.size(); ++i) {
    const int k = static_cast<int>(i);
    if (excl ? (n->count[i] == 0 && gpus[i].memory >= r.gpu_memory && !GpuHeld(h, k))
             : (FreeGpuMemory(n, h, k) >= r.gpu_memory)) {
      cand.push_back(k);
    }
  }
  if (static_cast<int>(cand.size()) < r.gpus) return false;
  if (!excl) {
    // Best fit: the GPUs with the least free memory that still fits (most
    // free when spreading); index order breaks ties. The parts of a gang
    // that take several GPUs each go to the most free ones: taking the GPUs
    // with the most room left fits as many parts as the node can hold,
    // where best fit could use up the small GPUs first and strand a large
    // one that no part can use alone (Infeasible counts the same way).
    const bool most_free_first = r.spread || (r.replicas > 1 && r.gpus > 1);
    auto free = [&](int i) { return FreeGpuMemory(n, h, i); };
    auto before = [&](int a, int b) {
      return most_free_first ? free(a) > free(b) : free(a) < free(b);
    };
    for (size_t i = 1; i < cand.size(); ++i) {  // stable insertion sort: few GPUs
      int x = cand[i];
      size_t j = i;
      for (; j > 0 && before(x, cand[j - 1]); --j) cand[j] = cand[j - 1];
      cand[j] = x;
    }
  }
  if (r.gpus > 1) {
    // Prefer one switch, then one NUMA node: the smallest group that holds
    // the whole request keeps larger groups whole for larger requests.
    for (int level = 0; level < 2; ++level) {
      std::map<int, std::vector<int>> groups;
      for (int i : cand) {
        int key = level == 0 ? gpus[i].switch_id : gpus[i].numa_node;
        if (key >= 0) groups[key].push_back(i);
      }
      const std::vector<int>* best = nullptr;
      for (const auto& [key, members] : groups) {
        if (static_cast<int>(members.size()) >= r.gpus &&
            (best == nullptr || members.size() < best->size())) {
          best = &members;
        }
      }
      if (best != nullptr) {
        pos->assign(best->begin(), best->begin() + r.gpus);
        return true;
      }
    }
  }
  pos->assign(cand.begin(), cand.begin() + r.gpus);
  return true;
}

NodeState* Placement::Place(const Request& r, std::vector<int>* pos) {
  if (!r.node.empty()) {
    NodeState* n = Find(r.node);
    return n != nullptr && FitOnNode(n, r, pos) ? n : nullptr;
  }
  if (r.gpus == 0) {
    NodeState* best = nullptr;
    for (const auto& slot : slots_) {
      NodeState* n = slot.get();
      if (n == nullptr || !FitOnNode(n, r, pos)) continue;
      if (!r.spread) return n;
      if (best == nullptr || n->spec.cpus - n->cpus_used > best->spec.cpus - best->cpus_used) {
        best = n;
      }
    }
    if (best != nullptr) FitOnNode(best, r, pos);
    return best;
  }
  if (r.mode == Mode::kExclusive) {
    if (!r.spread) {
      for (auto it = excl_.lower_bound({r.gpus, INT_MIN}); it != excl_.end(); ++it) {
        NodeState* n = slots_[it->second].get();
        if (FitOnNode(n, r, pos)) return n;
      }
    } else {
      for (auto it = excl_.rbegin(); it != excl_.rend() && it->first >= r.gpus; ++it) {
        NodeState* n = slots_[it->second].get();
        if (FitOnNode(n, r, pos)) return n;
      }
    }
    return nullptr;
  }
  const uint32_t gen = ++try_gen_;
  auto visit = [&](int id) -> NodeState* {
    NodeState* n = slots_[id].get();
    if (n->tried == gen) return nullptr;
    n->tried = gen;
    return FitOnNode(n, r, pos) ? n : nullptr;
  };
  if (!r.spread) {
    for (auto it = shared_.lower_bound({r.gpu_memory, INT_MIN, INT_MIN}); it != shared_.end();
         ++it) {
      if (NodeState* n = visit(std::get<1>(*it))) return n;
    }
  } else {
    for (auto it = shared_.rbegin(); it != shared_.rend() && std::get<0>(*it) >= r.gpu_memory;
         ++it) {
      if (NodeState* n = visit(std::get<1>(*it))) return n;
    }
  }
  return nullptr;
}

// Holds, part by part, on its best node: of the nodes that could ever hold
// the part, the one where least of it is missing now (GPUs, then cpus, then
// memory). Exclusive GPUs are held whole, free ones first; a busy one is held
// too, so that it is the head's when it frees.
void Placement::Reserve(const Request& r) {
  const bool excl = r.mode == Mode::kExclusive;
  for (int part = 0; part < r.replicas; ++part) {
    NodeState* best = nullptr;
    std::tuple<int, int, uint64_t> best_missing;
    std::vector<int> best_gpus;
    for (const auto& [name, n] : by_name_) {
      if (!Eligible(*n, r)) continue;
      const Hold* h = HoldOn(n);
      const int held_cpus = h ? h->cpus : 0;
      const uint64_t held_memory = h ? h->memory : 0;
      if (n->spec.cpus - held_cpus < r.cpus || n->spec.memory < held_memory ||
          n->spec.memory - held_memory < r.memory) {
        continue;
      }
      // GPUs it could ever take, those free now first (most free memory
      // first when shared).
      std::vector<int> gpus;
      int ready = 0;
      for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
        const int k = static_cast<int>(i);
        const uint64_t memory = n->spec.gpus[i].memory;
        if (excl) {
          if (memory < r.gpu_memory || GpuHeld(h, k)) continue;
          ready += n->count[i] == 0;
        } else {
          const uint64_t held = h && !h->gpu.empty() ? h->gpu[i] : 0;
          if (memory - std::min(memory, held) < r.gpu_memory) continue;
          ready += FreeGpuMemory(n, h, k) >= r.gpu_memory;
        }
        gpus.push_back(k);
      }
      if (static_cast<int>(gpus.size()) < r.gpus) continue;
      std::stable_sort(gpus.begin(), gpus.end(), [&](int a, int b) {
        if (excl) return n->count[a] == 0 && n->count[b] != 0;
        return FreeGpuMemory(n, h, a) > FreeGpuMemory(n, h, b);
      });
      gpus.resize(r.gpus);
      const uint64_t free_memory = FreeMemory(n, h);
      std::tuple<int, int, uint64_t> missing{
          std::max(0, r.gpus - ready), std::max(0, r.cpus - FreeCpus(n, h)),
          r.memory > free_memory ? r.memory - free_memory : 0};
      if (best == nullptr || missing < best_missing) {
        best = n;
        best_missing = missing;
        best_gpus = std::move(gpus);
      }
    }
    if (best == nullptr) return;  // Infeasible refuses it at its next try
    Hold& h = held_[best];
    h.cpus += r.cpus;
    h.memory += r.memory;
    h.gpu.resize(best->spec.gpus.size(), 0);
    for (int i : best_gpus) h.gpu[i] += excl ? best->spec.gpus[i].memory : r.gpu_memory;
  }
}

absl::Status Placement::Infeasible(const Request& r) const {
  if (by_name_.empty()) {
    return absl::FailedPreconditionError("the allocator has no nodes (add one with AddNode)");
  }
  if (r.gpus > 0) {
    uint64_t largest = 0;
    for (const auto& [name, n] : by_name_) {
      for (const auto& g : n->spec.gpus) largest = std::max(largest, g.memory);
    }
    if (r.gpu_memory > largest) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu_memory=", FormatByteSize(r.gpu_memory), " is larger than any GPU (the largest has ",
          FormatByteSize(largest), ")"));
    }
  }
  std::vector<const NodeState*> matched;
  if (!r.node.empty()) {
    const NodeState* n = Find(r.node);
    if (n == nullptr) {
      return absl::NotFoundError(absl::StrCat("node: no node named ", Quoted(r.node)));
    }
    matched.push_back(n);
  } else {
    for (const auto& [name, n] : by_name_) matched.push_back(n);
  }
  std::vector<const NodeState*> labeled;
  for (const NodeState* n : matched) {
    bool ok = true;
    for (const auto& [k, v] : r.selector) {
      auto it = n->spec.labels.find(k);
      ok &= it != n->spec.labels.end() && it->second == v;
    }
    if (ok) labeled.push_back(n);
  }
  if (labeled.empty()) {
    return absl::NotFoundError(absl::StrCat("selector ", Selector(r.selector), ": no ",
                                            r.node.empty() ? "node" : "such node",
                                            " has these labels"));
  }
  std::vector<const NodeState*> moded;
  std::vector<std::string> other;
  for (const NodeState* n : labeled) {
    if (r.gpus == 0 || n->mode == r.mode || (n->pending && *n->pending == r.mode)) {
      moded.push_back(n);
    } else {
      other.push_back(n->spec.name);
    }
  }
  if (moded.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mode=", ModeName(r.mode), ": ", r.mode == Mode::kExclusive ? "an " : "a ",
        ModeName(r.mode), " request needs ", r.mode == Mode::kExclusive ? "an " : "a ",
        ModeName(r.mode),
        " node, and every node that could take it is ",
        ModeName(r.mode == Mode::kShared ? Mode::kExclusive : Mode::kShared), " (",
        NameList(other), ")"));
  }
  // A gang is granted all at once: the matching nodes, empty, must hold all
  // its parts together, or it would wait forever.
  int64_t parts = 0;
  for (const NodeState* n : moded) {
    parts += PartsThatFit(n->spec, r);
    if (parts >= r.replicas) return absl::OkStatus();  // Grant asks at each busy try
  }
  if (parts == 0) {
    // Which of them no node has (a new user's --memory 1TiB and a GPU on a
    // machine without one read alike), with the most that one node has.
    int64_t most_gpus = 0, most_cpus = 0;
    uint64_t most_memory = 0;
    for (const NodeState* n : moded) {
      int64_t gpus = 0;
      for (const Gpu& g : n->spec.gpus) gpus += g.memory >= r.gpu_memory;
      most_gpus = std::max(most_gpus, gpus);
      most_cpus = std::max<int64_t>(most_cpus, n->spec.cpus);
      most_memory = std::max(most_memory, n->spec.memory);
    }
    std::vector<std::string> short_of;
    if (r.gpus > most_gpus) {
      short_of.push_back(absl::StrCat(r.gpus, " GPUs", r.gpu_memory > 0 ? " of that memory" : "",
                                      " (the most on one: ", most_gpus, ")"));
    }
    if (r.cpus > most_cpus) {
      short_of.push_back(absl::StrCat(r.cpus, " cpus (the most on one: ", most_cpus, ")"));
    }
    if (r.memory > most_memory) {
      short_of.push_back(absl::StrCat(FormatByteSize(r.memory), " memory (the most on one: ",
                                      FormatByteSize(most_memory), ")"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "no node can ever hold this request (", Describe(r), " per part): ", moded.size(),
        " node(s) match, none has ",
        short_of.empty() ? "that many GPUs, cpus and memory together"
                         : absl::StrJoin(short_of, ", ")));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "no set of nodes can ever hold this request (", Describe(r), "): the ", moded.size(),
      " matching node(s) hold at most ", parts, " of its ", r.replicas, " parts at once"));
}

std::string Placement::Shortage(const Request& r) const {
  const bool excl = r.mode == Mode::kExclusive;
  int matching = 0, eligible = 0, not_ready = 0, most_gpus = 0, most_cpus = 0;
  uint64_t most_memory = 0;
  bool fits = false;
  for (const auto& [name, n] : by_name_) {
    if (!r.node.empty() && name != r.node) continue;
    bool labeled = true;
    for (const auto& [k, v] : r.selector) {
      auto it = n->spec.labels.find(k);
      labeled &= it != n->spec.labels.end() && it->second == v;
    }
    if (!labeled) continue;
    ++matching;
    not_ready += !n->ready;
    if (n->cordoned || !n->ready || (r.gpus > 0 && (n->pending || n->mode != r.mode))) continue;
    ++eligible;
    int gpus = 0;
    for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
      const uint64_t memory = n->spec.gpus[i].memory;
      gpus += excl ? (n->count[i] == 0 && memory >= r.gpu_memory)
                   : (memory - n->used_mem[i] >= r.gpu_memory);
    }
    const int cpus = n->spec.cpus - n->cpus_used;
    const uint64_t memory = n->spec.memory - n->mem_used;
    most_gpus = std::max(most_gpus, gpus);
    most_cpus = std::max(most_cpus, cpus);
    most_memory = std::max(most_memory, memory);
    fits |= gpus >= r.gpus && cpus >= r.cpus && memory >= r.memory;
  }
  if (eligible == 0) {
    return absl::StrCat("waiting for a node to take it (", matching,
                        " matching node(s), all cordoned",
                        not_ready > 0 ? ", not ready" : "", " or switching mode)");
  }
  if (fits) {
    if (r.replicas == 1) return "";
    return absl::StrCat("waiting for room for all ", r.replicas, " parts of the gang at once");
  }
  auto free = [](const std::string& most, bool none) {
    return none ? std::string(" (0 free on any eligible node)")
                : absl::StrCat(" (at most ", most, " free on an eligible node)");
  };
  std::vector<std::string> short_of;
  if (r.gpus > most_gpus) {
    std::string gpus =
        absl::StrCat(r.gpus, " ", ModeName(r.mode), " GPU", r.gpus == 1 ? "" : "s");
    if (!excl) absl::StrAppend(&gpus, " with ", FormatByteSize(r.gpu_memory), " free");
    short_of.push_back(gpus + free(std::to_string(most_gpus), most_gpus == 0));
  }
  if (r.cpus > most_cpus) {
    short_of.push_back(absl::StrCat(r.cpus, " cpus", free(std::to_string(most_cpus),
                                                           most_cpus == 0)));
  }
  if (r.memory > most_memory) {
    short_of.push_back(absl::StrCat(FormatByteSize(r.memory), " memory",
                                    free(FormatByteSize(most_memory), most_memory == 0)));
  }
  if (short_of.empty()) {
    // Each resource is free somewhere, but on no node all together.
    std::vector<std::string> asked;
    if (r.gpus > 0) asked.push_back(GpusOf(r));
    if (r.cpus > 0) asked.push_back(absl::StrCat(r.cpus, " cpus"));
    if (r.memory > 0) asked.push_back(absl::StrCat(FormatByteSize(r.memory), " memory"));
    return absl::StrCat("waiting for one node with ", absl::StrJoin(asked, ", "),
                        " free at once");
  }
  return absl::StrCat("waiting for ", absl::StrJoin(short_of, " and "));
}

}  // namespace deepnex::gpu
