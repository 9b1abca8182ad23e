// deepnex-central: token auth and ownership, admin-only changes, errors
// across the wire, the queue, metrics, and kill -9 of the daemon mid-stream.
#include "deepnex/gpu/central.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace ::deepnex::gpu::test;  // NOLINT
using namespace std::chrono_literals;   // NOLINT

class Central : public ::deepnex::test::CentralFixture {
 protected:
  void SetUp() override {
    CentralServerOptions o = ServerOptions();
    o.allocator.state_dir = dir_.path() + "/state";
    ASSERT_OK_AND_ASSIGN(server_, CentralServer::Create(o));
    admin_ = Client("admintok");
    alice_ = Client("alicetok");
    bob_ = Client("bobtok");
    ASSERT_OK(admin_->AddNode(MakeNode("s1", 2, 80 * kGiB, Mode::kShared)));
    ASSERT_OK(admin_->AddNode(MakeNode("x1", 1)));
  }

  std::unique_ptr<CentralClient> admin_, alice_, bob_;
};

TEST_F(Central, UsersActOnlyOnTheirOwnAllocations) {
  Request r = Shared("", 1, 10 * kGiB);
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_->Allocate(r));
  EXPECT_EQ(a.user, "alice");
  EXPECT_EQ(a.env.at("DEEPNEX_GPU_MEMORY_LIMIT"), std::to_string(10 * kGiB));
  const std::string before = server_->allocator().StateDigest();
  EXPECT_THAT(bob_->Release(a.id),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user bob cannot release a1: it is another user's")));
  EXPECT_THAT(bob_->Renew(a.id), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(server_->allocator().StateDigest(), before);
  ASSERT_OK_AND_ASSIGN(auto bobs, bob_->Allocations());
  EXPECT_TRUE(bobs.empty());
  EXPECT_THAT(bob_->Allocations("alice"), StatusIs(absl::StatusCode::kPermissionDenied));
  ASSERT_OK_AND_ASSIGN(auto alices, alice_->Allocations());
  ASSERT_EQ(alices.size(), 1u);
  EXPECT_EQ(alices[0].id, a.id);
  Request for_bob = Shared("bob", 1, kGiB);
  EXPECT_THAT(alice_->Allocate(for_bob),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user alice cannot allocate for user \"bob\"")));
  // A forged name is quoted: it cannot add a line to the caller's output.
  for_bob.user = "bob\ngranted a9\x1b[2J";
  EXPECT_THAT(alice_->Allocate(for_bob),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("cannot allocate for user \"bob\\ngranted a9\\x1b[2J\"")));
  EXPECT_THAT(bob_->Allocations(for_bob.user),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("of \"bob\\ngranted a9\\x1b[2J\"")));
  // Not UTF-8: no proto string carries it; the client refuses it naming the
  // field (central had answered UNIMPLEMENTED with no message), and an
  // asynchronous one alone (in a batch it would fail the ops sent along).
  for_bob.user = "bob\xff";
  EXPECT_THAT(alice_->Allocate(for_bob),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("user: \"bob\\xff\" is not UTF-8 text")));
  std::promise<absl::Status> async;
  alice_->AllocateGangAsync(for_bob, NoWait(),
                            [&](auto parts) { async.set_value(parts.status()); });
  EXPECT_THAT(async.get_future().get(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not UTF-8 text")));
  EXPECT_THAT(alice_->Release("a1\xff"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id: \"a1\\xff\"")));
  std::promise<absl::Status> release;
  alice_->ReleaseAsync("a1\xff", [&](absl::Status s) { release.set_value(s); });
  EXPECT_THAT(release.get_future().get(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"a1\\xff\"")));
  ASSERT_OK(alice_->Release(a.id));
  ASSERT_OK(alice_->Release(a.id));  // idempotent
  ASSERT_OK_AND_ASSIGN(auto all, admin_->Allocations());
  EXPECT_TRUE(all.empty());
}

