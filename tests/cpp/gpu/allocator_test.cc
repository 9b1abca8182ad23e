// deepnex::gpu::Allocator: placement, modes, queue, gang, quotas, leases.
#include "deepnex/gpu/allocator.h"

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu/codec.h"
#include "gpu/gpu_test_util.h"
#include "gpu/ledger.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace ::deepnex::gpu::test;  // NOLINT
using namespace std::chrono_literals;   // NOLINT

std::unique_ptr<Allocator> NewAllocator(AllocatorOptions o = {}) {
  auto a = Allocator::Create(o);
  EXPECT_TRUE(a.ok()) << a.status();
  return std::move(a).value();
}

std::vector<int> Indices(const Allocation& a) {
  std::vector<int> v;
  for (const auto& g : a.gpus) v.push_back(g.index);
  return v;
}

// Waits (up to 60s, for a loaded machine) until `pred` holds.
template <class Pred>
::testing::AssertionResult Eventually(Pred pred) {
  return ::deepnex::test::WaitFor(pred, 60s, "the condition");
}

TEST(Allocator, ExclusiveGrantsWholeGpusWithEnv) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 8)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 2, 4, 16 * kGiB)));
  EXPECT_EQ(a.id, "a1");
  EXPECT_EQ(a.user, "alice");
  EXPECT_EQ(a.node, "n1");
  EXPECT_THAT(Indices(a), ElementsAre(0, 1));
  for (const auto& g : a.gpus) {
    EXPECT_TRUE(g.exclusive);
    EXPECT_EQ(g.memory, 80 * kGiB);
  }
  EXPECT_EQ(a.env.at("CUDA_VISIBLE_DEVICES"), "0,1");
  EXPECT_EQ(a.env.at("NVIDIA_VISIBLE_DEVICES"), "GPU-n1-0,GPU-n1-1");
  EXPECT_EQ(a.env.count("DEEPNEX_GPU_MEMORY_LIMIT"), 0u);
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("n1"));
  EXPECT_EQ(n.cpus_used, 4);
  EXPECT_EQ(n.memory_used, 16 * kGiB);
  EXPECT_EQ(n.gpus_free(), 6);
  Usage u = alloc->GetUsage("alice");
  EXPECT_EQ(u.gpus, 2);
  EXPECT_EQ(u.gpu_memory, 160 * kGiB);
  ASSERT_OK(alloc->Release(a.id));
  ASSERT_OK(alloc->Release(a.id));  // idempotent
  ASSERT_OK_AND_ASSIGN(n, alloc->GetNode("n1"));
  EXPECT_EQ(n.gpus_free(), 8);
  EXPECT_EQ(n.cpus_used, 0);
  EXPECT_OK(alloc->CheckInvariants());
}

TEST(Allocator, CpuOnlyRequestGetsNoGpus) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 0, 8, kGiB)));
  EXPECT_TRUE(a.gpus.empty());
  EXPECT_EQ(a.env.at("CUDA_VISIBLE_DEVICES"), "");
  EXPECT_EQ(a.env.at("NVIDIA_VISIBLE_DEVICES"), "void");
}

TEST(Allocator, SharedPacksByMemoryBestFit) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("s1", 2, 80 * kGiB, Mode::kShared)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Shared("alice", 1, 30 * kGiB)));
  EXPECT_THAT(Indices(a), ElementsAre(0));
  EXPECT_FALSE(a.gpus[0].exclusive);
  EXPECT_EQ(a.gpus[0].memory, 30 * kGiB);
  EXPECT_EQ(a.env.at("DEEPNEX_GPU_MEMORY_LIMIT"), std::to_string(30 * kGiB));
  // GPU 0 has 50GiB free: 60GiB goes to GPU 1.
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc->Allocate(Shared("bob", 1, 60 * kGiB)));
  EXPECT_THAT(Indices(b), ElementsAre(1));
  // Free: GPU 0 50GiB, GPU 1 20GiB. 15GiB fits best on GPU 1.
  ASSERT_OK_AND_ASSIGN(Allocation c, alloc->Allocate(Shared("carol", 1, 15 * kGiB)));
  EXPECT_THAT(Indices(c), ElementsAre(1));
  // 50GiB fits exactly on GPU 0; then nothing is left for 6GiB.
  ASSERT_OK_AND_ASSIGN(Allocation d, alloc->Allocate(Shared("dave", 1, 50 * kGiB)));
  EXPECT_THAT(Indices(d), ElementsAre(0));
  EXPECT_THAT(alloc->Allocate(Shared("erin", 1, 6 * kGiB), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("wait=false")));
  ASSERT_OK_AND_ASSIGN(Allocation e, alloc->Allocate(Shared("erin", 1, 5 * kGiB)));
  EXPECT_THAT(Indices(e), ElementsAre(1));
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("s1"));
  EXPECT_THAT(n.gpu_memory_used, ElementsAre(80 * kGiB, 80 * kGiB));
  EXPECT_OK(alloc->CheckInvariants());
}

