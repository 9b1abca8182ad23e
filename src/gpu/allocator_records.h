// The allocator's ledger records: one struct per record type, each with its
// EncodeTo and DecodeFrom (as leveldb's db/version_edit.h), apart from the
// state that applies them (AllocatorState). Private to libdeepnex.
//
// The encoding is the ledger's format on disk (gpu/codec.h): a record is its
// type byte, then its fields. Old state directories must replay, so a field
// is only ever appended at the end of a record, and decoding treats a record
// that ends before it as written before it existed (Quota::max_priority, a
// grant's job names).
#ifndef DEEPNEX_GPU_ALLOCATOR_RECORDS_H_
#define DEEPNEX_GPU_ALLOCATOR_RECORDS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/status.h"
#include "gpu/codec.h"

namespace deepnex::gpu {

enum RecordType : uint8_t {
  kAddNode = 1,
  kRemoveNode = 2,
  kSetMode = 3,
  kNodeFlags = 4,
  kSetQuota = 5,
  kClearQuota = 6,
  kGrant = 7,
  kRelease = 8,
  kRenew = 9,
  kNextIds = 10,
};

// One allocation (one part of a gang) as the allocator keeps and logs it.
struct AllocRec {
  // Its id, GPU indices and UUIDs and env are derived from `num`, `pos`
  // and the node (Placement::Book fills them in); the rest is logged.
  Allocation a;
  uint64_t num = 0;
  std::vector<int> pos;  // GPU positions in the node's spec
};

// "a17" for allocation 17, "g3" for gang 3.
std::string AllocId(uint64_t n);
std::string GangId(uint64_t n);
// "a17" -> 17 with prefix 'a'; false for anything else ("a017" too).
bool ParseId(const std::string& id, char prefix, uint64_t* n);

// Every record type below: EncodeTo appends the whole record, type byte
// first; DecodeFrom reads what follows the type byte (DecodeRecord reads
// that) and returns false for a record that is cut short or out of range.

// kAddNode: a node and its state, as added or as a snapshot holds it.
struct NodeRecord {
  static constexpr RecordType kType = kAddNode;
  static constexpr const char* kWhat = "node";
  Node spec;  // GPU indices and UUIDs filled in; spec.mode is the node's mode
  std::optional<Mode> pending;
  bool cordoned = false;
  bool draining = false;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

struct RemoveNodeRecord {
  static constexpr RecordType kType = kRemoveNode;
  static constexpr const char* kWhat = "remove-node";
  std::string name;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

// kSetMode: `pending` marks a switch that waits for the node to drain.
struct ModeRecord {
  static constexpr RecordType kType = kSetMode;
  static constexpr const char* kWhat = "mode";
  std::string name;
  Mode mode = Mode::kExclusive;
  bool pending = false;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

struct FlagsRecord {
  static constexpr RecordType kType = kNodeFlags;
  static constexpr const char* kWhat = "node-flags";
  std::string name;
  bool cordoned = false;
  bool draining = false;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

// kSetQuota: a user's quota, or the default one (`user` empty).
struct QuotaRecord {
  static constexpr RecordType kType = kSetQuota;
  static constexpr const char* kWhat = "quota";
  bool is_default = false;
  std::string user;
  Quota quota;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

struct ClearQuotaRecord {
  static constexpr RecordType kType = kClearQuota;
  static constexpr const char* kWhat = "quota";
  std::string user;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

// kGrant: every part of one grant. The parts' job names follow them as a
// trailer, written only when a part has one, so that grant records from
// before jobs replay unchanged.
struct GrantRecord {
  static constexpr RecordType kType = kGrant;
  static constexpr const char* kWhat = "grant";
  std::vector<AllocRec> parts;  // id, GPU indices, UUIDs and env not logged
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

// kRelease: allocation numbers, released together for `reason`.
struct ReleaseRecord {
  static constexpr RecordType kType = kRelease;
  static constexpr const char* kWhat = "release";
  std::vector<uint64_t> nums;
  std::string reason;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

struct RenewRecord {
  static constexpr RecordType kType = kRenew;
  static constexpr const char* kWhat = "renew";
  uint64_t num = 0;
  int64_t expires_at_ms = 0;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

// kNextIds: the next allocation and gang numbers (a snapshot's last record),
// so that ids of released allocations are never handed out again.
struct NextIdsRecord {
  static constexpr RecordType kType = kNextIds;
  static constexpr const char* kWhat = "next-ids";
  uint64_t next_id = 1;
  uint64_t next_gang = 1;
  void EncodeTo(std::string* dst) const;
  bool DecodeFrom(Decoder& d);
};

using Record = std::variant<NodeRecord, RemoveNodeRecord, ModeRecord, FlagsRecord, QuotaRecord,
                            ClearQuotaRecord, GrantRecord, ReleaseRecord, RenewRecord,
                            NextIdsRecord>;

// The record's bytes, type byte first.
template <typename R>
std::string Encode(const R& record) {
  std::string out;
  record.EncodeTo(&out);
  return out;
}

// DataLoss "malformed <what> record" for a record that does not decode,
// "unknown record type <N>" for a type this build does not know.
absl::Status DecodeRecord(const std::string& bytes, Record* record);

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_ALLOCATOR_RECORDS_H_
