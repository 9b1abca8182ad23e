#include "deepnex/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace deepnex {

void Gauge::Add(double v) {
  double cur = value_.load(std::memory_order_relaxed);
  while (!value_.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  ++count_;
  sum_ += v;
  max_ = count_ == 1 ? v : std::max(max_, v);
}

Histogram::Snapshot Histogram::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {bounds_, counts_, count_, sum_, max_};
}

double Histogram::Snapshot::Quantile(double q) const {
  if (count == 0) return 0;
  double rank = q * count;
  uint64_t seen = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] == 0 || seen + counts[i] < rank) {
      seen += counts[i];
      continue;
    }
    double lo = i == 0 ? 0 : bounds[i - 1];
    double hi = i < bounds.size() ? std::min(bounds[i], max) : max;
    double frac = (rank - seen) / counts[i];
    return lo + (hi - lo) * std::clamp(frac, 0.0, 1.0);
  }
  return max;
}

std::vector<double> Histogram::Exponential(double start, double factor, int n) {
  std::vector<double> b;
  for (int i = 0; i < n; ++i, start *= factor) b.push_back(start);
  return b;
}

MetricsRegistry::Family* MetricsRegistry::FamilyOf(const std::string& name,
                                                    const std::string& help,
                                                    Kind kind) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.kind = kind;
    it->second.help = help;
  }
  return &it->second;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyOf(name, help, Kind::kCounter)->counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyOf(name, help, Kind::kGauge)->gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return slot.get();
}

Gauge* MetricsRegistry::GetCounterReading(const std::string& name, const std::string& help,
                                          const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyOf(name, help, Kind::kCounter)->gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name,
                                         const std::string& help,
                                         const std::vector<double>& bounds,
                                         const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyOf(name, help, Kind::kHistogram)->histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(bounds);
  return slot.get();
}

namespace {

// The exposition format's escapes: a label value's (quoted) or a HELP
// text's, where a raw line feed would end the line and '"' stays as it is.
std::string Escape(const std::string& v, bool quoted = true) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || (quoted && c == '"')) out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string LabelText(const Labels& labels, const std::string& extra = "") {
  std::string s;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&s, s.empty() ? "" : ",", k, "=\"", Escape(v), "\"");
  }
  if (!extra.empty()) absl::StrAppend(&s, s.empty() ? "" : ",", extra);
  return s.empty() ? "" : absl::StrCat("{", s, "}");
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  return absl::StrFormat("%.17g", v);
}

}  // namespace

std::string MetricsRegistry::PrometheusText() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.kind == Kind::kCounter ? "counter"
                       : f.kind == Kind::kGauge ? "gauge"
                                                : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", Escape(f.help, /*quoted=*/false), "\n# TYPE ",
                    name, " ", type, "\n");
    for (const auto& [labels, c] : f.counters) {
      absl::StrAppend(&out, name, LabelText(labels), " ", c->value(), "\n");
    }
    for (const auto& [labels, g] : f.gauges) {
      absl::StrAppend(&out, name, LabelText(labels), " ", Number(g->value()), "\n");
    }
    for (const auto& [labels, h] : f.histograms) {
      Histogram::Snapshot s = h->Get();
      uint64_t cumulative = 0;
      for (size_t i = 0; i < s.counts.size(); ++i) {
        cumulative += s.counts[i];
        std::string le = i < s.bounds.size() ? Number(s.bounds[i]) : "+Inf";
        absl::StrAppend(&out, name, "_bucket", LabelText(labels, "le=\"" + le + "\""),
                        " ", cumulative, "\n");
      }
      absl::StrAppend(&out, name, "_sum", LabelText(labels), " ", Number(s.sum), "\n");
      absl::StrAppend(&out, name, "_count", LabelText(labels), " ", s.count, "\n");
    }
  }
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

// A client that reads its response this slowly is dropped as well.
constexpr std::chrono::milliseconds kResponseDeadline{10000};
// Requests are a line and a few headers; a longer one is not a scrape.
constexpr size_t kMaxRequestBytes = 8192;
// Connections served at once; more wait in the listen backlog.
constexpr size_t kMaxConnections = 64;

