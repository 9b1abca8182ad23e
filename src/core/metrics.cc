#include "deepnex/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <thread>

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

std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
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
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", type, "\n");
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

class HttpServerImpl final : public MetricsHttpServer {
 public:
  HttpServerImpl(const MetricsRegistry* registry, int fd, int port)
      : registry_(registry), fd_(fd), port_(port) {
    if (pipe(wake_) != 0) wake_[0] = wake_[1] = -1;
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
  void Serve() {
    while (!stopped_) {
      pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      if (poll(fds, 2, 1000) <= 0 || (fds[1].revents & POLLIN)) continue;
      int conn = accept(fd_, nullptr, nullptr);
      if (conn < 0) continue;
      Answer(conn);
      close(conn);
    }
  }

  // One request per connection; a slow or silent client is dropped after a
  // second so that it cannot stall the exporter.
  void Answer(int conn) {
    timeval tv{1, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    std::string request;
    char buf[1024];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
      ssize_t n = recv(conn, buf, sizeof(buf), 0);
      if (n <= 0) return;
      request.append(buf, n);
    }
    std::string status = "200 OK", body;
    if (request.rfind("GET /metrics", 0) == 0) {
      body = registry_->PrometheusText();
    } else {
      status = "404 Not Found";
      body = "deepnex serves /metrics\n";
    }
    std::string response = absl::StrCat(
        "HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\n",
        "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
    for (size_t sent = 0; sent < response.size();) {
      ssize_t n = send(conn, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += n;
    }
  }

  const MetricsRegistry* registry_;
  const int fd_;
  const int port_;
  int wake_[2];
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(
    const MetricsRegistry* registry, const std::string& address) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\" is not host:port"));
  }
  std::string host = address.substr(0, colon);
  int port = std::atoi(address.c_str() + colon + 1);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (host == "localhost") {
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": host must be an IPv4 address"));
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 16) != 0) {
    std::string why = std::strerror(errno);
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on \"", address, "\": ", why));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<MetricsHttpServer>(
      new HttpServerImpl(registry, fd, ntohs(addr.sin_port)));
}

}  // namespace deepnex