TEST_F(Central, NodeModeAndQuotaChangesAreAdminOnly) {
  EXPECT_THAT(alice_->AddNode(MakeNode("n9", 1)), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(alice_->SetNodeMode("s1", Mode::kExclusive),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(alice_->Cordon("s1"), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(alice_->Drain("s1"), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(alice_->RemoveNode("x1"), StatusIs(absl::StatusCode::kPermissionDenied));
  Quota q;
  q.gpus = 8;
  EXPECT_THAT(alice_->SetQuota("alice", q), StatusIs(absl::StatusCode::kPermissionDenied));
  CentralClientOptions o;
  o.address = server_->address();
  ASSERT_OK_AND_ASSIGN(auto anonymous, CentralClient::Create(o));
  EXPECT_THAT(anonymous->Nodes(), StatusIs(absl::StatusCode::kUnauthenticated));
  q.gpus = 1;
  ASSERT_OK(admin_->SetQuota("bob", q).status());
  ASSERT_OK(bob_->Allocate(Shared("", 1, kGiB)).status());
  EXPECT_THAT(bob_->Allocate(Shared("", 1, kGiB)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("quota of bob: gpus")));
  ASSERT_OK(admin_->SetNodeMode("x1", Mode::kShared));
  ASSERT_OK_AND_ASSIGN(auto nodes, alice_->Nodes());
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[1].node.name, "x1");
  EXPECT_EQ(nodes[1].mode, Mode::kShared);
}

// A timeout of 0 or below was taken, and every call then failed at once.
TEST_F(Central, AClientTimeoutOutOfRangeIsRefusedNamingIt) {
  CentralClientOptions o;
  o.address = server_->address();
  for (auto [timeout, what] :
       {std::pair{std::chrono::milliseconds(0), "timeout=0ms: must be positive"},
        std::pair{std::chrono::milliseconds(-1), "timeout=-1ms: must be positive"},
        std::pair{std::chrono::milliseconds::max(), "timeout=9223372036854775807ms: must be at most"}}) {
    o.timeout = timeout;
    EXPECT_THAT(CentralClient::Create(o).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
  }
}

TEST_F(Central, QueueWaitsAcrossTheWireAndMetricsCount) {
  ASSERT_OK_AND_ASSIGN(Allocation held, alice_->Allocate(Exclusive("", 1)));
  AllocateOptions nowait;
  nowait.wait = false;
  EXPECT_THAT(bob_->Allocate(Exclusive("", 1), nowait),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("wait=false")));
  std::thread waiter([&] {
    AllocateOptions o;
    o.timeout = 60s;
    auto b = bob_->Allocate(Exclusive("", 1), o);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->user, "bob");
  });
  ASSERT_TRUE(WaitFor([&] { return server_->allocator().QueueLength() == 1; }, 60s,
                      "bob's request in the queue"));
  ASSERT_OK(alice_->Release(held.id));
  waiter.join();
  ASSERT_OK_AND_ASSIGN(std::string text, bob_->Metrics());
  EXPECT_THAT(text, HasSubstr("deepnex_grants_total 2\n"));
  EXPECT_THAT(text, HasSubstr("deepnex_refusals_total 1\n"));
  EXPECT_THAT(text, HasSubstr("deepnex_releases_total 1\n"));
  EXPECT_THAT(text, HasSubstr("deepnex_queue_length 0\n"));
  EXPECT_THAT(text, HasSubstr(
      "deepnex_node_gpus{mode=\"exclusive\",node=\"x1\",state=\"used\"} 1\n"));
  EXPECT_THAT(text, HasSubstr(
      "deepnex_gpu_memory_free_bytes{gpu=\"0\",mode=\"shared\",node=\"s1\"} 85899345920\n"));
}

// The allocator's gauges are read anew per scrape: a removed node leaves
// no series behind, and the counters keep counting.
TEST_F(Central, MetricsOfARemovedNodeAreGone) {
  ASSERT_OK_AND_ASSIGN(std::string before, admin_->Metrics());
  EXPECT_THAT(before,
              HasSubstr("deepnex_node_gpus{mode=\"exclusive\",node=\"x1\",state=\"free\"} 1\n"));
  ASSERT_OK(admin_->RemoveNode("x1"));
  ASSERT_OK_AND_ASSIGN(std::string after, admin_->Metrics());
  EXPECT_THAT(after, Not(HasSubstr("node=\"x1\"")));
  EXPECT_THAT(after,
              HasSubstr("deepnex_node_gpus{mode=\"shared\",node=\"s1\",state=\"free\"} 2\n"));
  EXPECT_THAT(after, HasSubstr("deepnex_grants_total 0\n"));
}

TEST_F(Central, QuotasAndQueueAreVisibleToTheirUsers) {
  Quota q;
  q.gpus = 2;
  ASSERT_OK(admin_->SetQuota("alice", q).status());
  ASSERT_OK_AND_ASSIGN(Allocation held, alice_->Allocate(Exclusive("", 1)));
  ASSERT_OK_AND_ASSIGN(std::vector<UserQuota> mine, alice_->Quotas());
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_EQ(mine[0].user, "alice");
  EXPECT_TRUE(mine[0].own);
  EXPECT_EQ(mine[0].quota, q);
  EXPECT_EQ(mine[0].usage.gpus, 1);
  EXPECT_EQ(mine[0].usage.gpu_memory, 80 * kGiB);
  EXPECT_THAT(alice_->Quotas("bob"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user alice cannot see the quota of \"bob\"")));
  ASSERT_OK_AND_ASSIGN(std::vector<UserQuota> all, admin_->Quotas());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].user, "");
  EXPECT_EQ(all[1].user, "alice");

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
  AllocateOptions o;
  o.timeout = 20s;
  bob_->AllocateGangAsync(Exclusive("", 1), o,
                          [&](absl::StatusOr<std::vector<Allocation>> parts) {
                            std::lock_guard<std::mutex> lock(mu);
                            status = parts.status();
                            done = true;
                            cv.notify_all();
                          });
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server_->allocator().QueueLength() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_EQ(server_->allocator().QueueLength(), 1u);
  ASSERT_OK_AND_ASSIGN(std::vector<PendingRequest> bobs, bob_->Pending());
  ASSERT_EQ(bobs.size(), 1u);
  EXPECT_EQ(bobs[0].position, 1u);
  EXPECT_EQ(bobs[0].id, "q1");
  EXPECT_EQ(bobs[0].request.user, "bob");
  EXPECT_EQ(bobs[0].request.gpus, 1);
  EXPECT_EQ(bobs[0].request.mode, Mode::kExclusive);
  EXPECT_EQ(bobs[0].reason, "waiting for 1 exclusive GPU (0 free on any eligible node)");
  ASSERT_OK_AND_ASSIGN(std::vector<PendingRequest> alices, alice_->Pending());
  EXPECT_TRUE(alices.empty());
  EXPECT_THAT(alice_->Pending("bob"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user alice cannot list the waiting requests of \"bob\"")));
  ASSERT_OK_AND_ASSIGN(std::vector<PendingRequest> everyone, admin_->Pending());
  ASSERT_EQ(everyone.size(), 1u);
  ASSERT_OK(alice_->Release(held.id));
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, 20s, [&] { return done; }));
  EXPECT_OK(status);
}

