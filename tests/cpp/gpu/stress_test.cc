// No double booking: 8 clients, 10,000 random allocate/release each on 64
// nodes, with the allocator's invariants and an independent booking table
// checked throughout.
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <string>
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

// Three clients per user race for the same quota, and between grants switch
// nodes between exclusive and shared (at once or when drained) and cordon
// them as an admin would; a checker reads the quotas and the invariants from
// the allocator's own state throughout. No user is ever over a quota, no GPU
// is double-booked, and once everything is released no switch is pending.
void QuotasHoldUnderRacesAndModeSwitches(Allocator& alloc) {
  std::vector<Node> nodes;
  for (int i = 0; i < 6; ++i) {
    nodes.push_back(MakeNode("node" + std::to_string(i), 4, 40 * kGiB,
                             i % 2 ? Mode::kShared : Mode::kExclusive, 32, 256 * kGiB));
  }
  for (const auto& n : nodes) ASSERT_OK(alloc.AddNode(n));
  Quota q;
  q.gpus = 3;
  q.gpu_memory = 100 * kGiB;
  q.cpus = 10;
  q.memory = 40 * kGiB;
  const int users = 4;
  for (int u = 0; u < users; ++u) ASSERT_OK(alloc.SetQuota("u" + std::to_string(u), q).status());
  std::atomic<bool> stop{false};
  std::atomic<int> granted{0}, switched{0};
  std::mutex problem_mu;
  std::string problem;
  auto report = [&](const std::string& p) {
    std::lock_guard<std::mutex> lock(problem_mu);
    if (problem.empty()) problem = p;
  };
  // An admin's change among the grants; the clients make them in turn, so
  // that they land among grants however the threads are scheduled.
  auto admin_change = [&](std::mt19937_64& rng) {
    const std::string name = "node" + std::to_string(rng() % nodes.size());
    const Mode mode = rng() % 2 ? Mode::kShared : Mode::kExclusive;
    switch (rng() % 4) {
      case 0:
      case 1: {
        absl::Status s = alloc.SetNodeMode(
            name, mode, rng() % 2 ? ModeSwitch::kWhenDrained : ModeSwitch::kRefuse);
        if (s.ok()) {
          ++switched;
        } else if (s.code() != absl::StatusCode::kFailedPrecondition) {
          report("mode: " + s.ToString());
        }
        break;
      }
      case 2:
        if (absl::Status s = alloc.Cordon(name); !s.ok()) report("cordon: " + s.ToString());
        break;
      default:
        if (absl::Status s = alloc.Uncordon(name); !s.ok()) report("uncordon: " + s.ToString());
    }
  };
  std::vector<std::thread> clients;
  for (int c = 0; c < 3 * users; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(99 + c);
      std::vector<std::string> held;
      for (int op = 0; op < 1500; ++op) {
        if (op % 20 == 19) admin_change(rng);
        if (!held.empty() && (rng() % 2 == 0 || held.size() > 4)) {
          size_t k = rng() % held.size();
          absl::Status s = alloc.Release(held[k]);
          if (!s.ok()) report("release " + held[k] + ": " + s.ToString());
          held.erase(held.begin() + k);
          continue;
        }
        Request r;
        r.user = "u" + std::to_string(c % users);
        r.mode = rng() % 2 ? Mode::kShared : Mode::kExclusive;
        r.gpus = static_cast<int>(rng() % 3);
        if (r.mode == Mode::kShared && r.gpus > 0) r.gpu_memory = (1 + rng() % 30) * kGiB;
        r.cpus = static_cast<int>(rng() % 5);
        r.memory = (rng() % 12) * kGiB;
        if (r.gpus == 0 && r.cpus == 0 && r.memory == 0) r.cpus = 1;
        AllocateOptions o;
        o.wait = rng() % 4 == 0;
        o.timeout = std::chrono::milliseconds(2);
        auto a = alloc.Allocate(r, o);
        if (a.ok()) {
          held.push_back(a->id);
          ++granted;
        } else if (a.status().code() != absl::StatusCode::kResourceExhausted &&
                   a.status().code() != absl::StatusCode::kDeadlineExceeded &&
                   a.status().code() != absl::StatusCode::kFailedPrecondition) {
          report("allocate: " + a.status().ToString());
        }
      }
      for (const auto& id : held) {
        absl::Status s = alloc.Release(id);
        if (!s.ok()) report("release " + id + ": " + s.ToString());
      }
    });
  }
  std::thread checker([&] {
    while (!stop) {
      if (std::string over = OverQuota(alloc.Quotas()); !over.empty()) report(over);
      if (absl::Status s = alloc.CheckInvariants(); !s.ok()) report(s.ToString());
    }
  });
  for (auto& t : clients) t.join();
  stop = true;
  checker.join();
  EXPECT_EQ(problem, "");
  EXPECT_OK(alloc.CheckInvariants());
  EXPECT_EQ(OverQuota(alloc.Quotas()), "");
  EXPECT_TRUE(alloc.Allocations().empty());
  for (const auto& n : alloc.Nodes()) {
    EXPECT_FALSE(n.pending_mode.has_value()) << n.node.name << " has no allocation left";
    EXPECT_EQ(n.gpus_free(), 4) << n.node.name;
  }
  EXPECT_GT(granted.load(), 1000);
  EXPECT_GT(switched.load(), 100);  // the switches when drained never fail
  std::cout << granted << " grants, " << switched << " mode changes\n";
}

TEST(Stress, QuotasHoldUnderRacesAndModeSwitches) {
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create());
  QuotasHoldUnderRacesAndModeSwitches(*alloc);
}

TEST(Stress, PersistentQuotasHoldUnderRacesAndModeSwitchesAndReplay) {
  TempDir dir;
  AllocatorOptions o;
  o.state_dir = dir.path();
  o.fsync = false;  // a process crash loses nothing; the test is about the state
  o.snapshot_every = 2000;
  std::string digest;
  {
    ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(o));
    QuotasHoldUnderRacesAndModeSwitches(*alloc);
    digest = alloc->StateDigest();
  }
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(o));
  EXPECT_EQ(alloc->StateDigest(), digest);
  EXPECT_OK(alloc->CheckInvariants());
}

}  // namespace
}  // namespace deepnex::gpu
