// The webhook notifier against a receiver in the test (127.0.0.1, a port the
// kernel picks): signatures, order per job, retries and drops, the outbox
// across a restart, and bad input. deepnex-central's wiring (node events,
// kill -9) is tested from Python (tests/python/test_notify.py).
#include "notify/notifier.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gpu/ledger.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::notify {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::TempDir;
using ::deepnex::test::WaitFor;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

struct Request {
  std::map<std::string, std::string> headers;  // names lowercased
  std::string body;
  nlohmann::json event;
};

// An HTTP server that records each POST and answers it with the status
// `answer` gives (200 by default), one connection at a time. Bound at
// construction; connections are refused until Listen().
class Receiver {
 public:
  explicit Receiver(bool listen = true) {
    fd_ = test::BindLoopback(&port_);
    if (listen) Listen();
  }
  ~Receiver() {
    stopping_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    if (thread_.joinable()) thread_.join();
  }

  void Listen() {
    EXPECT_EQ(listen(fd_, 64), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/hook"; }
  void set_answer(std::function<int(const Request&)> answer) {
    std::lock_guard<std::mutex> lock(mu_);
    answer_ = std::move(answer);
  }
  std::vector<Request> requests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  size_t count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_.size();
  }

 private:
  void Serve() {
    while (!stopping_) {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) break;
      Handle(c);
      close(c);
    }
  }

  void Handle(int c) {
    size_t header_end;
    const std::string data = test::ReadHttpRequest(c, &header_end);
    if (header_end == std::string::npos) return;
    Request r;
    std::vector<std::string> lines = absl::StrSplit(data.substr(0, header_end), "\r\n");
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == std::string::npos) continue;
      r.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
          std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
    }
    size_t length = 0;
    EXPECT_TRUE(absl::SimpleAtoi(r.headers["content-length"], &length)) << data;
    r.body = data.substr(header_end + 4, length);
    r.event = nlohmann::json::parse(r.body, nullptr, false);
    int status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(r);
      status = answer_ ? answer_(r) : 200;
    }
    const std::string reply =
        "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Length: 0\r\n\r\n";
    send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
  }

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::function<int(const Request&)> answer_;
  std::vector<Request> requests_;
  std::thread thread_;
};

// The receivers here listen on 127.0.0.1: job URLs may reach them.
NotifierOptions Fast() {
  NotifierOptions o;
  o.retry_initial = 10ms;
  o.retry_max = 40ms;
  o.timeout = 5000ms;
  o.allow_private_job_urls = true;
  return o;
}

Event JobEvent(const std::string& job, const char* kind, int n) {
  Event e;
  e.kind = kind;
  e.user = "alice";
  e.job = job;
  e.data = {{"n", n}};
  return e;
}

// The outbox on a full disk: the event published then fails, and once the
// disk has room again the next one is queued and sent, without a restart
// (every later event failed with the first write's error until one).
class NotifierFullDisk : public test::FullDiskTest {};