TEST_F(Central, StopFailsWaitingAllocations) {
  ASSERT_OK(alice_->Allocate(Exclusive("", 1)).status());
  std::atomic<bool> done{false};
  absl::Status status;
  std::thread waiter([&] {
    status = bob_->Allocate(Exclusive("", 1)).status();
    done = true;
  });
  ASSERT_TRUE(WaitFor([&] { return server_->allocator().QueueLength() == 1; }, 60s,
                      "bob's request in the queue"));
  server_->Stop();
  waiter.join();
  EXPECT_FALSE(status.ok());
}

// A client destroyed while another thread waits in its Allocate cancels
// that call, which returns Cancelled: a probe's waiter was left on the
// freed client for ever.
TEST_F(Central, DestroyingAClientCancelsItsWaitingAllocate) {
  ASSERT_OK(alice_->Allocate(Exclusive("", 1)).status());
  absl::Status status = absl::UnknownError("not returned");
  std::thread waiter([&] { status = bob_->Allocate(Exclusive("", 1)).status(); });
  ASSERT_TRUE(WaitFor([&] { return server_->allocator().QueueLength() == 1; }, 60s,
                      "bob's request in the queue"));
  bob_.reset();
  waiter.join();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kCancelled));
  // The request left central's queue with its call.
  EXPECT_TRUE(WaitFor([&] { return server_->allocator().QueueLength() == 0; }, 60s,
                      "the queue empty"));
}

