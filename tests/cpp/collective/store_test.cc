#include "deepnex/collective/store.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "test_matchers.h"

namespace deepnex::collective {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using std::chrono::milliseconds;

std::unique_ptr<StoreServer> StartServer(StoreServerOptions options = {}) {
  auto server = StoreServer::Create(options);
  EXPECT_THAT(server, IsOk());
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<StoreClient> Connect(const std::string& address, const std::string& prefix = "",
                                     const std::string& token = "",
                                     milliseconds timeout = milliseconds(5000)) {
  StoreClientOptions o;
  o.address = address;
  o.prefix = prefix;
  o.token = token;
  o.timeout = timeout;
  auto client = StoreClient::Create(o);
  EXPECT_THAT(client, IsOk());
  return client.ok() ? std::move(*client) : nullptr;
}

TEST(StoreTest, SetGetDeleteCheck) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  EXPECT_NE(server->port(), 0);
  auto c = Connect(server->address());
  ASSERT_OK(c->Set("a", std::string("x\0y", 3)));
  ASSERT_OK_AND_ASSIGN(std::string v, c->Get("a"));
  EXPECT_EQ(v, std::string("x\0y", 3));
  ASSERT_OK(c->Set("a", ""));
  ASSERT_OK_AND_ASSIGN(v, c->Get("a"));
  EXPECT_EQ(v, "");
  ASSERT_OK_AND_ASSIGN(auto present, c->Check({"a", "b"}));
  EXPECT_THAT(present, ElementsAre(true, false));
  ASSERT_OK_AND_ASSIGN(bool deleted, c->Delete("a"));
  EXPECT_TRUE(deleted);
  ASSERT_OK_AND_ASSIGN(deleted, c->Delete("a"));
  EXPECT_FALSE(deleted);
  EXPECT_EQ(server->size(), 0u);
  EXPECT_THAT(c->Set("", "v"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StoreTest, GetWaitsForTheKey) {
  auto server = StartServer();
  auto a = Connect(server->address());
  auto b = Connect(server->address());
  // Taken before the setter starts its 100 ms: a late start of this thread
  // cannot shorten what the Get is seen to wait.
  auto start = std::chrono::steady_clock::now();
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    EXPECT_OK(b->Set("late", "here"));
  });
  ASSERT_OK_AND_ASSIGN(std::string v, a->Get("late", milliseconds(60000)));
  EXPECT_EQ(v, "here");
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(90));
  setter.join();
}

// milliseconds::max(), C++'s "no limit", waits: it overflowed into a
// deadline already past, DeadlineExceeded at once (probe).
TEST(StoreTest, AGetOfMillisecondsMaxWaitsForTheKey) {
  auto server = StartServer();
  auto a = Connect(server->address());
  auto b = Connect(server->address());
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    EXPECT_OK(b->Set("late", "here"));
  });
  ASSERT_OK_AND_ASSIGN(std::string v, a->Get("late", milliseconds::max()));
  EXPECT_EQ(v, "here");
  setter.join();
}

