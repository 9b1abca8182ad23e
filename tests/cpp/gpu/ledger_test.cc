// The crash-safe ledger: checksums, group commit, snapshots, replay, torn
// tails, damaged middles, and a kill -9 during a stream of grants.
#include "gpu/ledger.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::gpu {
namespace {

namespace fs = std::filesystem;
using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace ::deepnex::gpu::test;  // NOLINT
using namespace std::chrono_literals;   // NOLINT

std::vector<std::string> Files(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << data;
}

// The newest log file that holds records (beyond its 8-byte header).
std::string LastLogWithRecords(const std::string& dir) {
  std::string last;
  for (const auto& p : Files(dir, "wal-")) {
    if (fs::file_size(p) > 8) last = p;
  }
  return last;
}

struct Collected {
  std::vector<std::string> records;
  Ledger::ApplyFn fn() {
    return [this](const std::string& r) {
      records.push_back(r);
      return absl::OkStatus();
    };
  }
};

TEST(Ledger, ReplaysWhatWasSynced) {
  TempDir dir;
  {
    Collected c;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
    EXPECT_TRUE(c.records.empty());
    EXPECT_EQ(ledger->Append("one"), 1u);
    EXPECT_EQ(ledger->Append("two"), 2u);
    ASSERT_OK(ledger->Sync(2));
  }
  Collected c;
  LedgerRecovery rec;
  ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn(), &rec));
  EXPECT_THAT(c.records, ElementsAre("one", "two"));
  EXPECT_EQ(rec.log_records, 2u);
  EXPECT_EQ(rec.torn_bytes, 0u);
  EXPECT_EQ(ledger->Append("three"), 3u);
}

TEST(Ledger, SecondOpenOfADirectoryIsRefused) {
  TempDir dir;
  Collected c;
  ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
  EXPECT_THAT(Ledger::Open(dir.path(), {}, c.fn()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("in use")));
}

TEST(Ledger, ConcurrentSyncsShareFsyncs) {
  TempDir dir;
  Collected c;
  ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
  constexpr int kThreads = 8, kEach = 100;
  std::mutex mu;  // Append order must be the order the records are logged in
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        uint64_t seq;
        {
          std::lock_guard<std::mutex> lock(mu);
          seq = ledger->Append(std::to_string(t) + ":" + std::to_string(i));
        }
        ASSERT_OK(ledger->Sync(seq));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ledger->last_seq(), uint64_t{kThreads * kEach});
  EXPECT_LT(ledger->flushes(), uint64_t{kThreads * kEach});
  std::cout << "group commit: " << kThreads * kEach << " syncs, " << ledger->flushes()
            << " fsyncs\n";
  ledger.reset();
  Collected again;
  ASSERT_OK(Ledger::Open(dir.path(), {}, again.fn()).status());
  EXPECT_EQ(again.records.size(), size_t{kThreads * kEach});
}

TEST(Ledger, TornTailIsDroppedAndTruncated) {
  TempDir dir;
  {
    Collected c;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
    for (int i = 0; i < 3; ++i) ledger->Append("record" + std::to_string(i));
    ASSERT_OK(ledger->Sync(3));
  }
  const std::string log = LastLogWithRecords(dir.path());
  const std::string good = ReadAll(log);
  // A frame header cut short, as a crash mid-write leaves it.
  WriteAll(log, good + std::string("\x20\x00\x00\x00\x11\x22", 6));
  {
    Collected c;
    LedgerRecovery rec;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn(), &rec));
    EXPECT_THAT(c.records, ElementsAre("record0", "record1", "record2"));
    EXPECT_EQ(rec.torn_bytes, 6u);
  }
  EXPECT_EQ(ReadAll(log), good);
}