TEST_F(NotifierFullDisk, AnEventOnceTheDiskHasRoomAgainIsSent) {
  Receiver r;
  NotifierOptions o = Fast();
  o.state_dir = mnt_ + "/notify";
  o.user_urls["alice"] = {r.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  Fill();
  Event lost = JobEvent("j1", "job.queued", 1);
  lost.data["pad"] = std::string(16 << 10, 'x');  // more than a page's slack
  EXPECT_THAT(n->Publish(lost), StatusIs(absl::StatusCode::kInternal,
                                         HasSubstr("No space left on device")));
  Free();
  ASSERT_THAT(n->Publish(JobEvent("j1", "job.started", 2)), IsOk());
  ASSERT_TRUE(WaitFor([&] { return r.count() == 1; }, 30s, "the event sent"));
  EXPECT_EQ(r.requests()[0].event["kind"], "job.started");
}

TEST(NotifySign, IsRfc4231HmacSha256) {
  // RFC 4231, test case 2.
  EXPECT_EQ(Sign("Jefe", "what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Notifier, SignsEachEventAndKeepsEachJobsOrder) {
  Receiver receiver;
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {receiver.url()};
  o.secrets = {{"alice", "alice-secret"}, {"bob", "bob-secret"}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  constexpr int kPerJob = 20;
  for (int i = 0; i < kPerJob; ++i) {
    ASSERT_THAT(n->Publish(JobEvent("j1", kJobStarted, i)), IsOk());
    ASSERT_THAT(n->Publish(JobEvent("j2", kJobWorkerRestarted, i)), IsOk());
  }
  ASSERT_TRUE(WaitFor([&] { return receiver.count() == 2 * kPerJob; }, 30s, "40 events"));
  // The receiver records a POST before it answers; the notifier counts it
  // delivered once it has read that answer.
  ASSERT_TRUE(WaitFor([&] { return n->stats().delivered == 2u * kPerJob; }, 30s,
                      "40 deliveries counted"));
  std::map<std::string, int> next;
  std::set<std::string> ids;
  for (const Request& r : receiver.requests()) {
    EXPECT_EQ(r.headers.at("x-deepnex-signature"), Sign("alice-secret", r.body));
    EXPECT_NE(r.headers.at("x-deepnex-signature"), Sign("bob-secret", r.body));
    EXPECT_EQ(r.headers.at("content-type"), "application/json");
    EXPECT_EQ(r.headers.at("x-deepnex-event-id"), r.event["id"]);
    EXPECT_TRUE(ids.insert(r.event["id"].get<std::string>()).second) << r.body;
    EXPECT_EQ(r.event["user"], "alice");
    EXPECT_EQ(r.event["kind"], r.event["job"] == "j1" ? kJobStarted : kJobWorkerRestarted);
    // Each job's events in the order published.
    EXPECT_EQ(r.event["data"]["n"], next[r.event["job"]]++) << r.body;
  }
  EXPECT_EQ(next["j1"], kPerJob);
  EXPECT_EQ(next["j2"], kPerJob);
  EXPECT_EQ(n->stats().delivered, 2u * kPerJob);
  EXPECT_EQ(n->stats().pending, 0u);
}

TEST(Notifier, TheBodyHasTheEventsFields) {
  Receiver receiver;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(Fast()));
  Event e = JobEvent("j1", kJobFailed, 7);
  e.id = "event-1";
  e.time_ms = 1700000000123;
  e.data = {{"exit_code", 3}};
  e.urls = {receiver.url()};  // the job's own URL: alice has no default
  ASSERT_THAT(n->Publish(e), IsOk());
  ASSERT_TRUE(WaitFor([&] { return receiver.count() == 1; }, 30s, "the event"));
  Request r = receiver.requests()[0];
  EXPECT_EQ(r.event, nlohmann::json::parse(R"({"id": "event-1", "kind": "job.failed",
      "user": "alice", "job": "j1", "node": "", "time": "2023-11-14T22:13:20.123Z",
      "time_ms": 1700000000123, "data": {"exit_code": 3}})"));
  // No secret for alice: no signature.
  EXPECT_EQ(r.headers.count("x-deepnex-signature"), 0u);
}

// Any user gives a job's own URLs: by default they reach public addresses
// only, checked against the address connected to (a receiver on 127.0.0.1
// stands for the services beside central). An admin's URL to the same
// receiver is sent.
TEST(Notifier, AJobsOwnUrlReachesNoLoopbackOrPrivateAddressUnlessAllowed) {
  Receiver receiver;
  NotifierOptions o = Fast();
  o.allow_private_job_urls = false;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
    Event e = JobEvent("j1", kJobStarted, 0);
    e.urls = {receiver.url()};
    ASSERT_THAT(n->Publish(e), IsOk());
    ASSERT_TRUE(WaitFor([&] { return n->stats().dropped == 1; }, 30s, "the refusal"));
    EXPECT_EQ(n->stats().retried, 0u);  // refused for good, not retried
  }
  EXPECT_EQ(receiver.count(), 0u);
  o.user_urls["alice"] = {receiver.url()};
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
    Event e = JobEvent("j1", kJobStarted, 0);
    e.urls = {receiver.url()};  // the job gives it too: it is an admin's
    ASSERT_THAT(n->Publish(e), IsOk());
    ASSERT_TRUE(WaitFor([&] { return receiver.count() == 1; }, 30s, "the event"));
  }
}

// An admin's URL lets a job reach a private address only for the user it
// was given to: bob's job that named alice's default URL, or the node
// events', had bob's events POSTed to the private service behind it.
TEST(Notifier, AnotherUsersOrTheAdminsUrlTakesNoJobToAPrivateAddress) {
  Receiver alices, admins;
  NotifierOptions o = Fast();
  o.allow_private_job_urls = false;
  o.user_urls["alice"] = {alices.url()};
  o.admin_urls = {admins.url()};
  EXPECT_THAT(CheckJobUrl(o, "alice", alices.url()), IsOk());
  for (const std::string& url : {alices.url(), admins.url()}) {
    EXPECT_THAT(CheckJobUrl(o, "bob", url), StatusIs(absl::StatusCode::kPermissionDenied));
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  Event e = JobEvent("j1", kJobStarted, 0);
  e.user = "bob";
  e.urls = {alices.url(), admins.url()};
  ASSERT_THAT(n->Publish(e), IsOk());
  ASSERT_TRUE(WaitFor([&] { return n->stats().dropped == 2; }, 30s, "both refused"));
  EXPECT_EQ(alices.count() + admins.count(), 0u);
}

TEST(NotifyOptions, AJobsUrlIsCheckedAgainstWhatItsHostResolvesTo) {
  NotifierOptions o;
  const std::string rest =
      "; deepnex-central posts a job's own webhooks only to public addresses (its "
      "--notify-allow-private lets them reach others)";
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://127.0.0.1:8080/hook"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "notify URL \"http://127.0.0.1:8080/hook\": 127.0.0.1 is a loopback "
                       "address" + rest));
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://169.254.169.254/latest/meta-data"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("169.254.169.254 is a link-local address;")));
  EXPECT_THAT(CheckJobUrl(o, "alice", "https://10.77.0.11:443/x"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("a private address")));
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://[::1]:80/"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("::1 is a loopback")));
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://localhost:1/"),  // a name: what it resolves to
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("is a loopback")));
  EXPECT_THAT(CheckJobUrl(o, "alice", "ftp://example.com/x"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://8.8.8.8/hook"), IsOk());
  o.user_urls["alice"] = {"http://127.0.0.1:8080/hook"};  // an admin's
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://127.0.0.1:8080/hook"), IsOk());
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://127.0.0.1:8081/hook"),
              StatusIs(absl::StatusCode::kPermissionDenied));
  o.allow_private_job_urls = true;
  EXPECT_THAT(CheckJobUrl(o, "alice", "http://127.0.0.1:8081/hook"), IsOk());
}