// A gang is granted all at once: one that the matching nodes, empty, could
// never hold together is refused at once (as Slurm's "Requested node
// configuration is not available"), where it would otherwise wait forever.
TEST(Allocator, AGangNoSetOfNodesCouldEverHoldIsRefusedAtOnce) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2, 80 * kGiB, Mode::kExclusive, /*cpus=*/2)));
  ASSERT_OK(alloc->AddNode(MakeNode("n2", 2)));
  // A shared node whose GPUs have room for 4, 1 and 1 parts of 20GiB.
  Node s = MakeNode("s", 3, 20 * kGiB, Mode::kShared);
  s.gpus[0].memory = 80 * kGiB;
  ASSERT_OK(alloc->AddNode(s));
  // A deadline, so that a gang that waits fails the test instead of hanging.
  AllocateOptions waits;
  waits.timeout = std::chrono::seconds(10);
  auto never = [](int held, int parts, int nodes) {
    return StatusIs(absl::StatusCode::kResourceExhausted,
                    HasSubstr(absl::StrCat("): the ", nodes, " matching node(s) hold at most ",
                                           held, " of its ", parts, " parts at once")));
  };
  Request r = Exclusive("alice", 1, 1);
  r.replicas = 5;  // 2 GPUs on each node
  EXPECT_THAT(alloc->AllocateGang(r, waits), never(4, 5, 2));
  r.gpus = 2;
  r.cpus = 2;
  r.replicas = 3;  // one part on each node
  EXPECT_THAT(alloc->AllocateGang(r, waits), never(2, 3, 2));
  r.replicas = 2;
  ASSERT_OK_AND_ASSIGN(std::vector<Allocation> both, alloc->AllocateGang(r, waits));
  EXPECT_EQ(both.size(), 2u);
  // A part needs 2 distinct GPUs: the 80GiB one is in every part, so its
  // room for 4 makes at most 2 parts, not the 3 that 6 x 20GiB would.
  Request shared = Shared("bob", 2, 20 * kGiB);
  shared.replicas = 3;
  EXPECT_THAT(alloc->AllocateGang(shared, waits), never(2, 3, 1));
  EXPECT_EQ(alloc->QueueLength(), 0u);
  // The 2 that fit are granted: each part takes the GPUs with the most room
  // (best fit would give the first part both 20GiB GPUs, and the gang would
  // wait forever).
  shared.replicas = 2;
  ASSERT_OK_AND_ASSIGN(std::vector<Allocation> two, alloc->AllocateGang(shared, waits));
  ASSERT_EQ(two.size(), 2u);
  EXPECT_THAT(Indices(two[0]), ElementsAre(0, 1));
  EXPECT_THAT(Indices(two[1]), ElementsAre(0, 2));
  // One part too big for every node keeps its own message.
  Request huge = Exclusive("carol", 3);
  huge.replicas = 2;
  EXPECT_THAT(alloc->AllocateGang(huge, waits),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no node can ever hold")));
  EXPECT_OK(alloc->CheckInvariants());
}

TEST(Allocator, PacksUnlessSpreadAsked) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 8)));
  ASSERT_OK(alloc->AddNode(MakeNode("n2", 8)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 1)));
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc->Allocate(Exclusive("alice", 1)));
  EXPECT_EQ(a.node, b.node);
  Request r = Exclusive("alice", 1);
  r.spread = true;
  ASSERT_OK_AND_ASSIGN(Allocation c, alloc->Allocate(r));
  EXPECT_NE(c.node, a.node);
}

TEST(Allocator, MultiGpuRequestPrefersOneSwitchThenNuma) {
  auto alloc = NewAllocator();
  Node node = MakeNode("n1", 8);
  for (int i = 0; i < 8; ++i) {
    node.gpus[i].switch_id = i / 4;
    node.gpus[i].numa_node = i / 4;
  }
  ASSERT_OK(alloc->AddNode(node));
  ASSERT_OK_AND_ASSIGN(Allocation one, alloc->Allocate(Exclusive("alice", 1)));
  EXPECT_THAT(Indices(one), ElementsAre(0));
  // GPUs 1-3 (switch 0) cannot hold 4: the whole of switch 1.
  ASSERT_OK_AND_ASSIGN(Allocation four, alloc->Allocate(Exclusive("alice", 4)));
  EXPECT_THAT(Indices(four), ElementsAre(4, 5, 6, 7));
  ASSERT_OK(alloc->Release(four.id));
  // 2 GPUs: the smallest switch group that holds them (switch 0: 1, 2, 3).
  ASSERT_OK_AND_ASSIGN(Allocation two, alloc->Allocate(Exclusive("alice", 2)));
  EXPECT_THAT(Indices(two), ElementsAre(1, 2));
}

TEST(Allocator, CpusAndMemoryArePerNode) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 4, 80 * kGiB, Mode::kExclusive, 8, 32 * kGiB)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 1, 6, 8 * kGiB)));
  EXPECT_THAT(alloc->Allocate(Exclusive("bob", 1, 4, kGiB), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(alloc->Allocate(Exclusive("bob", 1, 2, 25 * kGiB), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc->Allocate(Exclusive("bob", 1, 2, 24 * kGiB)));
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("n1"));
  EXPECT_EQ(n.cpus_used, 8);
  EXPECT_EQ(n.memory_used, 32 * kGiB);
  EXPECT_OK(alloc->CheckInvariants());
}

TEST(Allocator, LabelSelectorAndNodeChoice) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(
      MakeNode("a", 8, 40 * kGiB, Mode::kExclusive, 64, 512 * kGiB, {{"gpu", "a100"}})));
  ASSERT_OK(alloc->AddNode(
      MakeNode("h", 8, 80 * kGiB, Mode::kExclusive, 64, 512 * kGiB, {{"gpu", "h100"}})));
  Request r = Exclusive("alice", 2);
  r.selector = {{"gpu", "h100"}};
  ASSERT_OK_AND_ASSIGN(Allocation x, alloc->Allocate(r));
  EXPECT_EQ(x.node, "h");
  r.selector.clear();
  r.node = "a";
  ASSERT_OK_AND_ASSIGN(Allocation y, alloc->Allocate(r));
  EXPECT_EQ(y.node, "a");
  // Exclusive gpu_memory is a minimum: only the 80GiB GPUs qualify.
  Request big = Exclusive("alice", 1);
  big.gpu_memory = 60 * kGiB;
  ASSERT_OK_AND_ASSIGN(Allocation z, alloc->Allocate(big));
  EXPECT_EQ(z.node, "h");
}