TEST(Ledger, LastRecordWithBadChecksumIsTorn) {
  TempDir dir;
  {
    Collected c;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
    ledger->Append("first");
    ledger->Append("second");
    ASSERT_OK(ledger->Sync(2));
  }
  const std::string log = LastLogWithRecords(dir.path());
  std::string data = ReadAll(log);
  data[data.size() - 1] ^= 0x40;  // the last payload byte of "second"
  WriteAll(log, data);
  Collected c;
  LedgerRecovery rec;
  ASSERT_OK(Ledger::Open(dir.path(), {}, c.fn(), &rec).status());
  EXPECT_THAT(c.records, ElementsAre("first"));
  EXPECT_EQ(rec.torn_bytes, 16u + 6u);
}

TEST(Ledger, DamageInTheMiddleIsDataLoss) {
  TempDir dir;
  {
    Collected c;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
    for (int i = 0; i < 5; ++i) ledger->Append("payload-" + std::to_string(i));
    ASSERT_OK(ledger->Sync(5));
  }
  const std::string log = LastLogWithRecords(dir.path());
  std::string data = ReadAll(log);
  const size_t second = 8 + 16 + 9;  // header, then record 1 (16 + 9 bytes)
  data[second + 16 + 2] ^= 0x01;     // a payload byte of record 2
  WriteAll(log, data);
  Collected c;
  EXPECT_THAT(Ledger::Open(dir.path(), {}, c.fn()),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(log), HasSubstr("damaged at offset 33"),
                             HasSubstr("after record 1"), HasSubstr("checksum mismatch"),
                             HasSubstr("refusing to replay a partial history"))));
  // Still refused on a second try: nothing was truncated.
  EXPECT_THAT(Ledger::Open(dir.path(), {}, c.fn()), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(Ledger, SnapshotDropsTheLogBehindIt) {
  TempDir dir;
  {
    Collected c;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
    for (int i = 0; i < 10; ++i) ledger->Append("old" + std::to_string(i));
    ASSERT_OK(ledger->Snapshot({"state-a", "state-b"}));
    EXPECT_EQ(ledger->records_since_snapshot(), 0u);
    ledger->Append("new");
    ASSERT_OK(ledger->Sync(11));
  }
  EXPECT_EQ(Files(dir.path(), "snap-").size(), 1u);
  EXPECT_EQ(Files(dir.path(), "wal-").size(), 1u);
  Collected c;
  LedgerRecovery rec;
  ASSERT_OK(Ledger::Open(dir.path(), {}, c.fn(), &rec).status());
  EXPECT_THAT(c.records, ElementsAre("state-a", "state-b", "new"));
  EXPECT_EQ(rec.snapshot_seq, 10u);
}

TEST(Ledger, DamagedSnapshotIsDataLoss) {
  TempDir dir;
  {
    Collected c;
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, c.fn()));
    ledger->Append("x");
    ASSERT_OK(ledger->Snapshot({"state"}));
  }
  std::string snap = Files(dir.path(), "snap-").at(0);
  std::string data = ReadAll(snap);
  data.back() ^= 1;
  WriteAll(snap, data);
  Collected c;
  EXPECT_THAT(Ledger::Open(dir.path(), {}, c.fn()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum")));
}

// ---- through the allocator

std::unique_ptr<Allocator> Open(const std::string& dir, uint64_t snapshot_every = 100000) {
  AllocatorOptions o;
  o.state_dir = dir;
  o.snapshot_every = snapshot_every;
  auto a = Allocator::Create(o);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(a).value() : nullptr;
}

AllocatorOptions DirOptions(const std::string& dir) {
  AllocatorOptions o;
  o.state_dir = dir;
  return o;
}

// Exercises every record type.
void Workload(Allocator& alloc) {
  ASSERT_OK(alloc.AddNode(MakeNode("n1", 8)));
  ASSERT_OK(alloc.AddNode(MakeNode("s1", 4, 80 * kGiB, Mode::kShared, 32, 256 * kGiB,
                                   {{"zone", "a"}})));
  ASSERT_OK(alloc.AddNode(MakeNode("gone", 1)));
  ASSERT_OK(alloc.RemoveNode("gone"));
  Quota q;
  q.gpus = 6;
  q.memory = 100 * kGiB;
  ASSERT_OK(alloc.SetQuota("alice", q).status());
  Quota d;
  d.cpus = 100;
  ASSERT_OK(alloc.SetDefaultQuota(d).status());
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc.Allocate(Exclusive("alice", 2, 4, 8 * kGiB)));
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc.Allocate(Shared("bob", 2, 10 * kGiB, 2, kGiB)));
  Request g = Shared("carol", 1, 5 * kGiB);
  g.replicas = 3;
  ASSERT_OK(alloc.AllocateGang(g).status());
  Request leased = Exclusive("dave", 1);
  leased.lease = std::chrono::hours(1);
  ASSERT_OK_AND_ASSIGN(Allocation l, alloc.Allocate(leased));
  ASSERT_OK(alloc.Renew(l.id).status());
  ASSERT_OK(alloc.Release(a.id));
  ASSERT_OK(alloc.SetNodeMode("s1", Mode::kExclusive, ModeSwitch::kWhenDrained));
  ASSERT_OK(alloc.Cordon("n1"));
  ASSERT_OK(alloc.Uncordon("n1"));
  ASSERT_OK(alloc.Drain("n1"));
}