// Where a request's head ends (past its empty line), or npos while it is
// not whole. As RFC 9112 lets a server, a bare LF ends a line as CRLF does
// (curl's and Prometheus' requests use CRLF; `printf 'GET ...\n\n' | nc`
// does not).
size_t HeadEnd(const std::string& request) {
  for (size_t lf = request.find('\n'); lf != std::string::npos; lf = request.find('\n', lf + 1)) {
    if (lf + 1 < request.size() && request[lf + 1] == '\n') return lf + 2;
    if (lf + 2 < request.size() && request[lf + 1] == '\r' && request[lf + 2] == '\n') {
      return lf + 3;
    }
  }
  return std::string::npos;
}

// The value of the request head's `name` header (case-insensitive, as
// RFC 9110 has it), trimmed; "" when it has none.
std::string HeaderValue(const std::string& request, absl::string_view name) {
  size_t at = request.find('\n');
  while (at != std::string::npos && at + 1 < request.size()) {
    const size_t end = request.find('\n', at + 1);
    const absl::string_view line = absl::StripAsciiWhitespace(
        absl::string_view(request).substr(at + 1, end == std::string::npos ? end : end - at - 1));
    if (line.empty()) break;  // the head's end
    const size_t colon = line.find(':');
    if (colon != absl::string_view::npos && absl::EqualsIgnoreCase(line.substr(0, colon), name)) {
      return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
    at = end;
  }
  return "";
}

std::string Response(const std::string& request, const std::function<std::string()>& text,
                     const std::function<absl::Status()>& health,
                     const MetricsHttpServer::Authorize& authorize) {
  // The request line: METHOD TARGET VERSION; the target's query is ignored.
  const std::string line = request.substr(0, request.find_first_of("\r\n"));
  const size_t space = line.find(' ');
  const std::string method = line.substr(0, space);
  const std::string path =
      space == std::string::npos
          ? ""
          : line.substr(space + 1, line.find_first_of(" ?", space + 1) - (space + 1));
  const bool metrics = path == "/metrics", healthz = health && path == "/healthz";
  std::string status = "200 OK", body, allow;  // allow: an extra header line
  if (!metrics && !healthz) {
    status = "404 Not Found";
    body = health ? "deepnex serves GET /metrics and GET /healthz\n"
                  : "deepnex serves GET /metrics\n";
  } else if (method != "GET" && method != "HEAD") {
    status = "405 Method Not Allowed";
    allow = "Allow: GET, HEAD\r\n";
    body = absl::StrCat(path, " answers GET and HEAD\n");
  } else if (metrics) {
    const absl::Status allowed =
        authorize ? authorize(HeaderValue(request, "Authorization")) : absl::OkStatus();
    if (allowed.ok()) {
      body = text();
    } else if (allowed.code() == absl::StatusCode::kUnauthenticated) {
      status = "401 Unauthorized";
      allow = "WWW-Authenticate: Bearer realm=\"deepnex\"\r\n";
      body = absl::StrCat(allowed.message(), "\n");
    } else {
      status = "403 Forbidden";
      body = absl::StrCat(allowed.message(), "\n");
    }
  } else if (const absl::Status s = health(); s.ok()) {
    body = "ok\n";
  } else {
    status = "503 Service Unavailable";
    body = absl::StrCat(s.message(), "\n");
  }
  std::string head =
      absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\n", allow,
                   "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  // HEAD: what GET would answer, without the body.
  return method == "HEAD" ? head : head + body;
}

// One thread polls the listening socket and every open connection
// (non-blocking), each connection with its own deadline.
class HttpServerImpl final : public MetricsHttpServer {
 public:
  HttpServerImpl(std::function<std::string()> text, std::function<absl::Status()> health,
                 Authorize authorize, int fd, int port)
      : text_(std::move(text)), health_(std::move(health)), authorize_(std::move(authorize)),
        fd_(fd), port_(port) {
    if (pipe2(wake_, O_CLOEXEC) != 0) wake_[0] = wake_[1] = -1;
    thread_ = std::thread([this] { Serve(); });
  }
  ~HttpServerImpl() override { Stop(); }
  int port() const override { return port_; }
  void Stop() override {
    if (stopped_.exchange(true)) return;
    if (wake_[1] >= 0) (void)!write(wake_[1], "x", 1);
    thread_.join();
    close(fd_);
    if (wake_[0] >= 0) close(wake_[0]);
    if (wake_[1] >= 0) close(wake_[1]);
  }

 private:
  struct Connection {
    int fd;
    Clock::time_point deadline;
    std::string request, response;  // response: empty until the request is whole
    size_t sent = 0;
  };

  void Serve() {
    std::vector<Connection> conns;
    std::vector<pollfd> fds;
    while (!stopped_) {
      const Clock::time_point now = Clock::now();
      auto wait = std::chrono::milliseconds(1000);  // rechecks stopped_ without a pipe
      fds.assign({{wake_[0], POLLIN, 0},
                  {fd_, static_cast<short>(conns.size() < kMaxConnections ? POLLIN : 0), 0}});
      for (const Connection& c : conns) {
        fds.push_back({c.fd, static_cast<short>(c.response.empty() ? POLLIN : POLLOUT), 0});
        wait = std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(
                                  std::max(c.deadline - now, Clock::duration::zero())));
      }
      if (poll(fds.data(), fds.size(), static_cast<int>(wait.count())) < 0 && errno != EINTR) {
        break;
      }
      for (size_t i = 0; i < conns.size(); ++i) {
        if (fds[i + 2].revents != 0 && !Progress(conns[i])) Drop(&conns[i]);
      }
      const Clock::time_point after = Clock::now();
      for (Connection& c : conns) {
        if (c.fd >= 0 && after >= c.deadline) Drop(&c);
      }
      conns.erase(std::remove_if(conns.begin(), conns.end(),
                                 [](const Connection& c) { return c.fd < 0; }),
                  conns.end());
      while ((fds[1].revents & POLLIN) && conns.size() < kMaxConnections) {
        const int c = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) break;
        conns.push_back({c, after + kRequestDeadline, "", "", 0});
      }
    }
    for (Connection& c : conns) Drop(&c);
  }

  // Reads or writes what the connection allows now; false once it is done
  // (answered, closed by the peer, or broken).
  bool Progress(Connection& c) {
    if (c.response.empty()) {
      char buf[2048];
      const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      if (n == 0) return false;
      c.request.append(buf, static_cast<size_t>(n));
      if (HeadEnd(c.request) == std::string::npos) {
        return c.request.size() <= kMaxRequestBytes;
      }
      c.response = Response(c.request, text_, health_, authorize_);
      c.deadline = Clock::now() + kResponseDeadline;
    }
    const ssize_t n =
        send(c.fd, c.response.data() + c.sent, c.response.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.sent += static_cast<size_t>(n);
    return c.sent < c.response.size();
  }

  static void Drop(Connection* c) {
    close(c->fd);
    c->fd = -1;
  }

  const std::function<std::string()> text_;
  const std::function<absl::Status()> health_;
  const Authorize authorize_;
  const int fd_;
  const int port_;
  int wake_[2];
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(
    const MetricsRegistry* registry, const std::string& address, Authorize authorize) {
  return Create([registry] { return registry->PrometheusText(); }, address, nullptr,
                std::move(authorize));
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(
    std::function<std::string()> text, const std::string& address,
    std::function<absl::Status()> health, Authorize authorize) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address \"", address, "\": ", why));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("expected IPv4HOST:PORT");
  std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  int port = -1;
  if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
    return bad(absl::StrCat("port \"", port_text, "\" is not 0-65535"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "*" || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (host == "localhost") {
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return bad(absl::StrCat("host \"", host, "\" is not an IPv4 address, localhost or *"));
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 64) != 0) {
    std::string why = std::strerror(errno);
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on \"", address, "\": ", why));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<MetricsHttpServer>(
      new HttpServerImpl(std::move(text), std::move(health), std::move(authorize), fd,
                         ntohs(addr.sin_port)));
}

}  // namespace deepnex