TEST(Allocator, QueueGrantsByPriorityThenFifo) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 1)));
  Quota q;
  q.max_priority = 5;
  ASSERT_OK(alloc->SetDefaultQuota(q).status());
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 1)));
  std::mutex mu;
  std::vector<std::string> order;
  std::vector<std::thread> threads;
  std::vector<std::string> ids(3);
  const int priorities[3] = {0, 0, 5};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      Request r = Exclusive("u" + std::to_string(i), 1);
      r.priority = priorities[i];
      AllocateOptions o;
      o.timeout = 20s;
      auto a = alloc->Allocate(r, o);
      ASSERT_TRUE(a.ok()) << a.status();
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(a->user);
      ids[i] = a->id;
    });
    ASSERT_TRUE(Eventually([&] { return alloc->QueueLength() == static_cast<size_t>(i + 1); }));
  }
  std::string last = held.id;
  for (int k = 0; k < 3; ++k) {
    ASSERT_OK(alloc->Release(last));
    ASSERT_TRUE(Eventually([&] {
      std::lock_guard<std::mutex> lock(mu);
      return order.size() == static_cast<size_t>(k + 1);
    }));
    std::lock_guard<std::mutex> lock(mu);
    int who = order.back()[1] - '0';
    last = ids[who];
  }
  for (auto& t : threads) t.join();
  EXPECT_THAT(order, ElementsAre("u2", "u0", "u1"));
  EXPECT_EQ(alloc->QueueLength(), 0u);
}

TEST(Allocator, PendingSaysWhereAndWhyEachRequestWaits) {
  std::mutex mu;
  std::vector<std::string> granted;  // outlives the allocator and its answers
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2, 80 * kGiB, Mode::kExclusive, 8, 64 * kGiB)));
  Quota q;
  q.max_priority = 5;
  ASSERT_OK(alloc->SetDefaultQuota(q).status());
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 2, 6)));
  auto queue = [&](const Request& r) {
    alloc->AllocateGangAsync(r, {}, [&](absl::StatusOr<std::vector<Allocation>> parts) {
      std::lock_guard<std::mutex> lock(mu);
      granted.push_back(parts.ok() ? parts->front().user : std::string(parts.status().message()));
    });
  };
  queue(Exclusive("alice", 2));
  queue(Exclusive("bob", 0, 4));
  queue(Exclusive("carol", 0, 1));  // fits now: backfilled past alice and bob
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_THAT(granted, ElementsAre("carol"));
  }
  Request eve = Exclusive("eve", 1);
  eve.priority = 5;
  queue(eve);
  ASSERT_EQ(alloc->QueueLength(), 3u);
  std::vector<PendingRequest> pending = alloc->Pending();
  ASSERT_EQ(pending.size(), 3u);
  std::vector<std::string> got;
  for (const auto& p : pending) {
    got.push_back(absl::StrCat(p.position, " ", p.id, " ", p.request.user, ": ", p.reason));
    EXPECT_GE(p.waited.count(), 0);
  }
  EXPECT_THAT(got,
              ElementsAre("1 q3 eve: waiting for 1 exclusive GPU (0 free on any eligible node)",
                          "2 q1 alice: waiting for 2 exclusive GPUs (0 free on any eligible "
                          "node); behind 1 request",
                          "3 q2 bob: waiting for 4 cpus (at most 1 free on an eligible node); "
                          "behind 2 requests"));
  EXPECT_EQ(pending[1].request.gpus, 2);
  EXPECT_EQ(pending[0].request.priority, 5);
  // A user's view keeps the positions in the whole queue.
  std::vector<PendingRequest> bobs = alloc->Pending("bob");
  ASSERT_EQ(bobs.size(), 1u);
  EXPECT_EQ(bobs[0].position, 3u);
  EXPECT_EQ(bobs[0].request.cpus, 4);
  EXPECT_TRUE(alloc->Pending("nobody").empty());
  // A cordoned node is no place to wait for.
  ASSERT_OK(alloc->Cordon("n1"));
  EXPECT_EQ(alloc->Pending()[0].reason,
            "waiting for a node to take it (1 matching node(s), all cordoned or switching mode)");
  // Refused for not waiting, it says why as the queue would (it said "no
  // free capacity" alone beside a free GPU of a node switching mode; probe).
  EXPECT_THAT(alloc->Allocate(Exclusive("dave", 1), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("and wait=false; queued, it would be waiting for a node to take "
                                 "it (1 matching node(s), all cordoned or switching mode)")));
  ASSERT_OK(alloc->Uncordon("n1"));
  ASSERT_OK(alloc->Release(held.id));
  // eve (1 GPU); alice (2) waits for eve's GPU and bob's 4 cpus pass her.
  ASSERT_TRUE(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return granted.size() == 3;
  }));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_THAT(granted, ElementsAre("carol", "eve", "bob"));
  }
  pending = alloc->Pending();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending[0].reason,
            "waiting for 2 exclusive GPUs (at most 1 free on an eligible node)");
  alloc->Shutdown();
  EXPECT_TRUE(alloc->Pending().empty());
}

TEST(Allocator, PriorityAboveTheUsersMaximumIsRefused) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 4)));
  Request r = Exclusive("alice", 1);
  r.priority = 1;
  EXPECT_THAT(alloc->Allocate(r),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "priority=1 is above alice's maximum priority 0 (the default quota's "
                       "max_priority, which an admin sets)"));
  r.priority = -3;  // lower than the maximum is always allowed
  ASSERT_OK(alloc->Allocate(r).status());
  Quota q;
  q.max_priority = 3;
  ASSERT_OK(alloc->SetQuota("alice", q).status());
  r.priority = 3;
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(r));
  EXPECT_EQ(a.priority, 3);
  r.priority = 4;
  EXPECT_THAT(alloc->AllocateGang(r, NoWait()),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "priority=4 is above alice's maximum priority 3 (their quota's "
                       "max_priority, which an admin sets)"));
  // Refused before it could queue, with or without free capacity.
  ASSERT_OK(alloc->Allocate(Exclusive("bob", 2)).status());
  r.priority = 2147483647;
  EXPECT_THAT(alloc->Allocate(r), StatusIs(absl::StatusCode::kPermissionDenied,
                                           HasSubstr("priority=2147483647 is above")));
  EXPECT_EQ(alloc->QueueLength(), 0u);
  EXPECT_EQ(alloc->GetQuota("bob").max_priority, 0);
  EXPECT_EQ(alloc->GetQuota("alice").ToString(),
            "gpus=unlimited gpu_memory=unlimited cpus=unlimited memory=unlimited max_priority=3");
}

