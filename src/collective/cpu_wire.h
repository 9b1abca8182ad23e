// What the cpu backend's ranks send each other: the hello on a new
// connection, the header before every collective, and the address each rank
// publishes in the store. Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_CPU_WIRE_H_
#define DEEPNEX_COLLECTIVE_CPU_WIRE_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "collective/backends.h"
#include "deepnex/status.h"
#include "deepnex/tensor.h"

namespace deepnex::collective {

constexpr uint32_t kHelloMagic = 0x64786831;   // "dxh1"
constexpr uint32_t kHeaderMagic = 0x64786331;  // "dxc1"
// Allreduces of at most this many bytes, among at most kSmallMaxRanks ranks,
// pass every rank's data with the header exchange instead of running a ring.
constexpr size_t kSmallBytes = 64 << 10;
constexpr int kSmallMaxRanks = 8;
// Two ranks reduce a sum, mean or prod of up to this many bytes straight
// from the link (exchange.h's PairReduce): with no ring steps and no stripe
// threads, it beats the ring well past kSmallBytes.
constexpr size_t kPairBytes = 1 << 20;
// No header announces a payload larger than this.
constexpr size_t kMaxPayloadBytes = kPairBytes;
struct Header {
  uint32_t magic = kHeaderMagic;
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t op = 0;
  uint8_t invalid = 0;
  int32_t root = 0;
  uint32_t payload_bytes = 0;  // data that follows the header (small collectives)
  uint64_t count = 0;
  uint64_t seq = 0;
  bool SameCall(const Header& o) const {
    return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && count == o.count;
  }
  std::string Describe() const {
    std::string s = KindName(static_cast<Kind>(kind));
    if (kind == static_cast<uint8_t>(Kind::kBarrier)) return s;
    absl::StrAppend(&s, " of ", count, " ",
                    IsValidDType(dtype) ? DTypeName(static_cast<DType>(dtype)) : "invalid");
    if (kind == static_cast<uint8_t>(Kind::kBroadcast)) {
      absl::StrAppend(&s, " from root ", root);
    } else if (kind != static_cast<uint8_t>(Kind::kAllGather)) {
      absl::StrAppend(&s, " (", ReduceOpName(static_cast<ReduceOp>(op)), ")");
    }
    return s;
  }
};
static_assert(sizeof(Header) == 32, "header layout");

struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t index;
  int32_t pad;
  uint64_t nonce;  // the listener's, from the store
};

// What a rank publishes in the store.
struct RankInfo {
  std::string host;
  int port = 0;
  std::string host_id;
  std::string shm;  // segment name, or "-"
  uint64_t nonce = 0;
  // The CPUs this rank may run on: a hex mask, CPU 0 in the last digit.
  std::string cpus = "1";
  int world_size = 0;  // as this rank was told: every rank's must agree
};

// Shared-memory channels with shm_channels = 0, where the CPUs allow.
constexpr int kAutoShmChannels = 2;

// The stripes of a communicator whose ranks all share memory, from what
// every rank published. Each shared-memory stripe is a thread copying for
// the whole collective, so unless told how many, the ranks use no more
// stripes between them than the CPUs they may run on (the union of their
// masks): two ranks on 2 CPUs with 2 stripes each took 1.15x as long for a
// 4 MiB allreduce as with one. (TCP stripes leave the copies to the kernel,
// which spreads them on its own.)
inline int ShmStripes(int shm_channels, const std::vector<RankInfo>& ranks) {
  if (shm_channels > 0) return shm_channels;
  std::string all;  // the union, least significant digit first
  for (const RankInfo& info : ranks) {
    if (all.size() < info.cpus.size()) all.resize(info.cpus.size(), 0);
    for (size_t i = 0; i < info.cpus.size(); ++i) {
      const char c = absl::ascii_tolower(info.cpus.rbegin()[i]);
      all[i] |= static_cast<char>(c <= '9' ? c - '0' : c - 'a' + 10);
    }
  }
  int cpus = 0;
  for (char d : all) cpus += __builtin_popcount(static_cast<unsigned char>(d));
  const int n = std::max(static_cast<int>(ranks.size()), 1);
  return std::clamp(cpus / n, 1, kAutoShmChannels);
}

inline std::string Encode(const RankInfo& info) {
  return absl::StrCat(info.host, " ", info.port, " ", info.host_id, " ", info.shm, " ", info.nonce,
                      " ", info.cpus, " ", info.world_size);
}

inline absl::StatusOr<RankInfo> Decode(int rank, const std::string& text) {
  std::vector<std::string> f = absl::StrSplit(text, ' ');
  RankInfo info;
  if (f.size() != 7 || !absl::SimpleAtoi(f[1], &info.port) || !absl::SimpleAtoi(f[4], &info.nonce) ||
      f[5].empty() || !std::all_of(f[5].begin(), f[5].end(), absl::ascii_isxdigit) ||
      !absl::SimpleAtoi(f[6], &info.world_size)) {
    return absl::InternalError(absl::StrCat("rank ", rank, " published a garbled address: \"",
                                            text, "\""));
  }
  info.host = f[0];
  info.host_id = f[2];
  info.shm = f[3];
  info.cpus = f[5];
  return info;
}

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_CPU_WIRE_H_
