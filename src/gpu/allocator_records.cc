#include "gpu/allocator_records.h"

#include <cctype>

#include "absl/strings/str_cat.h"

namespace deepnex::gpu {
namespace {

void EncodeQuota(Encoder& e, const Quota& q) {
  e.U8(q.gpus.has_value());
  if (q.gpus) e.Signed(*q.gpus);
  e.U8(q.gpu_memory.has_value());
  if (q.gpu_memory) e.Varint(*q.gpu_memory);
  e.U8(q.cpus.has_value());
  if (q.cpus) e.Signed(*q.cpus);
  e.U8(q.memory.has_value());
  if (q.memory) e.Varint(*q.memory);
  // Appended last: a quota record ends with the quota, so records written
  // before max_priority existed decode with the default 0.
  e.Signed(q.max_priority);
}

bool DecodeQuota(Decoder& d, Quota* q) {
  uint8_t has;
  int64_t s;
  uint64_t u;
  if (!d.U8(&has)) return false;
  if (has) {
    if (!d.Signed(&s)) return false;
    q->gpus = s;
  }
  if (!d.U8(&has)) return false;
  if (has) {
    if (!d.Varint(&u)) return false;
    q->gpu_memory = u;
  }
  if (!d.U8(&has)) return false;
  if (has) {
    if (!d.Signed(&s)) return false;
    q->cpus = s;
  }
  if (!d.U8(&has)) return false;
  if (has) {
    if (!d.Varint(&u)) return false;
    q->memory = u;
  }
  // Absent in records from before max_priority (the quota ends the record).
  if (d.done()) return true;
  return d.Int(&q->max_priority);
}

void EncodeAlloc(Encoder& e, const AllocRec& r) {
  const Allocation& a = r.a;
  e.Varint(r.num);
  e.Str(a.user);
  e.Str(a.node);
  e.Varint(r.pos.size());
  for (size_t i = 0; i < r.pos.size(); ++i) {
    e.Varint(static_cast<uint64_t>(r.pos[i]));
    e.Varint(a.gpus[i].memory);
    e.U8(a.gpus[i].exclusive);
  }
  e.Signed(a.cpus);
  e.Varint(a.memory);
  e.Signed(a.priority);
  e.Str(a.gang);
  e.Signed(a.replica);
  e.Signed(a.lease_ms);
  e.Signed(a.expires_at_ms);
}

bool DecodeAlloc(Decoder& d, AllocRec* r) {
  Allocation& a = r->a;
  uint64_t npos;
  if (!d.Varint(&r->num) || !d.Str(&a.user) || !d.Str(&a.node) || !d.Varint(&npos) ||
      npos > 4096) {
    return false;
  }
  for (uint64_t i = 0; i < npos; ++i) {
    uint64_t pos, mem;
    uint8_t excl;
    if (!d.Varint(&pos) || !d.Varint(&mem) || !d.U8(&excl) || pos > 4096) return false;
    r->pos.push_back(static_cast<int>(pos));
    GrantedGpu g;
    g.memory = mem;
    g.exclusive = excl != 0;
    a.gpus.push_back(g);
  }
  return d.Int(&a.cpus) && d.Varint(&a.memory) && d.Int(&a.priority) && d.Str(&a.gang) &&
         d.Int(&a.replica) && d.Signed(&a.lease_ms) && d.Signed(&a.expires_at_ms);
}

template <typename R>
absl::Status DecodeAs(Decoder& d, Record* record) {
  R r;
  if (!r.DecodeFrom(d)) {
    return absl::DataLossError(absl::StrCat("malformed ", R::kWhat, " record"));
  }
  *record = std::move(r);
  return absl::OkStatus();
}

}  // namespace

std::string AllocId(uint64_t n) { return absl::StrCat("a", n); }
std::string GangId(uint64_t n) { return absl::StrCat("g", n); }

bool ParseId(const std::string& id, char prefix, uint64_t* n) {
  if (id.size() < 2 || id.size() > 20 || id[0] != prefix) return false;
  // Only the form ids are issued in: "a01" released a1.
  if (id[1] == '0' && id.size() > 2) return false;
  uint64_t v = 0;
  for (size_t i = 1; i < id.size(); ++i) {
    if (!isdigit(static_cast<unsigned char>(id[i]))) return false;
    v = v * 10 + static_cast<uint64_t>(id[i] - '0');
  }
  *n = v;
  return true;
}

void NodeRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Str(spec.name);
  e.Signed(spec.cpus);
  e.Varint(spec.memory);
  e.U8(static_cast<uint8_t>(spec.mode));
  e.U8(pending ? 1 + static_cast<uint8_t>(*pending) : 0);
  e.U8(cordoned);
  e.U8(draining);
  e.Varint(spec.labels.size());
  for (const auto& [k, v] : spec.labels) {
    e.Str(k);
    e.Str(v);
  }
  e.Varint(spec.gpus.size());
  for (const auto& g : spec.gpus) {
    e.Signed(g.index);
    e.Str(g.uuid);
    e.Str(g.name);
    e.Varint(g.memory);
    e.Str(g.pci_bus_id);
    e.Signed(g.numa_node);
    e.Signed(g.switch_id);
  }
}