TEST(Notifier, NodeEventsGoToAdminsSignedWithTheAdminsSecret) {
  Receiver admin, user;
  NotifierOptions o = Fast();
  o.admin_urls = {admin.url()};
  o.user_urls["alice"] = {user.url()};
  o.secrets = {{"alice", "alice-secret"}, {"admin", "admin-secret"}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  for (const char* kind : {kNodeNotReady, kNodeLost, kNodeReady}) {
    Event e;
    e.kind = kind;
    e.node = "h1";
    ASSERT_THAT(n->Publish(e), IsOk());
  }
  ASSERT_TRUE(WaitFor([&] { return admin.count() == 3; }, 30s, "3 node events"));
  std::vector<std::string> kinds;
  for (const Request& r : admin.requests()) {
    kinds.push_back(r.event["kind"]);
    EXPECT_EQ(r.event["node"], "h1");
    EXPECT_EQ(r.headers.at("x-deepnex-signature"), Sign("admin-secret", r.body));
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{kNodeNotReady, kNodeLost, kNodeReady}));
  EXPECT_EQ(user.count(), 0u);
}

TEST(Notifier, RetriesAfter500And429ThenDelivers) {
  Receiver receiver;
  int calls = 0;
  receiver.set_answer([&](const Request&) {
    ++calls;
    return calls == 1 ? 500 : calls == 2 ? 429 : 200;
  });
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {receiver.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobStarted, 1)), IsOk());
  ASSERT_TRUE(WaitFor([&] { return n->stats().delivered == 2; }, 30s, "both delivered"));
  std::vector<Request> r = receiver.requests();
  ASSERT_EQ(r.size(), 4u);
  // The first event three times (the same bytes and id), then the second:
  // the job's next event waits for the one before.
  EXPECT_EQ(r[0].body, r[1].body);
  EXPECT_EQ(r[1].body, r[2].body);
  EXPECT_EQ(r[2].event["kind"], kJobQueued);
  EXPECT_EQ(r[3].event["kind"], kJobStarted);
  EXPECT_EQ(n->stats().retried, 2u);
}