TEST(AllocatorLedger, RestartReplaysToTheSameState) {
  TempDir dir;
  std::string digest;
  {
    auto alloc = Open(dir.path());
    Workload(*alloc);
    ASSERT_FALSE(HasFailure());
    digest = alloc->StateDigest();
    EXPECT_GT(alloc->LedgerRecords(), 10u);
  }
  auto alloc = Open(dir.path());
  ASSERT_NE(alloc, nullptr);
  EXPECT_EQ(alloc->StateDigest(), digest);
  EXPECT_EQ(alloc->LedgerRecords(), 0u);
  EXPECT_OK(alloc->CheckInvariants());
  ASSERT_OK_AND_ASSIGN(NodeInfo s1, alloc->GetNode("s1"));
  ASSERT_TRUE(s1.pending_mode.has_value());
  EXPECT_EQ(alloc->Allocations("carol").size(), 3u);
  // Ids continue where they stopped.
  ASSERT_OK(alloc->Uncordon("n1"));
  ASSERT_OK_AND_ASSIGN(Allocation next, alloc->Allocate(Exclusive("erin", 1)));
  EXPECT_EQ(next.id, "a7");
  EXPECT_THAT(Allocator::Create(DirOptions(dir.path())),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("in use")));
}

TEST(AllocatorLedger, PeriodicSnapshotsCompactTheLog) {
  TempDir dir;
  std::string digest;
  {
    auto alloc = Open(dir.path(), /*snapshot_every=*/8);
    Workload(*alloc);
    ASSERT_FALSE(HasFailure());
    for (int i = 0; i < 40; ++i) {
      ASSERT_OK_AND_ASSIGN(Allocation x, alloc->Allocate(Exclusive("zed", 0, 1)));
      if (i % 2) ASSERT_OK(alloc->Release(x.id));
    }
    digest = alloc->StateDigest();
  }
  EXPECT_EQ(Files(dir.path(), "snap-").size(), 1u);
  EXPECT_LE(Files(dir.path(), "wal-").size(), 1u);
  {
    auto alloc = Open(dir.path(), 8);
    ASSERT_NE(alloc, nullptr);
    EXPECT_EQ(alloc->StateDigest(), digest);
    ASSERT_OK(alloc->Compact());
  }
  auto alloc = Open(dir.path());
  EXPECT_EQ(alloc->StateDigest(), digest);
}