// The issue's case: a request at priority 2^31-1 for a whole node no longer
// holds 14 free cpus from everyone else's small requests.
TEST(Allocator, SmallRequestsBackfillPastABlockedHead) {
  auto alloc = NewAllocator();  // reservation_after: 5min
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 0, 80 * kGiB, Mode::kExclusive, 16, 64 * kGiB)));
  Quota q;
  q.max_priority = 2147483647;
  ASSERT_OK(alloc->SetQuota("boss", q).status());
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 0, 2)));
  Request whole = Exclusive("boss", 0, 16);
  whole.priority = 2147483647;
  std::atomic<bool> answered{false};
  std::string head_node;
  alloc->AllocateGangAsync(whole, {}, [&](absl::StatusOr<std::vector<Allocation>> parts) {
    head_node = parts.ok() ? parts->front().node : std::string(parts.status().message());
    answered = true;
  });
  ASSERT_EQ(alloc->QueueLength(), 1u);
  std::vector<std::string> small;
  for (int i = 0; i < 14; ++i) {
    ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("u" + std::to_string(i), 0, 1),
                                                       NoWait()));
    small.push_back(a.id);
  }
  EXPECT_THAT(alloc->Allocate(Exclusive("late", 0, 1), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("1 request(s) are queued ahead of it")));
  EXPECT_EQ(alloc->QueueLength(), 1u);
  EXPECT_FALSE(answered);
  ASSERT_OK(alloc->Release(held.id));
  for (const auto& id : small) ASSERT_OK(alloc->Release(id));
  ASSERT_TRUE(Eventually([&] { return answered.load(); }));
  EXPECT_EQ(head_node, "n1");
  ASSERT_OK(alloc->CheckInvariants());
}

// Once the head has waited reservation_after, what it needs on its best node
// is kept for it: requests behind it get only what remains beyond that.
TEST(Allocator, HeadIsProtectedAfterReservationAfter) {
  AllocatorOptions o;
  o.reservation_after = 1s;
  auto alloc = NewAllocator(o);
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 0, 80 * kGiB, Mode::kExclusive, 16, 64 * kGiB)));
  ASSERT_OK(alloc->AddNode(MakeNode("n2", 0, 80 * kGiB, Mode::kExclusive, 4, 64 * kGiB)));
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 0, 2)));
  EXPECT_EQ(held.node, "n1");
  std::mutex mu;
  std::vector<std::string> granted;  // "user@node", in grant order
  auto queue = [&](const Request& r) {
    alloc->AllocateGangAsync(r, {}, [&](absl::StatusOr<std::vector<Allocation>> parts) {
      std::lock_guard<std::mutex> lock(mu);
      granted.push_back(parts.ok() ? parts->front().user + "@" + parts->front().node
                                   : std::string(parts.status().message()));
    });
  };
  queue(Exclusive("head", 0, 16));
  // Before reservation_after: backfill onto n1, the head's node.
  ASSERT_OK_AND_ASSIGN(Allocation early, alloc->Allocate(Exclusive("early", 0, 1), NoWait()));
  EXPECT_EQ(early.node, "n1");
  ASSERT_TRUE(Eventually([&] { return alloc->Pending()[0].waited >= 1s; }));
  // After: n1's 13 free cpus are the head's; n2 is not reserved.
  ASSERT_OK_AND_ASSIGN(Allocation late, alloc->Allocate(Exclusive("late", 0, 1), NoWait()));
  EXPECT_EQ(late.node, "n2");
  Request on_n1 = Exclusive("pinned", 0, 1);
  on_n1.node = "n1";
  EXPECT_THAT(alloc->Allocate(on_n1, NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("1 request(s) are queued ahead of it")));
  queue(on_n1);
  std::vector<PendingRequest> pending = alloc->Pending();
  ASSERT_EQ(pending.size(), 2u);
  EXPECT_EQ(pending[1].reason,
            "held back: the capacity it fits in is reserved for q1, which has waited longer "
            "than reservation_after; behind 1 request");
  // Releases go to the head first; pinned then waits for it.
  ASSERT_OK(alloc->Release(held.id));
  ASSERT_OK(alloc->Release(early.id));
  ASSERT_TRUE(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return granted.size() == 1;
  }));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_THAT(granted, ElementsAre("head@n1"));
  }
  EXPECT_EQ(alloc->QueueLength(), 1u);
  ASSERT_OK(alloc->CheckInvariants());
  alloc->Shutdown();
}