TEST(Notifier, RetriesWhileNoOneListens) {
  Receiver receiver(/*listen=*/false);
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {receiver.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  ASSERT_TRUE(WaitFor([&] { return n->stats().retried >= 3; }, 30s, "3 refused attempts"));
  receiver.Listen();
  ASSERT_TRUE(WaitFor([&] { return receiver.count() == 1; }, 30s, "the event"));
  EXPECT_TRUE(WaitFor([&] { return n->stats().delivered == 1; }, 30s, "delivered"));
}

TEST(Notifier, DropsWhatTheReceiverRefusesAndGoesOn) {
  Receiver receiver;
  receiver.set_answer([](const Request& r) { return r.event["data"]["n"] == 0 ? 404 : 200; });
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {receiver.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobStarted, 1)), IsOk());
  ASSERT_TRUE(WaitFor([&] { return n->stats().delivered == 1; }, 30s, "the second"));
  EXPECT_EQ(receiver.count(), 2u);  // the first once, not retried
  EXPECT_EQ(n->stats().dropped, 1u);
  EXPECT_EQ(n->stats().retried, 0u);
}

// A receiver that takes each POST and answers 200 with a body that never
// ends: `bytes` every `every`, until the test ends. A hostile job's URL
// does so; each held a delivery thread, and the bytes central's memory,
// for as long as they came.
class EndlessAnswer {
 public:
  EndlessAnswer(size_t bytes, std::chrono::milliseconds every) : bytes_(bytes), every_(every) {
    fd_ = test::BindLoopback(&port_);
    EXPECT_EQ(listen(fd_, 64), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~EndlessAnswer() {
    stopping_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/hook"; }
  int posts() const { return posts_; }

 private:
  void Serve() {
    while (!stopping_) {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) break;
      size_t header_end;
      test::ReadHttpRequest(c, &header_end);
      ++posts_;
      const std::string head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n";
      const std::string chunk(bytes_, 'x');
      bool open = send(c, head.data(), head.size(), MSG_NOSIGNAL) > 0;
      while (open && !stopping_) {
        open = send(c, chunk.data(), chunk.size(), MSG_NOSIGNAL) > 0;
        std::this_thread::sleep_for(every_);
      }
      close(c);
    }
  }

  const size_t bytes_;
  const std::chrono::milliseconds every_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> posts_{0};
  std::thread thread_;
};

// One delivery thread, taken by a receiver that drips its answer (a byte
// now and then, each within the read timeout): the POST ends at
// NotifierOptions::timeout and is retried, and another user's event goes
// out meanwhile. It held the thread for as long as the bytes came, so one
// user's URL stopped every user's events.
TEST(Notifier, AnAnswerThatNeverEndsIsCutAtTheTimeout) {
  EndlessAnswer endless(1, 200ms);
  Receiver receiver;
  NotifierOptions o = Fast();
  o.timeout = 1000ms;
  o.threads = 1;
  o.user_urls["mallory"] = {endless.url()};
  o.user_urls["alice"] = {receiver.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  Event e = JobEvent("j1", kJobQueued, 0);
  e.user = "mallory";
  ASSERT_THAT(n->Publish(e), IsOk());
  ASSERT_TRUE(WaitFor([&] { return endless.posts() == 1; }, 30s, "mallory's POST"));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  EXPECT_TRUE(WaitFor([&] { return receiver.count() >= 1; }, 30s, "alice's event"));
}

// Two delivery threads and a user whose 8 URLs take each POST and never
// answer (a second each, the timeout), retried at once: another user's
// event still goes out, on the first thread that comes free. Its queue
// came after theirs in key order (127.0.0.1 before localhost), and each
// thread took one of theirs again, so it never went.
TEST(Notifier, AUserWhoseUrlsHangHoldsNotEveryThread) {
  int port = 0;
  const int silent = test::BindLoopback(&port);  // takes connections, never answers
  ASSERT_EQ(listen(silent, 256), 0);
  Receiver receiver;
  NotifierOptions o = Fast();
  o.timeout = 1000ms;
  o.threads = 2;
  o.user_urls["mallory"] = {"http://127.0.0.1:" + std::to_string(port) + "/hook"};
  const std::string alices = "http://localhost:" + receiver.url().substr(17);
  o.user_urls["alice"] = {alices};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  for (int j = 0; j < 8; ++j) {
    Event e = JobEvent("j" + std::to_string(j), kJobQueued, 0);
    e.user = "mallory";
    ASSERT_THAT(n->Publish(e), IsOk());
  }
  ASSERT_TRUE(WaitFor([&] { return n->stats().retried >= 2; }, 30s, "mallory's POSTs"));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  EXPECT_TRUE(WaitFor([&] { return receiver.count() == 1; }, 10s, "alice's event"));
  n->Shutdown();
  close(silent);
}

// A 200 whose body does not end is delivered: what the notifier reads of
// an answer is its status and the start of its body. It read the body
// whole, into memory, for as long as it came.
TEST(Notifier, AnEndlessAnswerIsReadNoFurtherThanItsStart) {
  EndlessAnswer endless(64 << 10, 10ms);
  NotifierOptions o = Fast();
  o.timeout = 5000ms;
  o.user_urls["alice"] = {endless.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  EXPECT_TRUE(WaitFor([&] { return n->stats().delivered == 1; }, 20s, "the event delivered"));
  EXPECT_EQ(n->stats().retried, 0u);
}

// A user whose URL never takes an event has at most
// max_waiting_bytes_per_user of them waiting: later ones are dropped, and
// other users' go on. They all waited, in memory and in the outbox.
TEST(Notifier, AUsersEventsWaitingForTheirReceiverAreBounded) {
  Receiver silent(/*listen=*/false), receiver;
  TempDir dir;
  NotifierOptions o = Fast();
  o.state_dir = dir.path();
  o.user_urls["mallory"] = {silent.url()};
  o.user_urls["alice"] = {receiver.url()};
  o.max_waiting_bytes_per_user = 4096;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  for (int i = 0; i < 10; ++i) {
    Event e = JobEvent("j1", kJobProgress, i);
    e.user = "mallory";
    e.data["pad"] = std::string(1000, 'x');
    ASSERT_THAT(n->Publish(e), IsOk());
  }
  EXPECT_EQ(n->stats().pending, 3u);  // each body is over 1 KB
  EXPECT_EQ(n->stats().dropped, 7u);
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  EXPECT_TRUE(WaitFor([&] { return receiver.count() == 1; }, 30s, "alice's event"));
}

// A webhook's path is often its secret (Slack's, Discord's): the log lines
// of a retry and of a drop show the URL's scheme, host and port only. They
// showed it whole, twice, to whoever reads central's log.
TEST(Notifier, LogLinesShowNoUrlsPath) {
  Receiver receiver;
  receiver.set_answer([](const Request& r) { return r.event["data"]["n"] == 0 ? 503 : 404; });
  const std::string url = receiver.url() + "/T0/B0/s3cr3t";
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {url};
  testing::internal::CaptureStderr();
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
    ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
    ASSERT_THAT(n->Publish(JobEvent("j2", kJobQueued, 1)), IsOk());
    EXPECT_TRUE(WaitFor([&] { return n->stats().dropped == 1 && n->stats().retried >= 1; }, 30s,
                        "a retry and a drop"));
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("http://127.0.0.1:" + url.substr(17, url.find('/', 17) - 17) +
                             "/...: POST"));
  EXPECT_THAT(log, HasSubstr(" dropped: POST http://127.0.0.1:"));
  EXPECT_THAT(log, Not(HasSubstr("s3cr3t")));
}

TEST(Notifier, DropsAnEventOlderThanMaxAge) {
  Receiver receiver;
  receiver.set_answer([](const Request&) { return 503; });
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {receiver.url()};
  // Its age is checked before each attempt: the first must come within it
  // to be seen retried. 200 ms was too short on a loaded machine, where the
  // first attempt came 0.5 s after the Publish and the event was dropped
  // untried.
  o.max_age = 2000ms;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  ASSERT_THAT(n->Publish(JobEvent("j1", kJobQueued, 0)), IsOk());
  ASSERT_TRUE(WaitFor([&] { return n->stats().dropped == 1; }, 30s, "dropped as too old"));
  EXPECT_GE(receiver.count(), 1u);
  EXPECT_EQ(n->stats().pending, 0u);
}

TEST(Notifier, TheOutboxKeepsEventsUntilAReceiverTakesThem) {
  TempDir dir;
  Receiver receiver(/*listen=*/false);
  NotifierOptions o = Fast();
  o.state_dir = dir.path() + "/outbox";
  o.user_urls["alice"] = {receiver.url()};
  std::vector<std::string> ids;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
    for (int i = 0; i < 5; ++i) {
      Event e = JobEvent(i < 3 ? "j1" : "j2", kJobStarted, i);
      e.id = "id-" + std::to_string(i);
      ids.push_back(e.id);
      ASSERT_THAT(n->Publish(e), IsOk());
    }
    ASSERT_TRUE(WaitFor([&] { return n->stats().retried >= 1; }, 30s, "a refused attempt"));
    EXPECT_EQ(n->stats().pending, 5u);
  }
  receiver.Listen();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  EXPECT_EQ(n->stats().recovered, 5u);
  ASSERT_TRUE(WaitFor([&] { return n->stats().delivered == 5; }, 30s, "5 events"));
  std::vector<std::string> got;
  std::map<std::string, int> next = {{"j1", 0}, {"j2", 3}};
  for (const Request& r : receiver.requests()) {
    got.push_back(r.headers.at("x-deepnex-event-id"));
    EXPECT_EQ(r.event["data"]["n"], next[r.event["job"]]++) << r.body;
  }
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, ids);
  n.reset();
  // Delivered means gone from the outbox: nothing again.
  ASSERT_OK_AND_ASSIGN(n, Notifier::Create(o));
  EXPECT_EQ(n->stats().recovered, 0u);
}

// An outbox event to a URL the check refuses now (libcurl never took it:
// a space), left by an older central: dropped with a log line, and the
// others still go. It refused to start, for good (DataLoss).
TEST(Notifier, AnOutboxEventToAUrlRefusedNowIsDroppedNotFatal) {
  TempDir dir;
  Receiver receiver;
  NotifierOptions o = Fast();
  o.state_dir = dir.path();
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<gpu::Ledger> ledger,
                         gpu::Ledger::Open(dir.path(), {}, [](const std::string&) {
                           return absl::OkStatus();
                         }));
    for (const auto& [seq, url] : {std::pair<int, std::string>{1, "http://127.0.0.1:1/a b"},
                                   {2, receiver.url()}}) {
      ASSERT_THAT(ledger->Sync(ledger->Append(
                      nlohmann::json{{"op", "add"}, {"seq", seq}, {"group", "alice/j1"},
                                     {"url", url}, {"id", "id-" + std::to_string(seq)},
                                     {"time_ms", 1}, {"body", "{}"}}
                          .dump())),
                  IsOk());
    }
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  EXPECT_EQ(n->stats().recovered, 1u);
  EXPECT_EQ(n->stats().dropped, 1u);
  ASSERT_TRUE(WaitFor([&] { return n->stats().delivered == 1; }, 30s, "the good event"));
  EXPECT_EQ(receiver.requests().at(0).headers.at("x-deepnex-event-id"), "id-2");
  n.reset();
  ASSERT_OK_AND_ASSIGN(n, Notifier::Create(o));
  EXPECT_EQ(n->stats().recovered, 0u);
}