TEST(AllocatorLedger, TornTailAndDamagedMiddle) {
  TempDir dir;
  std::string digest;
  {
    auto alloc = Open(dir.path());
    Workload(*alloc);
    ASSERT_FALSE(HasFailure());
    digest = alloc->StateDigest();
  }
  const std::string log = LastLogWithRecords(dir.path());
  const std::string good = ReadAll(log);
  WriteAll(log, good + std::string(11, '\x07'));
  {
    auto alloc = Open(dir.path());
    ASSERT_NE(alloc, nullptr);
    EXPECT_EQ(alloc->StateDigest(), digest);
  }
  std::string bad = ReadAll(log);
  bad[40] ^= 0x10;
  WriteAll(log, bad);
  EXPECT_THAT(Allocator::Create(DirOptions(dir.path())),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("damaged at offset")));
}

TEST(AllocatorLedger, LeaseExpiryIsInTheLedger) {
  TempDir dir;
  AllocatorOptions o;
  o.state_dir = dir.path();
  o.lease_check_interval = 5ms;
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(o));
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 1)));
  Request r = Exclusive("alice", 1);
  r.lease = 50ms;
  ASSERT_OK(alloc->Allocate(r).status());
  EXPECT_TRUE(::deepnex::test::WaitFor([&] { return alloc->Allocations().empty(); }, 60s,
                                       "the lease to expire"));
  alloc.reset();
  ASSERT_OK_AND_ASSIGN(auto records, Ledger::ReadLog(dir.path()));
  bool found = false;
  for (const auto& [seq, r] : records) found |= r.find("lease expired") != std::string::npos;
  EXPECT_TRUE(found);
}

// A child process streams grants, printing each id once Allocate returned
// (acknowledged); the parent kills it with SIGKILL mid-stream and reopens.
TEST(AllocatorLedger, KillNineDuringGrantsKeepsExactlyTheAcknowledged) {
  TempDir dir;
  {
    auto alloc = Open(dir.path());
    for (int i = 0; i < 4; ++i) {
      ASSERT_OK(alloc->AddNode(MakeNode("n" + std::to_string(i), 8, 80 * kGiB, Mode::kShared,
                                        1 << 20, uint64_t{1} << 50)));
    }
  }
  constexpr int kThreads = 4;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    AllocatorOptions o;
    o.state_dir = dir.path();
    o.snapshot_every = 97;  // compactions happen during the stream too
    auto alloc = Allocator::Create(o);
    if (!alloc.ok()) _exit(3);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0;; ++i) {
          Request r = i % 2 ? Shared("u" + std::to_string(t), 1, 1 << 20)
                            : Exclusive("u" + std::to_string(t), 0, 1);
          auto a = (*alloc)->Allocate(r);
          if (!a.ok()) _exit(4);
          std::string line = a->id + "\n";
          if (write(fds[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
            _exit(5);
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    _exit(0);
  }
  close(fds[1]);
  std::set<std::string> acked;
  std::string pending;
  auto read_some = [&](int timeout_ms) {
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return false;
    char buf[4096];
    ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n <= 0) return false;
    pending.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      acked.insert(pending.substr(0, nl));
      pending.erase(0, nl + 1);
    }
    return true;
  };
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (acked.size() < 500 && std::chrono::steady_clock::now() < deadline) {
    if (!read_some(1000)) break;
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  while (read_some(0)) {
  }
  close(fds[0]);
  ASSERT_GE(acked.size(), 500u);

  auto alloc = Open(dir.path());
  ASSERT_NE(alloc, nullptr);
  std::set<std::string> present;
  for (const auto& a : alloc->Allocations()) present.insert(a.id);
  for (const auto& id : acked) EXPECT_TRUE(present.count(id)) << id << " was acknowledged";
  // Grants in flight at the kill (at most one per thread) may or may not be
  // there; nothing else may.
  std::vector<std::string> extra;
  for (const auto& id : present) {
    if (!acked.count(id)) extra.push_back(id);
  }
  EXPECT_LE(extra.size(), size_t{kThreads});
  EXPECT_OK(alloc->CheckInvariants());
  std::cout << acked.size() << " acknowledged grants, " << extra.size()
            << " durable but unacknowledged (in flight at the kill)\n";
}

}  // namespace
}  // namespace deepnex::gpu