// Exclusive GPUs are reserved whole, the free ones first; the head's
// reservation leaves the rest of its node, and other nodes, to others.
TEST(Allocator, ReservationKeepsTheHeadsGpusAndLeavesTheRest) {
  AllocatorOptions o;
  o.reservation_after = 0ms;  // reserve at once
  auto alloc = NewAllocator(o);
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 4, 80 * kGiB, Mode::kExclusive, 8, 64 * kGiB)));
  ASSERT_OK(alloc->AddNode(MakeNode("s1", 2, 40 * kGiB, Mode::kShared, 8, 64 * kGiB)));
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 2, 2)));
  ASSERT_OK_AND_ASSIGN(Allocation s0, alloc->Allocate(Shared("root", 1, 30 * kGiB)));
  ASSERT_OK_AND_ASSIGN(Allocation s1, alloc->Allocate(Shared("root", 1, 35 * kGiB)));
  ASSERT_EQ(s0.gpus[0].index, 0);
  ASSERT_EQ(s1.gpus[0].index, 1);
  std::atomic<int> answers{0};
  auto count = [&](absl::StatusOr<std::vector<Allocation>>) { ++answers; };
  alloc->AllocateGangAsync(Exclusive("head", 3, 4), {}, count);  // 2 GPUs free: waits
  // Its 2 free GPUs and 4 of n1's 6 free cpus are held.
  EXPECT_THAT(alloc->Allocate(Exclusive("gpu", 1), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK_AND_ASSIGN(Allocation cpus, alloc->Allocate(Exclusive("cpu", 0, 2), NoWait()));
  EXPECT_EQ(cpus.node, "n1");
  ASSERT_OK_AND_ASSIGN(Allocation more, alloc->Allocate(Exclusive("cpu", 0, 1), NoWait()));
  EXPECT_EQ(more.node, "s1");  // n1's last 4 free cpus are the head's
  alloc->AllocateGangAsync(Shared("shead", 1, 40 * kGiB), {}, count);
  ASSERT_OK(alloc->Release(held.id));
  ASSERT_TRUE(Eventually([&] { return answers == 1; }));
  ASSERT_EQ(alloc->QueueLength(), 1u);
  // shead (40GiB) heads the queue now: it is held on the GPU with most free
  // memory (GPU 0, 10GiB free), and GPU 1's 5GiB stay open to others.
  EXPECT_THAT(alloc->Allocate(Shared("small", 1, 10 * kGiB), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK_AND_ASSIGN(Allocation small, alloc->Allocate(Shared("small", 1, 5 * kGiB), NoWait()));
  EXPECT_EQ(small.gpus[0].index, 1);
  ASSERT_OK(alloc->CheckInvariants());
  alloc->Shutdown();
}

// A waiting request that its quota (or priority cap) now refuses leaves the
// queue with the error, and its reservation with it.
TEST(Allocator, QuotaBlockedRequestsNeverBlockOthers) {
  AllocatorOptions o;
  o.reservation_after = 0ms;
  auto alloc = NewAllocator(o);
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2)));
  Quota boss;
  boss.max_priority = 9;
  ASSERT_OK(alloc->SetQuota("boss", boss).status());
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 1)));
  std::mutex mu;
  std::map<std::string, absl::Status> answers;
  auto queue = [&](const Request& r) {
    alloc->AllocateGangAsync(r, {}, [&, user = r.user](absl::StatusOr<std::vector<Allocation>> a) {
      std::lock_guard<std::mutex> lock(mu);
      answers[user] = a.status();
    });
  };
  Request head = Exclusive("boss", 2);
  head.priority = 9;
  queue(head);
  queue(Exclusive("bob", 1));  // the free GPU is the head's
  ASSERT_EQ(alloc->QueueLength(), 2u);
  boss.max_priority = 0;
  ASSERT_OK(alloc->SetQuota("boss", boss).status());
  ASSERT_TRUE(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return answers.size() == 2;
  }));
  EXPECT_THAT(answers["boss"],
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("priority=9 is above boss's maximum priority 0")));
  EXPECT_OK(answers["bob"]);
  EXPECT_EQ(alloc->QueueLength(), 0u);
  ASSERT_OK(alloc->Release(held.id));
}

TEST(Allocator, QuotasListLimitsBesideUsage) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 4)));
  Quota d;
  d.cpus = 4;
  ASSERT_OK(alloc->SetDefaultQuota(d).status());
  Quota q;
  q.gpus = 2;
  ASSERT_OK(alloc->SetQuota("alice", q).status());
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 1)));
  ASSERT_OK(alloc->Allocate(Exclusive("bob", 1, 3)).status());
  std::vector<UserQuota> all = alloc->Quotas();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].user, "");
  EXPECT_EQ(all[0].quota, d);
  EXPECT_FALSE(all[0].own);
  EXPECT_EQ(all[0].usage.gpus, 0);
  EXPECT_EQ(all[1].user, "alice");
  EXPECT_TRUE(all[1].own);
  EXPECT_EQ(all[1].quota, q);
  EXPECT_EQ(all[1].usage.gpus, 1);
  EXPECT_EQ(all[1].usage.gpu_memory, 80 * kGiB);
  EXPECT_EQ(all[2].user, "bob");
  EXPECT_FALSE(all[2].own);
  EXPECT_EQ(all[2].quota, d);  // the default applies
  EXPECT_EQ(all[2].usage.cpus, 3);
  // One user, even one the allocator never saw.
  std::vector<UserQuota> carol = alloc->Quotas("carol");
  ASSERT_EQ(carol.size(), 1u);
  EXPECT_EQ(carol[0].user, "carol");
  EXPECT_FALSE(carol[0].own);
  EXPECT_EQ(carol[0].quota, d);
  EXPECT_EQ(carol[0].usage.gpus, 0);
  // Without a quota of their own and holding nothing, a user is not listed.
  ASSERT_OK(alloc->ClearQuota("alice"));
  ASSERT_OK(alloc->Release(a.id));
  all = alloc->Quotas();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[1].user, "bob");
}

TEST(Allocator, QueueTimeoutAndWaitFalse) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 1)));
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("root", 1)));
  const std::string before = alloc->StateDigest();
  AllocateOptions o;
  o.timeout = 100ms;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 1), o),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("timeout: waited 100ms")));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 1), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("wait=false")));
  EXPECT_EQ(alloc->QueueLength(), 0u);
  EXPECT_EQ(alloc->StateDigest(), before);
}