TEST(Notifier, AnOutboxIsOneNotifiers) {
  TempDir dir;
  NotifierOptions o = Fast();
  o.state_dir = dir.path();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  EXPECT_THAT(Notifier::Create(o), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(Notifier, CompactsItsOutbox) {
  TempDir dir;
  Receiver receiver;
  NotifierOptions o = Fast();
  o.state_dir = dir.path();
  o.user_urls["alice"] = {receiver.url()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  // Past the 1024 records that trigger a snapshot.
  for (int i = 0; i < 600; ++i) ASSERT_THAT(n->Publish(JobEvent("j1", kJobStarted, i)), IsOk());
  ASSERT_TRUE(WaitFor([&] { return n->stats().delivered == 600; }, 60s, "600 events"));
  n.reset();
  auto log = gpu::Ledger::ReadLog(dir.path());
  ASSERT_THAT(log.status(), IsOk());
  EXPECT_LT(log->size(), 600u);
  ASSERT_OK_AND_ASSIGN(n, Notifier::Create(o));
  EXPECT_EQ(n->stats().recovered, 0u);
}

TEST(Notifier, RefusesBadEvents) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(Fast()));
  Event e = JobEvent("j1", "job.exploded", 0);
  EXPECT_THAT(n->Publish(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("event kind \"job.exploded\" is not one of")));
  e = JobEvent("", kJobQueued, 0);
  EXPECT_THAT(n->Publish(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("a job.queued event needs a user and a job")));
  e = Event{};
  e.kind = kNodeLost;
  EXPECT_THAT(n->Publish(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("a node.lost event needs a node")));
  e = JobEvent("j1", kJobQueued, 0);
  e.urls = {"ftp://example.com/x"};
  EXPECT_THAT(n->Publish(e),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("notify URL of job j1: URL \"ftp://example.com/x\" is not "
                                 "http://HOST[:PORT][/PATH]")));
  e.urls = {"http://127.0.0.1:99999/x"};
  EXPECT_THAT(n->Publish(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("bad port \"99999\"")));
  EXPECT_EQ(n->stats().published, 0u);
}

