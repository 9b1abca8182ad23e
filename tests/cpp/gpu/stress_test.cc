// No double booking: 8 clients, 10,000 random allocate/release each on 64
// nodes, with the allocator's invariants and an independent booking table
// checked throughout.
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::gpu {
namespace {

using namespace ::deepnex::gpu::test;  // NOLINT

// What the clients were granted, per GPU UUID, kept by the test itself. A
// client adds a grant after Allocate returns and removes it before calling
// Release, so this table is always a subset of the allocator's bookings: a
// conflict here is a real double booking.
class Bookings {
 public:
  explicit Bookings(const std::vector<Node>& nodes) {
    for (const auto& n : nodes) {
      for (size_t i = 0; i < n.gpus.size(); ++i) {
        capacity_["GPU-" + n.name + "-" + std::to_string(i)] = n.gpus[i].memory;
      }
      cpus_[n.name] = n.cpus;
    }
  }
  // Empty when fine, else what is wrong.
  std::string Add(const Allocation& a) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& g : a.gpus) {
      Slot& s = slots_[g.uuid];
      if (s.exclusive || (g.exclusive && s.holders > 0)) {
        return a.id + " double-books " + g.uuid;
      }
      s.memory += g.memory;
      ++s.holders;
      s.exclusive = g.exclusive;
      if (s.memory > capacity_.at(g.uuid)) return a.id + " overcommits " + g.uuid;
    }
    cpus_used_[a.node] += a.cpus;
    if (cpus_used_[a.node] > cpus_.at(a.node)) return a.id + " overcommits cpus of " + a.node;
    return "";
  }
  void Remove(const Allocation& a) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& g : a.gpus) {
      Slot& s = slots_[g.uuid];
      s.memory -= g.memory;
      --s.holders;
      if (s.holders == 0) s.exclusive = false;
    }
    cpus_used_[a.node] -= a.cpus;
  }

 private:
  struct Slot {
    uint64_t memory = 0;
    int holders = 0;
    bool exclusive = false;
  };
  std::mutex mu_;
  std::map<std::string, uint64_t> capacity_;
  std::map<std::string, int> cpus_;
  std::map<std::string, int> cpus_used_;
  std::map<std::string, Slot> slots_;
};

void RunClients(Allocator& alloc, Bookings& bookings, int clients, int ops, bool allow_wait) {
  Quota q;
  q.max_priority = 2;  // the priorities below
  ASSERT_OK(alloc.SetDefaultQuota(q).status());
  std::atomic<int> granted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(1234 + c);
      std::vector<Allocation> held;
      const std::string user = "user" + std::to_string(c);
      for (int op = 0; op < ops; ++op) {
        if (!held.empty() && (rng() % 2 == 0 || held.size() > 100)) {
          size_t k = rng() % held.size();
          bookings.Remove(held[k]);
          ASSERT_OK(alloc.Release(held[k].id));
          held.erase(held.begin() + k);
        } else {
          Request r;
          r.user = user;
          r.mode = rng() % 2 ? Mode::kShared : Mode::kExclusive;
          r.gpus = static_cast<int>(rng() % 5);
          if (r.mode == Mode::kShared && r.gpus > 0) r.gpu_memory = (1 + rng() % 40) * kGiB;
          r.cpus = static_cast<int>(rng() % 9);
          r.memory = (rng() % 17) * kGiB;
          if (r.gpus == 0 && r.cpus == 0) r.cpus = 1;
          r.spread = rng() % 8 == 0;
          r.priority = static_cast<int>(rng() % 3);
          AllocateOptions o;
          o.wait = allow_wait && rng() % 16 == 0;
          o.timeout = std::chrono::milliseconds(5);
          auto a = alloc.Allocate(r, o);
          if (a.ok()) {
            std::string problem = bookings.Add(*a);
            ASSERT_EQ(problem, "");
            held.push_back(*a);
            ++granted;
          } else {
            ASSERT_TRUE(a.status().code() == absl::StatusCode::kResourceExhausted ||
                        a.status().code() == absl::StatusCode::kDeadlineExceeded)
                << a.status();
            ++refused;
          }
        }
        if (op % 1000 == 999) ASSERT_OK(alloc.CheckInvariants());
      }
      for (const auto& a : held) {
        bookings.Remove(a);
        ASSERT_OK(alloc.Release(a.id));
      }
    });
  }
  for (auto& t : threads) t.join();
  std::cout << granted << " grants, " << refused << " refusals\n";
  EXPECT_GT(granted.load(), clients * ops / 8);
}

std::vector<Node> Cluster(int nodes) {
  std::vector<Node> out;
  for (int i = 0; i < nodes; ++i) {
    out.push_back(MakeNode("node" + std::to_string(i), 8, (i % 3 == 0 ? 40 : 80) * kGiB,
                           i % 2 ? Mode::kShared : Mode::kExclusive, 32, 256 * kGiB));
    if (i % 4 == 0) {
      for (int g = 0; g < 8; ++g) out.back().gpus[g].switch_id = g / 4;
    }
  }
  return out;
}

TEST(Stress, EightClientsTenThousandOpsNoDoubleBooking) {
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create());
  std::vector<Node> nodes = Cluster(64);
  for (const auto& n : nodes) ASSERT_OK(alloc->AddNode(n));
  Bookings bookings(nodes);
  RunClients(*alloc, bookings, 8, 10000, /*allow_wait=*/true);
  ASSERT_OK(alloc->CheckInvariants());
  EXPECT_TRUE(alloc->Allocations().empty());
  for (const auto& n : alloc->Nodes()) {
    EXPECT_EQ(n.cpus_used, 0);
    EXPECT_EQ(n.gpus_free(), 8);
  }
}

TEST(Stress, PersistentClientsReplayToTheSameState) {
  TempDir dir;
  std::string digest;
  std::vector<Node> nodes = Cluster(16);
  {
    AllocatorOptions o;
    o.state_dir = dir.path();
    o.snapshot_every = 500;
    ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(o));
    for (const auto& n : nodes) ASSERT_OK(alloc->AddNode(n));
    Bookings bookings(nodes);
    RunClients(*alloc, bookings, 8, 300, /*allow_wait=*/false);
    // Leave some allocations behind so the replay has state to rebuild.
    for (int i = 0; i < 10; ++i) ASSERT_OK(alloc->Allocate(Exclusive("keep", 1, 1)).status());
    digest = alloc->StateDigest();
  }
  AllocatorOptions o;
  o.state_dir = dir.path();
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(o));
  EXPECT_EQ(alloc->StateDigest(), digest);
  EXPECT_EQ(alloc->Allocations().size(), 10u);
  EXPECT_OK(alloc->CheckInvariants());
}

}  // namespace
}  // namespace deepnex::gpu