TEST(Allocator, GangIsAllOrNothing) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 4)));
  ASSERT_OK(alloc->AddNode(MakeNode("n2", 4)));
  Request r = Exclusive("alice", 2);
  r.replicas = 3;
  ASSERT_OK_AND_ASSIGN(std::vector<Allocation> parts, alloc->AllocateGang(r));
  ASSERT_EQ(parts.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(parts[i].gang, "g1");
    EXPECT_EQ(parts[i].replica, i);
    EXPECT_EQ(parts[i].gpus.size(), 2u);
  }
  // 2 GPUs left; a gang of 2 x 2 cannot fit: nothing is granted.
  const std::string before = alloc->StateDigest();
  r.replicas = 2;
  EXPECT_THAT(alloc->AllocateGang(r, NoWait()), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(alloc->StateDigest(), before);
  EXPECT_EQ(alloc->Allocations().size(), 3u);
  // Queued gang is granted once the first gang goes (released by gang id).
  std::thread waiter([&] {
    AllocateOptions o;
    o.timeout = 20s;
    auto g = alloc->AllocateGang(r, o);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->size(), 2u);
  });
  ASSERT_TRUE(Eventually([&] { return alloc->QueueLength() == 1; }));
  ASSERT_OK(alloc->Release("g1"));
  waiter.join();
  EXPECT_EQ(alloc->Allocations().size(), 2u);
  EXPECT_THAT(alloc->Allocate(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("replicas=2")));
  EXPECT_OK(alloc->CheckInvariants());
}

// max_priority is part of the quota record: it survives a reopen, from the
// log and from a snapshot.
TEST(Allocator, QuotaMaxPrioritySurvivesALedgerReopen) {
  TempDir dir;
  AllocatorOptions o;
  o.state_dir = dir.path();
  {
    auto alloc = NewAllocator(o);
    ASSERT_OK(alloc->AddNode(MakeNode("n1", 2)));
    Quota q;
    q.gpus = 1;
    q.max_priority = 7;
    ASSERT_OK(alloc->SetQuota("alice", q).status());
    Quota d;
    d.max_priority = -2;
    ASSERT_OK(alloc->SetDefaultQuota(d).status());
  }
  for (bool from_snapshot : {false, true}) {
    auto alloc = NewAllocator(o);
    EXPECT_EQ(alloc->GetQuota("alice").max_priority, 7);
    EXPECT_EQ(alloc->GetQuota("alice").gpus, 1);
    EXPECT_EQ(alloc->GetQuota("bob").max_priority, -2);
    Request r = Exclusive("alice", 1);
    r.priority = 7;
    ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(r));
    ASSERT_OK(alloc->Release(a.id));
    r.priority = 8;
    EXPECT_THAT(alloc->Allocate(r), StatusIs(absl::StatusCode::kPermissionDenied,
                                             HasSubstr("alice's maximum priority 7")));
    EXPECT_THAT(alloc->Allocate(Exclusive("bob", 1)),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("priority=0 is above bob's maximum priority -2")));
    if (!from_snapshot) ASSERT_OK(alloc->Compact());  // the next round reads it
  }
}

// The job a request names is on its allocations, gang parts included, and
// survives a reopen from the log and from a snapshot; a bad name is refused.
TEST(Allocator, AllocationsCarryTheirJobAcrossAReopen) {
  TempDir dir;
  AllocatorOptions o;
  o.state_dir = dir.path();
  {
    auto alloc = NewAllocator(o);
    ASSERT_OK(alloc->AddNode(MakeNode("n1", 4)));
    Request r = Exclusive("alice", 1);
    r.job = "mnist-42";
    r.replicas = 2;
    ASSERT_OK_AND_ASSIGN(std::vector<Allocation> parts, alloc->AllocateGang(r));
    ASSERT_EQ(parts.size(), 2u);
    EXPECT_EQ(parts[0].job, "mnist-42");
    EXPECT_EQ(parts[1].job, "mnist-42");
    ASSERT_OK_AND_ASSIGN(Allocation plain, alloc->Allocate(Exclusive("bob", 1)));
    EXPECT_EQ(plain.job, "");
    r.job = "bad job";
    r.replicas = 1;
    EXPECT_THAT(alloc->Allocate(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("job \"bad job\"")));
  }
  for (bool from_snapshot : {false, true}) {
    auto alloc = NewAllocator(o);
    std::map<std::string, std::string> jobs;
    for (const Allocation& a : alloc->Allocations()) jobs[a.user + "/" + a.id] = a.job;
    ASSERT_EQ(jobs.size(), 3u) << from_snapshot;
    int alice = 0;
    for (const auto& [who, job] : jobs) {
      if (who.rfind("alice/", 0) == 0) {
        EXPECT_EQ(job, "mnist-42");
        ++alice;
      } else {
        EXPECT_EQ(job, "");
      }
    }
    EXPECT_EQ(alice, 2);
    if (!from_snapshot) ASSERT_OK(alloc->Compact());  // the next round reads it
  }
}

// A quota record written before max_priority existed (it ends after the
// memory limit) still replays, with the default cap 0.
TEST(Allocator, QuotaRecordFromBeforeMaxPriorityReplays) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto ledger, Ledger::Open(dir.path(), {}, [](const std::string&) {
                           return absl::OkStatus();
                         }));
    std::string record;
    Encoder e(&record);
    e.U8(5);  // kSetQuota
    e.U8(0);  // a user's, not the default
    e.Str("alice");
    e.U8(1);  // gpus = 3
    e.Signed(3);
    e.U8(0);  // gpu_memory, cpus, memory unset
    e.U8(0);
    e.U8(0);
    ASSERT_OK(ledger->Sync(ledger->Append(record)));
  }
  AllocatorOptions o;
  o.state_dir = dir.path();
  auto alloc = NewAllocator(o);
  Quota want;
  want.gpus = 3;
  EXPECT_EQ(alloc->GetQuota("alice"), want);
  EXPECT_EQ(alloc->GetQuota("alice").max_priority, 0);
}

