#include "deepnex/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::testing::HasSubstr;

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

}  // namespace
}  // namespace deepnex