// Keys are proto strings: one that is not UTF-8 came back UNIMPLEMENTED with
// no message, after libprotobuf's log line (probe).
TEST(StoreTest, AKeyOrPrefixThatIsNotUtf8IsRefusedNamingIt) {
  auto server = StartServer();
  auto c = Connect(server->address());
  const std::string bad = "k\xff";
  const auto refused = [](const std::string& what) {
    return StatusIs(absl::StatusCode::kInvalidArgument,
                    AllOf(HasSubstr(what + ": key \"k\\xff\""), HasSubstr("is not UTF-8 text")));
  };
  EXPECT_THAT(c->Set(bad, "v"), refused("set"));
  EXPECT_THAT(c->Get(bad, milliseconds(100)), refused("get"));
  EXPECT_THAT(c->Wait({"ok", bad}, milliseconds(100)), refused("wait"));
  EXPECT_THAT(c->Add(bad, 1), refused("add"));
  EXPECT_THAT(c->CompareSet(bad, "", "v"), refused("compare_set"));
  EXPECT_THAT(c->Delete(bad), refused("delete"));
  EXPECT_THAT(c->Check({bad}), refused("check"));
  StoreClientOptions o;
  o.address = server->address();
  o.prefix = "job\xfe";
  EXPECT_THAT(StoreClient::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not UTF-8 text")));
  EXPECT_OK(c->Set("ok", "v"));  // the store still serves
}

TEST(StoreTest, MultiGetAndWaitNameTheMissingKeys) {
  auto server = StartServer();
  auto c = Connect(server->address(), "job1");
  ASSERT_OK(c->Set("k0", "0"));
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(c->MultiGet({"k0", "k1", "k2"}, milliseconds(200)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("\"job1/k1\""), HasSubstr("\"job1/k2\""),
                             testing::Not(HasSubstr("k0")))));
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, milliseconds(190));
  EXPECT_LT(elapsed, milliseconds(1100));
  EXPECT_THAT(c->Wait({"k0", "k3"}, milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("\"job1/k3\"")));
  // Many waiters, completed by one set each.
  std::vector<std::thread> waiters;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i) {
    waiters.emplace_back([&] {
      auto w = Connect(server->address(), "job1");
      if (w->Wait({"k1", "k2"}, milliseconds(60000)).ok()) ++ok;
    });
  }
  std::this_thread::sleep_for(milliseconds(100));
  ASSERT_OK(c->Set("k1", "1"));
  ASSERT_OK(c->Set("k2", "2"));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(ok.load(), 8);
  ASSERT_OK_AND_ASSIGN(auto values, c->MultiGet({"k2", "k0", "k1"}, milliseconds(10)));
  EXPECT_THAT(values, ElementsAre("2", "0", "1"));
}

// A waiter watches one missing key at a time (a rendezvous of n ranks then
// costs O(n) per waiter): keys set in any order, and one deleted after it
// was seen, still complete it only when all of them are there at once.
TEST(StoreTest, AWaiterCompletesWhenEveryKeyIsThereAtOnce) {
  auto server = StartServer();
  auto c = Connect(server->address());
  auto w = Connect(server->address());
  auto values = std::async(std::launch::async, [&] {
    return w->MultiGet({"k0", "k1", "k2", "k3"}, milliseconds(60000));
  });
  ASSERT_OK(c->Set("k3", "3"));
  ASSERT_OK(c->Set("k1", "1"));
  ASSERT_OK(c->Set("k0", "0"));
  ASSERT_OK_AND_ASSIGN(bool deleted, c->Delete("k1"));  // seen, then gone
  ASSERT_TRUE(deleted);
  ASSERT_OK(c->Set("k2", "2"));
  EXPECT_EQ(values.wait_for(milliseconds(300)), std::future_status::timeout) << "k1 is missing";
  ASSERT_OK(c->Set("k1", "one"));
  ASSERT_OK_AND_ASSIGN(auto got, values.get());
  EXPECT_THAT(got, ElementsAre("0", "one", "2", "3"));
}

// The error names a few of the missing keys and counts the rest, so that it
// stays within what a gRPC status carries.
TEST(StoreTest, AnErrorNamesTheFirstMissingKeysAndCountsTheRest) {
  auto server = StartServer();
  auto c = Connect(server->address());
  std::vector<std::string> keys;
  for (int i = 0; i < 100000; ++i) keys.push_back(absl::StrCat("rank/", i));
  EXPECT_THAT(c->MultiGet(keys, milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("\"rank/7\" and 99992 more"),
                             testing::Not(HasSubstr("rank/8\"")))));
}

TEST(StoreTest, AddIsAtomic) {
  auto server = StartServer();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto c = Connect(server->address());
      for (int i = 0; i < 50; ++i) EXPECT_OK(c->Add("n", 1).status());
    });
  }
  for (auto& t : threads) t.join();
  auto c = Connect(server->address());
  ASSERT_OK_AND_ASSIGN(int64_t n, c->Add("n", 0));
  EXPECT_EQ(n, 200);
  ASSERT_OK_AND_ASSIGN(n, c->Add("n", -201));
  EXPECT_EQ(n, -1);
  ASSERT_OK(c->Set("text", "abc"));
  EXPECT_THAT(c->Add("text", 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("text")));
}

