// The allocator's ledger records: each type round-trips, the bytes are the
// format on disk (the golden bytes below were written by the allocator before
// its records had a file of their own), and old records still decode.
#include "gpu/allocator_records.h"

#include <string>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gpu/ledger.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::testing::ElementsAre;
using namespace ::deepnex::gpu::test;  // NOLINT

std::string Hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string Bytes(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

template <typename R>
R RoundTrip(const R& in) {
  const std::string bytes = Encode(in);
  Record out;
  absl::Status s = DecodeRecord(bytes, &out);
  EXPECT_OK(s);
  EXPECT_TRUE(std::holds_alternative<R>(out)) << "type byte " << int(bytes[0]);
  if (!s.ok() || !std::holds_alternative<R>(out)) return R{};
  EXPECT_EQ(Hex(Encode(std::get<R>(out))), Hex(bytes));
  return std::get<R>(out);
}

// The allocator's own log of this sequence, as written before the records
// moved to allocator_records.cc: AddNode n1 (2 GPUs, labels) and s1 (shared),
// SetQuota alice, SetDefaultQuota, SetQuota bob, ClearQuota bob, a 2-part gang
// of carol with a job, a shared grant of dave, Cordon s1, Drain s1, n1 to
// shared when drained, Release dave, RemoveNode s1, Release the gang (which
// completes n1's switch), AddNode t1, a CPU-only grant of erin.
const std::vector<std::string> kGoldenLog = {
    "01026e3180018080808080100000000002047261636b027237047a6f6e6501620200084750552d6e312d"
    "30044831303080808080c00207303030303a3030000602084750552d6e312d31044831303080808080c0"
    "0207303030303a30310206",
    "01027331108080808080020100000000010a054750552d780080808080a001000101",
    "050005616c6963650106000001808080800403",
    "0501000000010801e80700",
    "050003626f620000000000",
    "0603626f62",
    "070201056361726f6c026e31010080808080c0020104050102673100000002056361726f6c026e310101"
    "80808080c00201040501026731020000086d6e6973742d3432086d6e6973742d3432",
    "0701030464617665027331010080808080280000000000000000",
    "040273310100",
    "040273310101",
    "03026e310101",
    "0801030872656c6561736564",
    "02027331",
    "080201020872656c6561736564",
    "03026e310100",
    "010274310201000000000000",
    "070104046572696e026e310002000000000000",
};

// StateDigest() after kGoldenLog: the snapshot records, each length-prefixed.
const char kGoldenDigest[] =
    "5f01026e3180018080808080100100000002047261636b027237047a6f6e6501620200084750552d6e31"
    "2d30044831303080808080c00207303030303a3030000602084750552d6e312d31044831303080808080"
    "c00207303030303a303102060c0102743102010000000000000b0501000000010801e807001305000561"
    "6c696365010600000180808080040313070104046572696e026e310002000000000000030a0502";

Gpu MakeGpu(int index, const std::string& uuid, uint64_t memory, const std::string& name,
            const std::string& pci, int numa, int sw) {
  Gpu g;
  g.index = index;
  g.uuid = uuid;
  g.memory = memory;
  g.name = name;
  g.pci_bus_id = pci;
  g.numa_node = numa;
  g.switch_id = sw;
  return g;
}

AllocRec Part(uint64_t num, const std::string& user, const std::string& node,
              std::vector<int> pos, uint64_t gpu_memory, bool exclusive) {
  AllocRec r;
  r.num = num;
  r.a.user = user;
  r.a.node = node;
  r.pos = std::move(pos);
  for (size_t i = 0; i < r.pos.size(); ++i) {
    GrantedGpu g;
    g.memory = gpu_memory;
    g.exclusive = exclusive;
    r.a.gpus.push_back(g);
  }
  return r;
}

TEST(AllocatorRecords, EncodeWritesTheLedgerFormatByteForByte) {
  NodeRecord n1;
  n1.spec.name = "n1";
  n1.spec.cpus = 64;
  n1.spec.memory = 512 * kGiB;
  n1.spec.labels = {{"rack", "r7"}, {"zone", "b"}};
  n1.spec.gpus = {MakeGpu(0, "GPU-n1-0", 80 * kGiB, "H100", "0000:00", 0, 3),
                  MakeGpu(1, "GPU-n1-1", 80 * kGiB, "H100", "0000:01", 1, 3)};
  EXPECT_EQ(Hex(Encode(n1)), kGoldenLog[0]);

  NodeRecord s1;
  s1.spec.name = "s1";
  s1.spec.cpus = 8;
  s1.spec.memory = 64 * kGiB;
  s1.spec.mode = Mode::kShared;
  s1.spec.gpus = {MakeGpu(5, "GPU-x", 40 * kGiB, "", "", -1, -1)};
  EXPECT_EQ(Hex(Encode(s1)), kGoldenLog[1]);

  Quota alice;
  alice.gpus = 3;
  alice.memory = kGiB;
  alice.max_priority = -2;
  EXPECT_EQ(Hex(Encode(QuotaRecord{false, "alice", alice})), kGoldenLog[2]);
  Quota d;
  d.cpus = 4;
  d.memory = 1000;
  EXPECT_EQ(Hex(Encode(QuotaRecord{true, "", d})), kGoldenLog[3]);
  EXPECT_EQ(Hex(Encode(QuotaRecord{false, "bob", Quota{}})), kGoldenLog[4]);
  EXPECT_EQ(Hex(Encode(ClearQuotaRecord{"bob"})), kGoldenLog[5]);

  GrantRecord gang;
  for (int replica = 0; replica < 2; ++replica) {
    AllocRec r = Part(1 + replica, "carol", "n1", {replica}, 80 * kGiB, true);
    r.a.job = "mnist-42";
    r.a.cpus = 2;
    r.a.memory = 5;
    r.a.priority = -1;
    r.a.gang = "g1";
    r.a.replica = replica;
    gang.parts.push_back(r);
  }
  EXPECT_EQ(Hex(Encode(gang)), kGoldenLog[6]);
  EXPECT_EQ(Hex(Encode(GrantRecord{{Part(3, "dave", "s1", {0}, 10 * kGiB, false)}})),
            kGoldenLog[7]);

  EXPECT_EQ(Hex(Encode(FlagsRecord{"s1", true, false})), kGoldenLog[8]);
  EXPECT_EQ(Hex(Encode(FlagsRecord{"s1", true, true})), kGoldenLog[9]);
  EXPECT_EQ(Hex(Encode(ModeRecord{"n1", Mode::kShared, true})), kGoldenLog[10]);
  EXPECT_EQ(Hex(Encode(ReleaseRecord{{3}, "released"})), kGoldenLog[11]);
  EXPECT_EQ(Hex(Encode(RemoveNodeRecord{"s1"})), kGoldenLog[12]);
  EXPECT_EQ(Hex(Encode(ReleaseRecord{{1, 2}, "released"})), kGoldenLog[13]);
  EXPECT_EQ(Hex(Encode(ModeRecord{"n1", Mode::kShared, false})), kGoldenLog[14]);

  NodeRecord t1;
  t1.spec.name = "t1";
  t1.spec.cpus = 1;
  t1.spec.memory = 1;
  EXPECT_EQ(Hex(Encode(t1)), kGoldenLog[15]);
  AllocRec erin = Part(4, "erin", "n1", {}, 0, false);
  erin.a.cpus = 1;
  EXPECT_EQ(Hex(Encode(GrantRecord{{erin}})), kGoldenLog[16]);

  // Not in the golden log (their values depend on the clock); by the format.
  EXPECT_EQ(Hex(Encode(RenewRecord{7, 1})), "090702");
  EXPECT_EQ(Hex(Encode(NextIdsRecord{5, 2})), "0a0502");
}

TEST(AllocatorRecords, EveryTypeRoundTrips) {
  NodeRecord node;
  node.spec.name = "n9";
  node.spec.cpus = 96;
  node.spec.memory = 3 * kGiB;
  node.spec.mode = Mode::kShared;
  node.spec.labels = {{"gpu", "h200"}};
  node.spec.gpus = {MakeGpu(3, "GPU-a", 141 * kGiB, "H200", "0000:9a:00.0", 1, 7)};
  node.pending = Mode::kExclusive;
  node.cordoned = true;
  node.draining = true;
  NodeRecord n = RoundTrip(node);
  EXPECT_EQ(n.spec.name, "n9");
  EXPECT_EQ(n.spec.cpus, 96);
  EXPECT_EQ(n.spec.memory, 3 * kGiB);
  EXPECT_EQ(n.spec.mode, Mode::kShared);
  EXPECT_EQ(n.spec.labels, node.spec.labels);
  ASSERT_EQ(n.spec.gpus.size(), 1u);
  EXPECT_EQ(n.spec.gpus[0].index, 3);
  EXPECT_EQ(n.spec.gpus[0].uuid, "GPU-a");
  EXPECT_EQ(n.spec.gpus[0].name, "H200");
  EXPECT_EQ(n.spec.gpus[0].memory, 141 * kGiB);
  EXPECT_EQ(n.spec.gpus[0].pci_bus_id, "0000:9a:00.0");
  EXPECT_EQ(n.spec.gpus[0].numa_node, 1);
  EXPECT_EQ(n.spec.gpus[0].switch_id, 7);
  EXPECT_EQ(n.pending, Mode::kExclusive);
  EXPECT_TRUE(n.cordoned);
  EXPECT_TRUE(n.draining);

  EXPECT_EQ(RoundTrip(RemoveNodeRecord{"n9"}).name, "n9");
  ModeRecord m = RoundTrip(ModeRecord{"n9", Mode::kShared, true});
  EXPECT_EQ(m.name, "n9");
  EXPECT_EQ(m.mode, Mode::kShared);
  EXPECT_TRUE(m.pending);
  FlagsRecord f = RoundTrip(FlagsRecord{"n9", false, true});
  EXPECT_EQ(f.name, "n9");
  EXPECT_FALSE(f.cordoned);
  EXPECT_TRUE(f.draining);

  Quota q;
  q.gpus = 0;
  q.gpu_memory = 5 * kGiB;
  q.cpus = 12;
  q.memory = 7;
  q.max_priority = 9;
  QuotaRecord qr = RoundTrip(QuotaRecord{false, "alice", q});
  EXPECT_FALSE(qr.is_default);
  EXPECT_EQ(qr.user, "alice");
  EXPECT_EQ(qr.quota, q);
  EXPECT_TRUE(RoundTrip(QuotaRecord{true, "", Quota{}}).is_default);
  EXPECT_EQ(RoundTrip(ClearQuotaRecord{"alice"}).user, "alice");

  AllocRec part = Part(41, "bob", "n9", {0, 2}, 8 * kGiB, false);
  part.a.job = "sweep-3";
  part.a.cpus = 6;
  part.a.memory = 9 * kGiB;
  part.a.priority = -4;
  part.a.gang = "g12";
  part.a.replica = 1;
  part.a.lease_ms = 30000;
  part.a.expires_at_ms = 1700000000123;
  AllocRec other = Part(42, "bob", "n8", {1}, 80 * kGiB, true);  // no job
  GrantRecord g = RoundTrip(GrantRecord{{part, other}});
  ASSERT_EQ(g.parts.size(), 2u);
  const AllocRec& p = g.parts[0];
  EXPECT_EQ(p.num, 41u);
  EXPECT_EQ(p.a.user, "bob");
  EXPECT_EQ(p.a.node, "n9");
  EXPECT_EQ(p.a.job, "sweep-3");
  EXPECT_THAT(p.pos, ElementsAre(0, 2));
  ASSERT_EQ(p.a.gpus.size(), 2u);
  EXPECT_EQ(p.a.gpus[1].memory, 8 * kGiB);
  EXPECT_FALSE(p.a.gpus[1].exclusive);
  EXPECT_EQ(p.a.cpus, 6);
  EXPECT_EQ(p.a.memory, 9 * kGiB);
  EXPECT_EQ(p.a.priority, -4);
  EXPECT_EQ(p.a.gang, "g12");
  EXPECT_EQ(p.a.replica, 1);
  EXPECT_EQ(p.a.lease_ms, 30000);
  EXPECT_EQ(p.a.expires_at_ms, 1700000000123);
  EXPECT_EQ(g.parts[1].a.job, "");
  EXPECT_TRUE(g.parts[1].a.gpus[0].exclusive);

  ReleaseRecord rel = RoundTrip(ReleaseRecord{{41, 42}, "lease expired"});
  EXPECT_THAT(rel.nums, ElementsAre(41u, 42u));
  EXPECT_EQ(rel.reason, "lease expired");
  RenewRecord ren = RoundTrip(RenewRecord{41, 1700000060123});
  EXPECT_EQ(ren.num, 41u);
  EXPECT_EQ(ren.expires_at_ms, 1700000060123);
  NextIdsRecord ids = RoundTrip(NextIdsRecord{43, 13});
  EXPECT_EQ(ids.next_id, 43u);
  EXPECT_EQ(ids.next_gang, 13u);
}

TEST(AllocatorRecords, OldRecordsWithoutLaterFieldsDecode) {
  // A grant from before jobs: no job trailer after its parts.
  Record r;
  // (kGoldenLog[6] less its trailer: two job names of 1 + 8 bytes.)
  const std::string with_jobs = Bytes(kGoldenLog[6]);
  ASSERT_OK(DecodeRecord(with_jobs.substr(0, with_jobs.size() - 18), &r));
  ASSERT_TRUE(std::holds_alternative<GrantRecord>(r));
  const GrantRecord& g = std::get<GrantRecord>(r);
  ASSERT_EQ(g.parts.size(), 2u);
  EXPECT_EQ(g.parts[0].a.job, "");
  EXPECT_EQ(g.parts[1].a.job, "");
  EXPECT_EQ(g.parts[1].a.gang, "g1");
  EXPECT_EQ(g.parts[1].a.replica, 1);
  // A quota from before max_priority: it ends after the memory limit.
  ASSERT_OK(DecodeRecord(Bytes("050005616c69636501060000018080808004"), &r));
  ASSERT_TRUE(std::holds_alternative<QuotaRecord>(r));
  Quota want;
  want.gpus = 3;
  want.memory = kGiB;
  EXPECT_EQ(std::get<QuotaRecord>(r).quota, want);
}

TEST(AllocatorRecords, MalformedRecordsAreDataLossNamingTheType) {
  Record r;
  EXPECT_THAT(DecodeRecord("", &r),
              StatusIs(absl::StatusCode::kDataLoss, "malformed empty record"));
  EXPECT_THAT(DecodeRecord(Bytes("0b00"), &r),
              StatusIs(absl::StatusCode::kDataLoss, "unknown record type 11"));
  struct Cut {
    std::string hex;
    size_t keep;  // bytes: short of a field the record cannot do without
    std::string message;
  };
  const std::vector<Cut> cuts = {
      {kGoldenLog[0], kGoldenLog[0].size() / 2 - 1, "malformed node record"},
      {kGoldenLog[12], 3, "malformed remove-node record"},
      {kGoldenLog[10], 5, "malformed mode record"},
      {kGoldenLog[8], 5, "malformed node-flags record"},
      {kGoldenLog[2], 5, "malformed quota record"},
      {kGoldenLog[5], 4, "malformed quota record"},
      {kGoldenLog[6], 40, "malformed grant record"},
      {kGoldenLog[13], 2, "malformed release record"},
      {"090702", 2, "malformed renew record"},
      {"0a0502", 2, "malformed next-ids record"},
  };
  for (const Cut& c : cuts) {
    EXPECT_THAT(DecodeRecord(Bytes(c.hex).substr(0, c.keep), &r),
                StatusIs(absl::StatusCode::kDataLoss, c.message))
        << c.hex;
  }
  // A grant of more parts than any request may have.
  EXPECT_THAT(DecodeRecord(Bytes("07a18d06"), &r),
              StatusIs(absl::StatusCode::kDataLoss, "malformed grant record"));
}

// A state directory written before the records moved replays to the same
// state, and the snapshot of that state is byte-identical.
TEST(AllocatorRecords, GoldenLogReplaysToTheGoldenState) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, [](const std::string&) {
                           return absl::OkStatus();
                         }));
    uint64_t last = 0;
    for (const std::string& hex : kGoldenLog) last = ledger->Append(Bytes(hex));
    ASSERT_OK(ledger->Sync(last));
  }
  AllocatorOptions o;
  o.state_dir = dir.path();
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(o));
  EXPECT_EQ(Hex(alloc->StateDigest()), kGoldenDigest);
  EXPECT_OK(alloc->CheckInvariants());
  ASSERT_OK_AND_ASSIGN(Allocation erin, alloc->GetAllocation("a4"));
  EXPECT_EQ(erin.user, "erin");
  EXPECT_EQ(erin.node, "n1");
  ASSERT_OK_AND_ASSIGN(NodeInfo n1, alloc->GetNode("n1"));
  EXPECT_EQ(n1.mode, Mode::kShared);
  EXPECT_FALSE(n1.pending_mode.has_value());
}

}  // namespace
}  // namespace deepnex::gpu
