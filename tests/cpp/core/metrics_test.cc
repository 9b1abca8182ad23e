#include "deepnex/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{10, 0};  // no test waits on a dead server forever
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// The whole response to `request` (empty if the connection failed).
std::string Exchange(int port, const std::string& request) {
  int fd = Connect(port);
  if (fd < 0) return "";
  (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, n);
  close(fd);
  return response;
}

// The whole response to GET `path`.
std::string Get(int port, const std::string& path) {
  return Exchange(port, "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
}

TEST(MetricsTest, PrometheusText) {
  MetricsRegistry r;
  r.GetCounter("pushes_total", "Pushes.", {{"worker", "0"}})->Add(3);
  EXPECT_EQ(r.GetCounter("pushes_total", "Pushes.", {{"worker", "0"}})->value(), 3u);
  r.GetGauge("live_workers", "Live workers.")->Set(2);
  Histogram* h = r.GetHistogram("latency_seconds", "Latency.", {0.1, 1});
  h->Observe(0.05);
  h->Observe(0.5);
  h->Observe(5);
  std::string text = r.PrometheusText();
  EXPECT_THAT(text, HasSubstr("# TYPE pushes_total counter\npushes_total{worker=\"0\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("live_workers 2\n"));
  EXPECT_THAT(text, HasSubstr("latency_seconds_bucket{le=\"0.10000000000000001\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("latency_seconds_bucket{le=\"1\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("latency_seconds_bucket{le=\"+Inf\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("latency_seconds_count 3\n"));
  Histogram::Snapshot s = h->Get();
  EXPECT_EQ(s.max, 5);
  EXPECT_LE(s.Quantile(0.5), 1.0);
  EXPECT_EQ(s.Quantile(1.0), 5.0);
}

// As the exposition format escapes them: a HELP text's backslash and line
// feed (a raw one ended the line, and a scraper read the rest as a sample),
// a label value's quote too.
TEST(MetricsTest, HelpTextsAndLabelValuesAreEscaped) {
  MetricsRegistry r;
  r.GetGauge("g", "a \\ \"b\"\nc", {{"path", "C:\\x \"y\"\nz"}})->Set(1);
  EXPECT_EQ(r.PrometheusText(),
            "# HELP g a \\\\ \"b\"\\nc\n# TYPE g gauge\n"
            "g{path=\"C:\\\\x \\\"y\\\"\\nz\"} 1\n");
}

TEST(MetricsTest, HttpServerServesMetrics) {
  MetricsRegistry r;
  r.GetCounter("hits_total", "Hits.")->Add();
  auto server = MetricsHttpServer::Create(&r, "127.0.0.1:0");
  ASSERT_THAT(server.status(), IsOk());
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons((*server)->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, n);
  close(fd);
  EXPECT_THAT(response, HasSubstr("HTTP/1.1 200 OK"));
  EXPECT_THAT(response, HasSubstr("hits_total 1\n"));
  (*server)->Stop();
}

TEST(MetricsTest, HttpServerServesACallbacksText) {
  int calls = 0;
  ASSERT_OK_AND_ASSIGN(auto server, MetricsHttpServer::Create(
                                        [&calls] { return "up " + std::to_string(++calls) + "\n"; },
                                        "127.0.0.1:0"));
  EXPECT_THAT(Get(server->port(), "/metrics"), HasSubstr("\r\n\r\nup 1\n"));
  EXPECT_THAT(Get(server->port(), "/metrics?x=1"), HasSubstr("\r\n\r\nup 2\n"));
  std::string other = Get(server->port(), "/metricsfoo");
  EXPECT_THAT(other, HasSubstr("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_EQ(calls, 2);
  server->Stop();
  server->Stop();  // idempotent
}

TEST(MetricsTest, HttpServerServesHealthzOnlyWithAHealthCheck) {
  std::atomic<bool> up{true};  // read on the server's thread
  ASSERT_OK_AND_ASSIGN(auto server, MetricsHttpServer::Create(
                                        [] { return std::string("up 1\n"); }, "127.0.0.1:0",
                                        [&up] {
                                          return up ? absl::OkStatus()
                                                    : absl::UnavailableError(
                                                          "node h1: not registered");
                                        }));
  EXPECT_THAT(Get(server->port(), "/healthz"), HasSubstr("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(Get(server->port(), "/healthz"), HasSubstr("\r\n\r\nok\n"));
  up = false;
  const std::string down = Get(server->port(), "/healthz?verbose");
  EXPECT_THAT(down, HasSubstr("HTTP/1.1 503 Service Unavailable\r\n"));
  EXPECT_THAT(down, HasSubstr("\r\n\r\nnode h1: not registered\n"));
  EXPECT_THAT(Get(server->port(), "/metrics"), HasSubstr("\r\n\r\nup 1\n"));
  EXPECT_THAT(Get(server->port(), "/healthzz"),
              HasSubstr("\r\n\r\ndeepnex serves GET /metrics and GET /healthz\n"));
  server->Stop();
  // Without a check there is no /healthz.
  ASSERT_OK_AND_ASSIGN(auto plain, MetricsHttpServer::Create(
                                       [] { return std::string("up 1\n"); }, "127.0.0.1:0"));
  EXPECT_THAT(Get(plain->port(), "/healthz"), HasSubstr("HTTP/1.1 404 Not Found\r\n"));
}

// The series name every user's containers: a server with tokens gives
// /metrics only to a request whose Authorization header its check takes.
TEST(MetricsTest, HttpServerServesMetricsOnlyToWhatItsCheckAccepts) {
  std::mutex mu;
  std::vector<std::string> seen;  // the header values the check got
  ASSERT_OK_AND_ASSIGN(
      auto server,
      MetricsHttpServer::Create(
          [] { return std::string("up 1\n"); }, "127.0.0.1:0",
          [] { return absl::OkStatus(); },
          [&](const std::string& authorization) {
            std::lock_guard<std::mutex> lock(mu);
            seen.push_back(authorization);
            if (authorization.empty()) return absl::UnauthenticatedError("missing bearer token");
            if (authorization != "Bearer good") return absl::PermissionDeniedError("not yours");
            return absl::OkStatus();
          }));
  const int port = server->port();
  const std::string missing = Get(port, "/metrics");
  EXPECT_THAT(missing, HasSubstr("HTTP/1.1 401 Unauthorized\r\n"));
  EXPECT_THAT(missing, HasSubstr("\r\nWWW-Authenticate: Bearer realm=\"deepnex\"\r\n"));
  EXPECT_THAT(missing, EndsWith("\r\n\r\nmissing bearer token\n"));
  const std::string other =
      Exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bad\r\n\r\n");
  EXPECT_THAT(other, HasSubstr("HTTP/1.1 403 Forbidden\r\n"));
  EXPECT_THAT(other, EndsWith("\r\n\r\nnot yours\n"));
  // The header's name in any case, its value trimmed, bare LFs as CRLFs; a
  // line after the head's end is not a header.
  for (const std::string request :
       {"GET /metrics HTTP/1.1\r\nauthorization:   Bearer good \r\n\r\n",
        "GET /metrics HTTP/1.1\nHost: x\nAUTHORIZATION: Bearer good\n\n"}) {
    EXPECT_THAT(Exchange(port, request), EndsWith("\r\n\r\nup 1\n")) << request;
  }
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\nAuthorization: Bearer good\r\n"),
              HasSubstr("HTTP/1.1 401 Unauthorized\r\n"));
  // /healthz is for probes, asked without a token.
  EXPECT_THAT(Get(port, "/healthz"), EndsWith("\r\n\r\nok\n"));
  server->Stop();
  EXPECT_THAT(seen, ElementsAre("", "Bearer bad", "Bearer good", "Bearer good", ""));
}

// A probe's `printf 'GET /metrics HTTP/1.1\n\n' | nc` waited for ever, and
// POST was answered 404 as if the path did not exist.
TEST(MetricsTest, BareLineFeedsEndARequestAndOtherMethodsAre405) {
  ASSERT_OK_AND_ASSIGN(auto server, MetricsHttpServer::Create(
                                        [] { return std::string("up 1\n"); }, "127.0.0.1:0",
                                        [] { return absl::OkStatus(); }));
  const int port = server->port();
  const std::string up =
      "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: 5\r\n"
      "Connection: close\r\n\r\n";
  EXPECT_EQ(Exchange(port, "GET /metrics HTTP/1.1\nHost: x\n\n"), up + "up 1\n");
  EXPECT_EQ(Exchange(port, "GET /metrics HTTP/1.1\n\r\n"), up + "up 1\n");
  EXPECT_EQ(Exchange(port, "GET /healthz\n\n"),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: 3\r\n"
            "Connection: close\r\n\r\nok\n");
  // HEAD: GET's head, no body.
  EXPECT_EQ(Exchange(port, "HEAD /metrics?x HTTP/1.1\r\n\r\n"), up);
  for (const char* method : {"POST", "PUT", "DELETE", "get"}) {
    EXPECT_EQ(Exchange(port, std::string(method) + " /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
              "HTTP/1.1 405 Method Not Allowed\r\nContent-Type: text/plain; version=0.0.4\r\n"
              "Allow: GET, HEAD\r\nContent-Length: 30\r\nConnection: close\r\n\r\n"
              "/metrics answers GET and HEAD\n")
        << method;
  }
  EXPECT_THAT(Exchange(port, "POST /other HTTP/1.1\r\n\r\n"),
              HasSubstr("HTTP/1.1 404 Not Found\r\n"));
  // Still serving.
  EXPECT_THAT(Get(port, "/metrics"), HasSubstr("\r\n\r\nup 1\n"));
}

TEST(MetricsTest, HttpServerAddressErrorsNameTheAddress) {
  MetricsRegistry r;
  const std::pair<const char*, const char*> bad[] = {
      {"nocolon", "expected IPv4HOST:PORT"},
      {"127.0.0.1:x", "port \"x\" is not 0-65535"},
      {"127.0.0.1:99999", "port \"99999\" is not 0-65535"},
      {"127.0.0.1:-1", "port \"-1\" is not 0-65535"},
      {"host.example:80", "host \"host.example\" is not an IPv4 address, localhost or *"},
  };
  for (const auto& [address, why] : bad) {
    EXPECT_THAT(MetricsHttpServer::Create(&r, address),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         std::string("metrics address \"") + address + "\": " + why));
  }
  ASSERT_OK_AND_ASSIGN(auto first, MetricsHttpServer::Create(&r, "127.0.0.1:0"));
  const std::string taken = "127.0.0.1:" + std::to_string(first->port());
  EXPECT_EQ(MetricsHttpServer::Create(&r, taken).status().message(),
            "metrics: cannot listen on \"" + taken + "\": Address already in use");
}

// A client that sends a byte every 0.9 s (each read within any per-read
// timeout) is dropped 1 s after it connected, and never delays a scrape.
TEST(MetricsTest, ASlowClientIsDroppedAndStallsNoScrape) {
  MetricsRegistry r;
  r.GetCounter("hits_total", "Hits.")->Add();
  ASSERT_OK_AND_ASSIGN(auto server, MetricsHttpServer::Create(&r, "127.0.0.1:0"));
  const int slow = Connect(server->port());
  ASSERT_GE(slow, 0);
  const Clock::time_point connected = Clock::now();
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    const std::string req = "GET /metrics HTTP/1.1\r\n\r\n";
    for (size_t i = 0; i < req.size() && !done; ++i) {
      if (send(slow, &req[i], 1, MSG_NOSIGNAL) != 1) break;
      for (int t = 0; t < 9 && !done; ++t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  });
  for (int i = 0; i < 3; ++i) {
    const Clock::time_point start = Clock::now();
    EXPECT_THAT(Get(server->port(), "/metrics"), HasSubstr("hits_total 1\n"));
    EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(1500)) << "scrape " << i;
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
  }
  // Dropped without an answer.
  char buf[64];
  ssize_t n = recv(slow, buf, sizeof(buf), 0);
  const auto dropped_after = Clock::now() - connected;
  EXPECT_LE(n, 0);
  EXPECT_LT(dropped_after, std::chrono::milliseconds(2500));
  done = true;
  trickle.join();
  close(slow);
}

}  // namespace
}  // namespace deepnex