// A sum past int64 was signed overflow in the server (undefined; in
// practice 2^62 + 2^62 came back as -2^63, and a counter went negative).
TEST(StoreTest, AnAddPastInt64IsRefusedAndLeavesTheValue) {
  auto server = StartServer();
  auto c = Connect(server->address());
  constexpr int64_t kBig = int64_t{1} << 62;
  ASSERT_OK_AND_ASSIGN(int64_t n, c->Add("n", kBig));
  EXPECT_EQ(n, kBig);
  EXPECT_THAT(c->Add("n", kBig),
              StatusIs(absl::StatusCode::kOutOfRange,
                       "store add: add to \"n\": 4611686018427387904 + 4611686018427387904 is "
                       "past the int64 range; the value stays 4611686018427387904"));
  ASSERT_OK(c->Set("low", absl::StrCat(std::numeric_limits<int64_t>::min())));
  EXPECT_THAT(c->Add("low", -1), StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("low")));
  ASSERT_OK_AND_ASSIGN(std::string v, c->Get("n", milliseconds(10)));
  EXPECT_EQ(v, "4611686018427387904");
  ASSERT_OK_AND_ASSIGN(n, c->Add("n", -kBig));  // still serving, and exact
  EXPECT_EQ(n, 0);
}

// A probe's 6000 keys of 64 KiB took 411 MB of deepnex-store, which every
// job under a shared store's token file uses: what it holds is capped, and
// a refused write changes nothing.
TEST(StoreTest, WritesPastMaxBytesAreRefusedUntilKeysAreDeleted) {
  StoreServerOptions o;
  o.max_bytes = 100;
  auto server = StartServer(o);
  auto c = Connect(server->address());
  ASSERT_OK(c->Set("a", std::string(59, 'x')));  // 60 bytes
  const std::string full =
      "key \"b\": the store holds 60 bytes of keys and values, at most 100, and this would add "
      "41 (delete keys, or raise its max_bytes)";
  EXPECT_THAT(c->Set("b", std::string(40, 'y')), StatusIs(absl::StatusCode::kResourceExhausted,
                                                          HasSubstr(full)));
  EXPECT_THAT(c->CompareSet("b", "", std::string(40, 'y')),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr(full)));
  ASSERT_OK_AND_ASSIGN(auto present, c->Check({"b"}));
  EXPECT_THAT(present, ElementsAre(false));
  // Replacing a value with a shorter one, and filling up to the cap, fit.
  ASSERT_OK(c->Set("a", std::string(19, 'x')));  // 20 bytes
  ASSERT_OK(c->Set("b", std::string(79, 'y')));  // 100 in all
  EXPECT_THAT(c->Add("n", 1), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("\"n\"")));
  ASSERT_OK_AND_ASSIGN(bool deleted, c->Delete("b"));
  ASSERT_TRUE(deleted);
  ASSERT_OK_AND_ASSIGN(int64_t n, c->Add("n", 7));
  EXPECT_EQ(n, 7);
  // Keys are at most kMaxKeyBytes, quoted escaped and cut.
  const std::string key = "k\n" + std::string(StoreServerOptions::kMaxKeyBytes, 'k');
  EXPECT_THAT(c->Set(key, "v"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("key \"k\\n" + std::string(62, 'k') + "\"... is 4098 bytes; a "
                                 "key is at most 4096")));
  o.max_bytes = 0;
  EXPECT_THAT(StoreServer::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                               "max_bytes: 0 holds nothing"));
}