// A URL that libcurl refuses (a space, CR LF) is refused as the job gives
// it, naming it. It was taken, and each POST failed before it went out and
// was retried for ever.
TEST(NotifyOptions, AUrlLibcurlRefusesIsRefusedNamingIt) {
  NotifierOptions o = Fast();
  o.user_urls["alice"] = {"http://127.0.0.1:9/hook"};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Notifier> n, Notifier::Create(o));
  for (const std::string url : {"http://127.0.0.1:9/a b", "http://127.0.0.1:9/x\r\nX-Evil: 1"}) {
    EXPECT_THAT(CheckJobUrl(o, "alice", url),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("endpoint \"" + absl::CEscape(url) + "\": ")));
    Event e = JobEvent("j1", kJobQueued, 0);
    e.urls = {url};
    EXPECT_THAT(n->Publish(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("notify URL of job j1: URL \"" + url)));
  }
  EXPECT_EQ(n->stats().published, 0u);
}

TEST(NotifyOptions, NameTheBadValue) {
  NotifierOptions o;
  EXPECT_THAT(AddUserUrl("alice=http://127.0.0.1:8080/hook", &o), IsOk());
  EXPECT_EQ(o.user_urls["alice"], std::vector<std::string>{"http://127.0.0.1:8080/hook"});
  EXPECT_THAT(AddUserUrl("http://127.0.0.1/hook", &o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"http://127.0.0.1/hook\" is not USER=URL")));
  EXPECT_THAT(AddUserUrl("bob=127.0.0.1:80", &o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"bob=127.0.0.1:80\": URL \"127.0.0.1:80\" is not http://")));
  o.admin_urls = {"http://:80/x"};
  EXPECT_THAT(Notifier::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("admin notify URL \"http://:80/x\"")));

  TempDir dir;
  const std::string secrets = dir.path() + "/secrets";
  std::ofstream(secrets) << "# who signs\nalice s3cret\n\nbob b0b extra\n";
  EXPECT_THAT(LoadSecretsFile(secrets, &o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("notify secret file " + secrets +
                                 " line 4: expected \"USER SECRET\", got 3 fields")));
  EXPECT_THAT(LoadSecretsFile(secrets, &o), StatusIs(absl::StatusCode::kInvalidArgument,
                                                     Not(HasSubstr("b0b"))));
  std::ofstream(secrets) << "alice s3cret\nalice other\n";
  EXPECT_THAT(LoadSecretsFile(secrets, &o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 2: user alice has a secret on line 1")));
  std::ofstream(secrets) << "alice s3cret  # the comment\nbob b0b\n";
  NotifierOptions good;
  EXPECT_THAT(LoadSecretsFile(secrets, &good), IsOk());
  EXPECT_EQ(good.secrets, (std::map<std::string, std::string>{{"alice", "s3cret"}, {"bob", "b0b"}}));
  EXPECT_THAT(LoadSecretsFile(dir.path() + "/none", &good),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("notify secret file")));

  const std::string urls = dir.path() + "/urls";
  std::ofstream(urls) << "alice http://127.0.0.1:1/a\nbob htp://x\n";
  EXPECT_THAT(LoadUrlsFile(urls, &good),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("notify file " + urls +
                                 " line 2: expected \"USER URL\": URL \"htp://x\" is not")));
}

}  // namespace
}  // namespace deepnex::notify