// 8 clients over the wire, random grants and releases, with the ledger on.
TEST_F(Central, ConcurrentClientsKeepTheInvariants) {
  ASSERT_OK(admin_->AddNode(MakeNode("s2", 8, 80 * kGiB, Mode::kShared)));
  ASSERT_OK(admin_->AddNode(MakeNode("x2", 8)));
  std::vector<std::thread> threads;
  std::atomic<int> granted{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto client = Client(t % 2 ? "alicetok" : "bobtok");
      std::mt19937 rng(t);
      std::vector<std::string> held;
      AllocateOptions nowait;
      nowait.wait = false;
      for (int op = 0; op < 150; ++op) {
        if (!held.empty() && rng() % 2) {
          ASSERT_OK(client->Release(held.back()));
          held.pop_back();
          continue;
        }
        Request r = rng() % 2 ? Shared("", 1 + rng() % 2, (1 + rng() % 30) * kGiB)
                              : Exclusive("", 1 + rng() % 2);
        auto a = client->Allocate(r, nowait);
        if (a.ok()) {
          held.push_back(a->id);
          ++granted;
        } else {
          ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
        }
      }
      for (const auto& id : held) ASSERT_OK(client->Release(id));
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(granted.load(), 100);
  EXPECT_OK(server_->allocator().CheckInvariants());
  EXPECT_TRUE(server_->allocator().Allocations().empty());
}

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "connect failed";
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  (void)send(fd, req.data(), req.size(), 0);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// gRPC would let a second server share the port (SO_REUSEPORT), and clients
// would alternate between two allocators.
TEST(CentralServerStart, ASecondServerOnATakenPortFailsNamingIt) {
  CentralServerOptions o;
  o.address = "127.0.0.1:0";
  ASSERT_OK_AND_ASSIGN(auto first, CentralServer::Create(o));
  o.address = first->address();
  absl::StatusOr<std::unique_ptr<CentralServer>> second = CentralServer::Create(o);
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(second.status().message(),
            "central server: cannot listen on \"" + o.address + "\": Address already in use");
}

TEST(CentralMetrics, ServedOverHttp) {
  CentralServerOptions o;
  o.metrics_address = "127.0.0.1:0";
  ASSERT_OK_AND_ASSIGN(auto server, CentralServer::Create(o));
  ASSERT_GT(server->metrics_port(), 0);
  ASSERT_OK(server->allocator().AddNode(MakeNode("n1", 2, 80 * kGiB, Mode::kShared)));
  CentralClientOptions co;
  co.address = server->address();
  ASSERT_OK_AND_ASSIGN(auto client, CentralClient::Create(co));
  ASSERT_OK(client->Allocate(Shared("alice", 1, 30 * kGiB)).status());
  std::string resp = HttpGet(server->metrics_port(), "/metrics");
  EXPECT_THAT(resp, HasSubstr("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(resp, HasSubstr("deepnex_grants_total 1\n"));
  EXPECT_THAT(resp, HasSubstr(
      "deepnex_gpu_memory_allocated_bytes{gpu=\"0\",mode=\"shared\",node=\"n1\"} 32212254720\n"));
  EXPECT_THAT(HttpGet(server->metrics_port(), "/other"), HasSubstr("404 Not Found"));
}

#ifdef DEEPNEX_CENTRAL_BIN
// kill -9 of the daemon while 4 clients stream grants, each with `window`
// asynchronous calls in flight (0: blocking calls); then the ledger holds
// every acknowledged grant and at most those in flight besides.
void KillNineDuringGrants(int window) {
  TempDir dir;
  const std::string nodes = dir.path() + "/nodes.json";
  std::ofstream(nodes) << R"({"nodes": [{"name": "n1", "cpus": 1000000, "memory": "1PiB",
      "mode": "shared", "gpus": {"count": 8, "memory": "80GiB"}}]})";
  const CentralDaemon daemon = StartCentralDaemon(
      {"--state-dir", dir.path() + "/state", "--nodes", nodes});
  const pid_t pid = daemon.pid;
  ASSERT_FALSE(daemon.address.empty());
  CentralClientOptions o;
  o.address = daemon.address;
  o.timeout = 5s;
  std::mutex mu;
  std::set<std::string> acked;
  absl::Status last_error;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto client = CentralClient::Create(o);
      ASSERT_TRUE(client.ok());
      std::condition_variable cv;
      int in_flight = 0;
      for (int i = 0; !stop; ++i) {
        Request r = i % 2 ? Shared("u" + std::to_string(t), 1, 1 << 20)
                          : Exclusive("u" + std::to_string(t), 0, 1);
        auto answered = [&](absl::StatusOr<std::vector<Allocation>> a) {
          std::lock_guard<std::mutex> lock(mu);
          if (a.ok()) {
            acked.insert(a->front().id);
          } else {  // the daemon is gone
            last_error = a.status();
          }
          --in_flight;
          cv.notify_all();
        };
        std::unique_lock<std::mutex> lock(mu);
        if (!last_error.ok()) break;
        ++in_flight;
        if (window == 0) {
          lock.unlock();
          auto a = (*client)->Allocate(r);
          answered(a.ok() ? absl::StatusOr<std::vector<Allocation>>({*a}) : a.status());
          continue;
        }
        cv.wait(lock, [&] { return in_flight <= window || !last_error.ok(); });
        lock.unlock();
        (*client)->AllocateGangAsync(r, NoWait(), answered);
      }
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return in_flight == 0; });
    });
  }
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (acked.size() >= 300 || !last_error.ok()) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  stop = true;
  for (auto& t : threads) t.join();
  ASSERT_GE(acked.size(), 300u) << last_error;
  AllocatorOptions ao;
  ao.state_dir = dir.path() + "/state";
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(ao));
  std::set<std::string> present;
  for (const auto& a : alloc->Allocations()) present.insert(a.id);
  for (const auto& id : acked) EXPECT_TRUE(present.count(id)) << id << " was acknowledged";
  size_t extra = 0;
  for (const auto& id : present) extra += !acked.count(id);
  EXPECT_LE(extra, size_t{4} * std::max(window, 1));
  EXPECT_OK(alloc->CheckInvariants());
  std::cout << acked.size() << " acknowledged grants through deepnex-central, " << extra
            << " durable but unacknowledged\n";
}