TEST(StoreTest, CompareSet) {
  auto server = StartServer();
  auto c = Connect(server->address());
  ASSERT_OK_AND_ASSIGN(std::string v, c->CompareSet("k", "", "first"));
  EXPECT_EQ(v, "first");
  ASSERT_OK_AND_ASSIGN(v, c->CompareSet("k", "", "second"));
  EXPECT_EQ(v, "first");
  ASSERT_OK_AND_ASSIGN(v, c->CompareSet("k", "first", "third"));
  EXPECT_EQ(v, "third");
  ASSERT_OK_AND_ASSIGN(v, c->CompareSet("missing", "x", "y"));
  EXPECT_EQ(v, "");
  ASSERT_OK_AND_ASSIGN(auto present, c->Check({"missing"}));
  EXPECT_THAT(present, ElementsAre(false));
}

TEST(StoreTest, PrefixesSeparateJobs) {
  auto server = StartServer();
  auto a = Connect(server->address(), "jobA");
  auto b = Connect(server->address(), "jobB");
  auto raw = Connect(server->address());
  ASSERT_OK(a->Set("k", "A"));
  ASSERT_OK(b->Set("k", "B"));
  ASSERT_OK_AND_ASSIGN(std::string v, a->Get("k"));
  EXPECT_EQ(v, "A");
  ASSERT_OK_AND_ASSIGN(v, raw->Get("jobB/k"));
  EXPECT_EQ(v, "B");
}

TEST(StoreTest, TokenAuth) {
  std::string file = testing::TempDir() + "/store_tokens";
  {
    std::ofstream out(file);
    out << "admintok root admin\njobtok alice user job7\n";
  }
  StoreServerOptions o;
  o.token_file = file;
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  EXPECT_THAT(Connect(server->address())->Set("k", "v"),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(Connect(server->address(), "", "wrong")->Set("k", "v"),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_OK(Connect(server->address(), "", "admintok")->Set("k", "v"));
  EXPECT_OK(Connect(server->address(), "job7", "jobtok")->Set("k", "v"));
  EXPECT_THAT(Connect(server->address(), "job8", "jobtok")->Set("k", "v"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("job7")));
  std::remove(file.c_str());
}

TEST(StoreTest, UnreachableStoreIsUnavailableWithinTheTimeout) {
  // A port that was free a moment ago.
  std::string address;
  {
    auto server = StartServer();
    address = server->address();
  }
  StoreClientOptions o;
  o.address = address;
  o.timeout = milliseconds(300);
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(StoreClient::Create(o),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("store at " + address + ": no connection within 300 ms"),
                             HasSubstr("Connection refused"))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(3000));
}

TEST(StoreTest, ClientStartedBeforeTheServerWaitsForIt) {
  // Pick a port, release it, then start the store on it shortly after the
  // client's first call.
  int port;
  {
    auto probe = StartServer();
    port = probe->port();
  }
  std::string address = "127.0.0.1:" + std::to_string(port);
  std::unique_ptr<StoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(milliseconds(200));
    StoreServerOptions o;
    o.address = address;
    server = StartServer(o);
  });
  auto c = Connect(address, "", "", milliseconds(60000));
  EXPECT_OK(c->Set("k", "v"));
  starter.join();
}

TEST(StoreTest, StopEndsWaitingReads) {
  auto server = StartServer();
  auto c = Connect(server->address());
  // Stopped once the Get below waits at the server: one sent after the Stop
  // would wait for the store to come back. (A 500 ms pause stood for this,
  // which a loaded machine's connection setup could outlast.)
  std::atomic<bool> waited{false};
  std::chrono::steady_clock::time_point stopped;
  std::thread stopper([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!(waited = server->waiting() == 1) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(1));
    }
    stopped = std::chrono::steady_clock::now();
    server->Stop();
  });
  EXPECT_FALSE(c->Get("never", milliseconds(20000)).ok());
  const auto returned = std::chrono::steady_clock::now();
  stopper.join();
  EXPECT_TRUE(waited) << "the Get never waited at the server";
  EXPECT_LT(returned - stopped, milliseconds(5000));
}

}  // namespace
}  // namespace deepnex::collective