TEST(Allocator, QuotaRefusesAndNamesIt) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 8)));
  ASSERT_OK(alloc->AddNode(MakeNode("s1", 8, 80 * kGiB, Mode::kShared)));
  Quota q;
  q.gpus = 2;
  q.gpu_memory = 200 * kGiB;
  ASSERT_OK_AND_ASSIGN(std::string note, alloc->SetQuota("alice", q));
  EXPECT_EQ(note, "");
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 2)));
  // Refused while alice's own grants fill the quota: a release lets it in.
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 1)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("quota of alice: gpus 2 in use + 1 requested > quota 2"),
                             Not(HasSubstr("can ever hold")))));
  ASSERT_OK(alloc->Release(a.id));
  // Exclusive GPUs count their whole memory: 3 x 80GiB > 200GiB.
  q.gpus = 8;
  ASSERT_OK(alloc->SetQuota("alice", q).status());
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 3)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("gpu_memory")));
  EXPECT_EQ(alloc->Allocations().size(), 0u);
  // The default quota applies to users without their own.
  Quota d;
  d.cpus = 4;
  ASSERT_OK(alloc->SetDefaultQuota(d).status());
  // A request alone over the quota says that no release will ever let it in.
  EXPECT_THAT(alloc->Allocate(Exclusive("bob", 0, 5)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("default quota of bob: cpus 0 in use + 5 requested > quota 4 "
                                 "(the request alone is over the quota: no grant can ever hold "
                                 "this request until the quota is raised)")));
  EXPECT_OK(alloc->Allocate(Exclusive("bob", 0, 4)).status());
  EXPECT_OK(alloc->CheckInvariants());
}

// A probe's node of GPUs with 2^64-1 bytes took grants whose sums wrapped:
// alice, with a 100 GiB quota, got 2 x 2^63 bytes and then read 0 in use.
// The nodes together hold at most 2^62 bytes of each kind, and a request's
// total saturates rather than wraps.
TEST(Allocator, SizesNearTwoToTheSixtyFourNeitherWrapUseNorPassQuotas) {
  auto alloc = NewAllocator();
  EXPECT_THAT(alloc->AddNode(MakeNode("huge", 2, UINT64_MAX, Mode::kShared)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("node huge: 16.0EiB of GPU memory and 512GiB of memory would take "
                                 "the nodes' total past 4EiB")));
  const uint64_t big = uint64_t{1} << 60;
  ASSERT_OK(alloc->AddNode(MakeNode("s1", 4, big, Mode::kShared)));  // 2^62 in all
  EXPECT_THAT(alloc->AddNode(MakeNode("s2", 1, 80 * kGiB, Mode::kShared)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node s2: ")));
  EXPECT_THAT(alloc->AddNode(MakeNode("m1", 0, 80 * kGiB, Mode::kShared, 8, uint64_t{1} << 63)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node m1: ")));
  Quota q;
  q.gpu_memory = 100 * kGiB;
  ASSERT_OK(alloc->SetQuota("alice", q).status());
  // 16 x 4 x 2^60 = 2^66 bytes, which wrapped to 0.
  Request r = Shared("alice", 4, big);
  r.replicas = 16;
  EXPECT_THAT(alloc->AllocateGang(r, NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("quota of alice: gpu_memory 0B in use + 16.0EiB requested > quota "
                                 "100GiB (the request alone is over the quota")));
  EXPECT_EQ(alloc->GetUsage("alice").gpu_memory, 0u);
  EXPECT_OK(alloc->CheckInvariants());
}

TEST(Allocator, QuotaBelowCurrentUseIsAllowedAndBlocksNewGrants) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 8)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 4)));
  Quota q;
  q.gpus = 2;
  ASSERT_OK_AND_ASSIGN(std::string note, alloc->SetQuota("alice", q));
  EXPECT_THAT(note, HasSubstr("quota of alice is below current use (gpus 4 > 2)"));
  EXPECT_EQ(alloc->Allocations("alice").size(), 1u);  // kept
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 1)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("below current use")));
  ASSERT_OK(alloc->Release(a.id));
  EXPECT_OK(alloc->Allocate(Exclusive("alice", 2)).status());
}

TEST(Allocator, ModeSwitchRefusedNamesAllocations) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2, 80 * kGiB, Mode::kShared)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Shared("alice", 1, 10 * kGiB)));
  const std::string before = alloc->StateDigest();
  EXPECT_THAT(alloc->SetNodeMode("n1", Mode::kExclusive),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("node n1 holds shared allocations a1 (alice)")));
  EXPECT_EQ(alloc->StateDigest(), before);
  ASSERT_OK(alloc->Release(a.id));
  ASSERT_OK(alloc->SetNodeMode("n1", Mode::kExclusive));
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc->Allocate(Exclusive("alice", 2)));
  EXPECT_TRUE(b.gpus[0].exclusive);
}

TEST(Allocator, ModeSwitchWhenDrainedTakesEffectAfterRelease) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2, 80 * kGiB, Mode::kShared)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Shared("alice", 1, 10 * kGiB)));
  ASSERT_OK(alloc->SetNodeMode("n1", Mode::kExclusive, ModeSwitch::kWhenDrained));
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("n1"));
  EXPECT_EQ(n.mode, Mode::kShared);
  ASSERT_TRUE(n.pending_mode.has_value());
  EXPECT_EQ(*n.pending_mode, Mode::kExclusive);
  // No new shared grants while it drains; an exclusive one waits.
  EXPECT_THAT(alloc->Allocate(Shared("bob", 1, kGiB), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  std::thread waiter([&] {
    AllocateOptions o;
    o.timeout = 20s;
    auto b = alloc->Allocate(Exclusive("bob", 2), o);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->node, "n1");
  });
  ASSERT_TRUE(Eventually([&] { return alloc->QueueLength() == 1; }));
  ASSERT_OK(alloc->Release(a.id));
  waiter.join();
  ASSERT_OK_AND_ASSIGN(n, alloc->GetNode("n1"));
  EXPECT_EQ(n.mode, Mode::kExclusive);
  EXPECT_FALSE(n.pending_mode.has_value());
  EXPECT_OK(alloc->CheckInvariants());
}