TEST(CentralCrash, KillNineKeepsEveryAcknowledgedGrant) { KillNineDuringGrants(0); }

TEST(CentralCrash, KillNineKeepsEveryAcknowledgedAsyncGrant) { KillNineDuringGrants(16); }

// kill -9 of the daemon at a random point while users race allocate and
// release against their quotas and an admin switches node modes, six times
// over one state directory; after each kill the ledger holds every
// acknowledged grant not acknowledged released, none acknowledged released,
// each node's acknowledged mode (or one still in flight), no user over a
// quota and no GPU double-booked; then the next daemon starts on it.
TEST(CentralCrash, KillNineAtRandomPointsLosesAndDoubleBooksNothing) {
  TempDir dir;
  const std::string nodes = dir.path() + "/nodes.json";
  std::ofstream(nodes) << R"({"nodes": [
      {"name": "x1", "cpus": 16, "memory": "64GiB", "mode": "exclusive",
       "gpus": {"count": 4, "memory": "40GiB"}},
      {"name": "s1", "cpus": 16, "memory": "64GiB", "mode": "shared",
       "gpus": {"count": 4, "memory": "40GiB"}}]})";
  const std::string state = dir.path() + "/state";
  const std::vector<std::string> node_names = {"x1", "s1"};
  std::mt19937_64 rng(2026);
  for (int round = 0; round < 6; ++round) {
    const CentralDaemon daemon = StartCentralDaemon({"--state-dir", state, "--nodes", nodes});
    ASSERT_FALSE(daemon.address.empty()) << "round " << round;
    CentralClientOptions o;
    o.address = daemon.address;
    o.timeout = 5s;
    if (round == 0) {
      ASSERT_OK_AND_ASSIGN(auto admin, CentralClient::Create(o));
      Quota q;
      q.gpus = 2;
      q.gpu_memory = 60 * kGiB;
      q.cpus = 6;
      q.memory = 20 * kGiB;
      for (const char* u : {"u0", "u1", "u2"}) ASSERT_OK(admin->SetQuota(u, q).status());
    }
    std::mutex mu;
    std::set<std::string> acked, released, releasing;
    // Per node: the target of the last acknowledged SetNodeMode, and one in flight.
    std::map<std::string, std::set<Mode>> may_be;
    std::atomic<bool> stop{false};
    std::atomic<int> ops{0};
    // Connected before any thread starts: the kill may come before a late
    // thread would have dialed.
    std::vector<std::unique_ptr<CentralClient>> clients;
    for (int t = 0; t < 7; ++t) {
      ASSERT_OK_AND_ASSIGN(auto c, CentralClient::Create(o));
      clients.push_back(std::move(c));
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t, seed = rng()] {
        CentralClient* client = clients[t].get();
        std::mt19937_64 r(seed);
        std::vector<std::string> held;
        while (!stop) {
          if (!held.empty() && r() % 2) {
            const std::string id = held.back();
            {
              std::lock_guard<std::mutex> lock(mu);
              releasing.insert(id);
            }
            if (!client->Release(id).ok()) return;  // the daemon is gone
            std::lock_guard<std::mutex> lock(mu);
            released.insert(id);
            held.pop_back();
            ++ops;
            continue;
          }
          const std::string user = "u" + std::to_string(t % 3);
          Request req = r() % 2 ? Shared(user, 1 + r() % 2, (1 + r() % 30) * kGiB, r() % 3)
                                : Exclusive(user, r() % 2, 1 + r() % 2, (r() % 8) * kGiB);
          auto a = client->Allocate(req, NoWait());
          if (a.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            acked.insert(a->id);
            held.push_back(a->id);
            ++ops;
          } else if (a.status().code() != absl::StatusCode::kResourceExhausted &&
                     a.status().code() != absl::StatusCode::kFailedPrecondition) {
            return;  // the daemon is gone
          }
        }
      });
    }
    threads.emplace_back([&, seed = rng()] {
      CentralClient* client = clients[6].get();
      std::mt19937_64 r(seed);
      while (!stop) {
        const std::string name = node_names[r() % 2];
        const Mode mode = r() % 2 ? Mode::kShared : Mode::kExclusive;
        {
          std::lock_guard<std::mutex> lock(mu);
          may_be[name].insert(mode);
        }
        absl::Status s = client->SetNodeMode(
            name, mode, r() % 2 ? ModeSwitch::kWhenDrained : ModeSwitch::kRefuse);
        std::lock_guard<std::mutex> lock(mu);
        if (s.ok()) {
          may_be[name] = {mode};
        } else if (s.code() == absl::StatusCode::kFailedPrecondition) {
          may_be[name].erase(mode);  // refused: nothing changed
          if (may_be[name].empty()) may_be.erase(name);
        } else {
          return;  // the daemon is gone
        }
      }
    });
    // Kill after a random number of acknowledged operations.
    const int kill_after = 20 + static_cast<int>(rng() % 200);
    ASSERT_TRUE(WaitFor([&] { return ops >= kill_after; }, 60s,
                        absl::StrCat(kill_after, " acknowledged operations, round ", round)));
    kill(daemon.pid, SIGKILL);
    int status = 0;
    waitpid(daemon.pid, &status, 0);
    stop = true;
    for (auto& t : threads) t.join();
    AllocatorOptions ao;
    ao.state_dir = state;
    ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create(ao));
    ASSERT_OK(alloc->CheckInvariants()) << "round " << round;
    EXPECT_EQ(OverQuota(alloc->Quotas()), "") << "round " << round;
    std::set<std::string> present;
    for (const auto& a : alloc->Allocations()) present.insert(a.id);
    for (const auto& id : acked) {
      if (released.count(id)) {
        EXPECT_FALSE(present.count(id)) << id << " was released, round " << round;
      } else if (!releasing.count(id)) {
        EXPECT_TRUE(present.count(id)) << id << " was granted, round " << round;
      }
    }
    for (const auto& n : alloc->Nodes()) {
      const Mode target = n.pending_mode.value_or(n.mode);
      auto it = may_be.find(n.node.name);
      if (it != may_be.end() && it->second.size() == 1) {
        EXPECT_EQ(target, *it->second.begin()) << n.node.name << ", round " << round;
      }
      int gpu_allocs = 0;
      for (int c : n.gpu_allocations) gpu_allocs += c;
      EXPECT_FALSE(n.pending_mode && gpu_allocs == 0)
          << n.node.name << ": a switch pending with no allocation left, round " << round;
    }
    // The next daemon starts from a state with no grants.
    for (const auto& id : present) ASSERT_OK(alloc->Release(id));
    std::cout << "round " << round << ": killed after " << ops << " operations, "
              << present.size() << " grants recovered\n";
  }
}