bool NodeRecord::DecodeFrom(Decoder& d) {
  uint8_t mode, pending_mode, cordoned_flag, draining_flag;
  uint64_t count;
  if (!d.Str(&spec.name) || !d.Int(&spec.cpus) || !d.Varint(&spec.memory) || !d.U8(&mode) ||
      !d.U8(&pending_mode) || !d.U8(&cordoned_flag) || !d.U8(&draining_flag) ||
      !d.Varint(&count)) {
    return false;
  }
  for (uint64_t i = 0; i < count; ++i) {
    std::string k, v;
    if (!d.Str(&k) || !d.Str(&v)) return false;
    spec.labels[k] = v;
  }
  if (!d.Varint(&count)) return false;
  for (uint64_t i = 0; i < count; ++i) {
    Gpu g;
    if (!d.Int(&g.index) || !d.Str(&g.uuid) || !d.Str(&g.name) || !d.Varint(&g.memory) ||
        !d.Str(&g.pci_bus_id) || !d.Int(&g.numa_node) || !d.Int(&g.switch_id)) {
      return false;
    }
    spec.gpus.push_back(std::move(g));
  }
  spec.mode = static_cast<Mode>(mode);
  if (pending_mode) pending = static_cast<Mode>(pending_mode - 1);
  cordoned = cordoned_flag;
  draining = draining_flag;
  return true;
}

void RemoveNodeRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Str(name);
}

bool RemoveNodeRecord::DecodeFrom(Decoder& d) { return d.Str(&name); }

void ModeRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Str(name);
  e.U8(static_cast<uint8_t>(mode));
  e.U8(pending);
}

bool ModeRecord::DecodeFrom(Decoder& d) {
  uint8_t m, p;
  if (!d.Str(&name) || !d.U8(&m) || !d.U8(&p)) return false;
  mode = static_cast<Mode>(m);
  pending = p != 0;
  return true;
}

void FlagsRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Str(name);
  e.U8(cordoned);
  e.U8(draining);
}

bool FlagsRecord::DecodeFrom(Decoder& d) {
  uint8_t c, dr;
  if (!d.Str(&name) || !d.U8(&c) || !d.U8(&dr)) return false;
  cordoned = c;
  draining = dr;
  return true;
}

void QuotaRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.U8(is_default);
  e.Str(user);
  EncodeQuota(e, quota);
}

bool QuotaRecord::DecodeFrom(Decoder& d) {
  uint8_t def;
  if (!d.U8(&def) || !d.Str(&user) || !DecodeQuota(d, &quota)) return false;
  is_default = def;
  return true;
}

void ClearQuotaRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Str(user);
}

bool ClearQuotaRecord::DecodeFrom(Decoder& d) { return d.Str(&user); }

void GrantRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Varint(parts.size());
  bool jobs = false;
  for (const AllocRec& r : parts) {
    EncodeAlloc(e, r);
    jobs |= !r.a.job.empty();
  }
  if (jobs) {
    for (const AllocRec& r : parts) e.Str(r.a.job);
  }
}

bool GrantRecord::DecodeFrom(Decoder& d) {
  uint64_t n;
  if (!d.Varint(&n) || n > 100000) return false;
  parts.resize(n);
  for (AllocRec& r : parts) {
    if (!DecodeAlloc(d, &r)) return false;
  }
  if (!d.done()) {
    for (AllocRec& r : parts) {
      if (!d.Str(&r.a.job)) return false;
    }
  }
  return true;
}

void ReleaseRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Varint(nums.size());
  for (uint64_t n : nums) e.Varint(n);
  e.Str(reason);
}

bool ReleaseRecord::DecodeFrom(Decoder& d) {
  // The reason is for people reading the log; replay does not need it, and
  // has never read it.
  uint64_t count;
  if (!d.Varint(&count)) return false;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t num;
    if (!d.Varint(&num)) return false;
    nums.push_back(num);
  }
  if (!d.Str(&reason)) reason.clear();
  return true;
}

void RenewRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Varint(num);
  e.Signed(expires_at_ms);
}

bool RenewRecord::DecodeFrom(Decoder& d) { return d.Varint(&num) && d.Signed(&expires_at_ms); }

void NextIdsRecord::EncodeTo(std::string* dst) const {
  Encoder e(dst);
  e.U8(kType);
  e.Varint(next_id);
  e.Varint(next_gang);
}

bool NextIdsRecord::DecodeFrom(Decoder& d) { return d.Varint(&next_id) && d.Varint(&next_gang); }

absl::Status DecodeRecord(const std::string& bytes, Record* record) {
  Decoder d(bytes.data(), bytes.size());
  uint8_t type;
  if (!d.U8(&type)) return absl::DataLossError("malformed empty record");
  switch (type) {
    case kAddNode:
      return DecodeAs<NodeRecord>(d, record);
    case kRemoveNode:
      return DecodeAs<RemoveNodeRecord>(d, record);
    case kSetMode:
      return DecodeAs<ModeRecord>(d, record);
    case kNodeFlags:
      return DecodeAs<FlagsRecord>(d, record);
    case kSetQuota:
      return DecodeAs<QuotaRecord>(d, record);
    case kClearQuota:
      return DecodeAs<ClearQuotaRecord>(d, record);
    case kGrant:
      return DecodeAs<GrantRecord>(d, record);
    case kRelease:
      return DecodeAs<ReleaseRecord>(d, record);
    case kRenew:
      return DecodeAs<RenewRecord>(d, record);
    case kNextIds:
      return DecodeAs<NextIdsRecord>(d, record);
    default:
      return absl::DataLossError(absl::StrCat("unknown record type ", int(type)));
  }
}

}  // namespace deepnex::gpu