// A request waiting in the queue for a node that then switches to the other
// mode can never be granted there: it is refused as a new one would be
// (FailedPrecondition), at once or once a pending switch takes effect, as
// when its node is removed, rather than wait for its timeout. Existing
// grants stay (as a Slurm partition or Kubernetes label change leaves
// running work alone).
TEST(Allocator, AModeSwitchRefusesTheQueuedRequestsOnlyTheOldModeCouldHold) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2, 80 * kGiB, Mode::kExclusive, 4)));
  ASSERT_OK(alloc->AddNode(MakeNode("n2", 1, 80 * kGiB, Mode::kExclusive, 4)));
  // n1's cores are taken, so bob's request for n1 waits; n2's GPU is taken.
  ASSERT_OK(alloc->Allocate(Exclusive("alice", 0, 4)).status());
  ASSERT_OK_AND_ASSIGN(Allocation held, alloc->Allocate(Exclusive("alice", 1)));
  auto queued = [&](Request r) {
    return std::async(std::launch::async, [&alloc, r] {
      AllocateOptions o;
      o.timeout = 60s;
      return alloc->Allocate(r, o).status();
    });
  };
  Request on_n1 = Exclusive("bob", 1, 1);
  on_n1.node = "n1";
  auto first = queued(on_n1);
  ASSERT_TRUE(Eventually([&] { return alloc->QueueLength() == 1; }));
  ASSERT_OK(alloc->SetNodeMode("n1", Mode::kShared));  // no GPU allocation: at once
  EXPECT_THAT(first.get(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("every node that could take it is shared (n1)")));
  // A switch pending on n2: the request waits until it takes effect.
  Request on_n2 = Exclusive("bob", 1);
  on_n2.node = "n2";
  auto second = queued(on_n2);
  ASSERT_TRUE(Eventually([&] { return alloc->QueueLength() == 1; }));
  ASSERT_OK(alloc->SetNodeMode("n2", Mode::kShared, ModeSwitch::kWhenDrained));
  EXPECT_EQ(alloc->QueueLength(), 1u);
  ASSERT_OK(alloc->Release(held.id));
  EXPECT_THAT(second.get(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("every node that could take it is shared (n2)")));
  EXPECT_EQ(alloc->QueueLength(), 0u);
  EXPECT_OK(alloc->CheckInvariants());
}

TEST(Allocator, LeaseExpiresUnlessRenewed) {
  AllocatorOptions o;
  o.lease_check_interval = 10ms;
  auto alloc = NewAllocator(o);
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 1)));
  Request r = Exclusive("alice", 1);
  r.lease = 1000ms;  // renewed every 100ms: ample margin on a loaded machine
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(r));
  EXPECT_GT(a.expires_at_ms, 0);
  for (int i = 0; i < 4; ++i) {
    std::this_thread::sleep_for(100ms);
    ASSERT_OK(alloc->Renew(a.id).status());
  }
  EXPECT_OK(alloc->GetAllocation(a.id).status());
  ASSERT_TRUE(Eventually([&] { return alloc->Allocations().empty(); }));
  EXPECT_THAT(alloc->Renew(a.id), StatusIs(absl::StatusCode::kNotFound, HasSubstr(a.id)));
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("n1"));
  EXPECT_EQ(n.gpus_free(), 1);
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc->Allocate(Exclusive("alice", 1)));
  EXPECT_THAT(alloc->Renew(b.id), StatusIs(absl::StatusCode::kFailedPrecondition,
                                           HasSubstr("has no lease")));
}

TEST(Allocator, CordonDrainAndRemoveNode) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 1)));
  ASSERT_OK(alloc->Cordon("n1"));
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 1), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK(alloc->Uncordon("n1"));
  ASSERT_OK_AND_ASSIGN(Allocation b, alloc->Allocate(Exclusive("alice", 1)));
  EXPECT_THAT(alloc->RemoveNode("n1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("holds a1, a2")));
  ASSERT_OK(alloc->Drain("n1"));
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("n1"));
  EXPECT_TRUE(n.cordoned);
  EXPECT_TRUE(n.draining);
  EXPECT_EQ(n.allocation_ids.size(), 2u);
  ASSERT_OK(alloc->Drain("n1", /*release=*/true));
  EXPECT_TRUE(alloc->Allocations().empty());
  ASSERT_OK(alloc->RemoveNode("n1"));
  EXPECT_TRUE(alloc->Nodes().empty());
  EXPECT_THAT(alloc->GetNode("n1"), StatusIs(absl::StatusCode::kNotFound));
}

// A node whose agent is silent keeps its allocations and takes no new one;
// a request waits for it and is granted once it is ready again. Readiness is
// not in the ledger.
TEST(Allocator, NotReadyNodeTakesNoGrant) {
  auto alloc = NewAllocator();
  ASSERT_OK(alloc->AddNode(MakeNode("n1", 2)));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 1)));
  const uint64_t records = alloc->LedgerRecords();
  ASSERT_OK(alloc->SetNodeReady("n1", false));
  EXPECT_EQ(alloc->LedgerRecords(), records);
  ASSERT_OK_AND_ASSIGN(NodeInfo n, alloc->GetNode("n1"));
  EXPECT_FALSE(n.ready);
  EXPECT_FALSE(n.cordoned);
  EXPECT_EQ(n.allocation_ids, std::vector<std::string>{a.id});
  EXPECT_THAT(alloc->Allocate(Exclusive("alice", 1), NoWait()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  std::atomic<bool> granted{false};
  alloc->AllocateGangAsync(Exclusive("bob", 1), {},
                           [&](absl::StatusOr<std::vector<Allocation>> parts) {
                             granted = parts.ok() && parts->size() == 1 &&
                                       (*parts)[0].node == "n1";
                           });
  ASSERT_TRUE(Eventually([&] { return alloc->QueueLength() == 1; }));
  EXPECT_EQ(alloc->Pending()[0].reason,
            "waiting for a node to take it (1 matching node(s), all cordoned, not ready or "
            "switching mode)");
  ASSERT_OK(alloc->SetNodeReady("n1", true));
  ASSERT_TRUE(Eventually([&] { return granted.load(); }));
  EXPECT_TRUE(alloc->GetNode("n1")->ready);
  EXPECT_THAT(alloc->SetNodeReady("n9", false),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("n9")));
}

}  // namespace
}  // namespace deepnex::gpu