// deepnex-central over one node of one GPU, its nodes file in `dir`.
CentralDaemon OneGpuCentral(const TempDir& dir) {
  const std::string nodes = dir.path() + "/nodes.json";
  std::ofstream(nodes) << R"({"nodes": [{"name": "n1", "cpus": 4, "memory": "1GiB",
      "mode": "exclusive", "gpus": {"count": 1, "memory": "80GiB"}}]})";
  return StartCentralDaemon({"--nodes", nodes});
}

// An Allocate that may wait without end (no timeout) is not also left
// waiting for a deepnex-central that is gone: it fails Unavailable. (It had
// waited for the server to come back, forever.)
TEST(CentralCrash, AWaitingAllocateToAGoneCentralFailsAtOnce) {
  TempDir dir;
  const CentralDaemon daemon = OneGpuCentral(dir);
  ASSERT_FALSE(daemon.address.empty());
  CentralClientOptions o;
  o.address = daemon.address;
  o.timeout = 5s;
  ASSERT_OK_AND_ASSIGN(auto client, CentralClient::Create(o));
  kill(daemon.pid, SIGKILL);
  int status = 0;
  waitpid(daemon.pid, &status, 0);
  // The first call may still go out on the broken connection; the next
  // ones find the channel reconnecting, which is where they waited.
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THAT(client->Allocate(Exclusive("alice", 0, 1)),
                StatusIs(absl::StatusCode::kUnavailable));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << "call " << i;
  }
}

// An Allocate waiting in the queue without a timeout, to a deepnex-central
// that goes silent (stopped, or its host cut off: no reset, no FIN), fails
// Unavailable within the client's keepalive (a ping unanswered for
// kClientKeepalive after up to kClientKeepalive), where it waited for ever:
// user clients dialed central without keepalive.
TEST(CentralCrash, AWaitingAllocateToASilentCentralFailsWithinTheKeepalive) {
  TempDir dir;
  const CentralDaemon daemon = OneGpuCentral(dir);
  ASSERT_FALSE(daemon.address.empty());
  CentralClientOptions o;
  o.address = daemon.address;
  ASSERT_OK_AND_ASSIGN(auto client, CentralClient::Create(o));
  ASSERT_OK(client->Allocate(Exclusive("alice", 1, 1)).status());
  std::promise<absl::Status> answer;
  std::future<absl::Status> answered = answer.get_future();
  std::thread waiting([&] { answer.set_value(client->Allocate(Exclusive("bob", 1, 1)).status()); });
  ASSERT_TRUE(WaitFor([&] { return client->Pending().ok() && client->Pending()->size() == 1; },
                      30s, "bob's request in the queue"));
  kill(daemon.pid, SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  // About 2 * kClientKeepalive; more only for a loaded host.
  const bool in_time = answered.wait_for(6 * kClientKeepalive) == std::future_status::ready;
  const auto took = std::chrono::steady_clock::now() - stopped;
  // Gone for good: its sockets close, which ends a call that waited on.
  kill(daemon.pid, SIGKILL);
  kill(daemon.pid, SIGCONT);
  int status = 0;
  waitpid(daemon.pid, &status, 0);
  waiting.join();
  ASSERT_TRUE(in_time) << "still waiting "
                       << std::chrono::duration_cast<std::chrono::seconds>(took).count()
                       << " s after central stopped";
  EXPECT_THAT(answered.get(), StatusIs(absl::StatusCode::kUnavailable));
}
#endif

}  // namespace
}  // namespace deepnex::gpu
