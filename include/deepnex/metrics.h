// Counters, gauges and histograms that deepnex's servers keep, readable in
// process and served as Prometheus text (see MetricsHttpServer).
#ifndef DEEPNEX_METRICS_H_
#define DEEPNEX_METRICS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "deepnex/status.h"

namespace deepnex {

// Label name -> value; rendered sorted by name.
using Labels = std::map<std::string, std::string>;

// A monotonically increasing count. Thread-safe.
class Counter {
 public:
  void Add(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down. Thread-safe.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into buckets with upper bounds `bounds` (ascending;
// +Inf is implicit). Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // per bucket (not cumulative); last is +Inf
    uint64_t count = 0;
    double sum = 0;
    double max = 0;
    // Estimate of quantile q in [0, 1], interpolated inside its bucket.
    double Quantile(double q) const;
  };
  Snapshot Get() const;

  // Bounds a factor `factor` apart from `start`: for latencies and sizes.
  static std::vector<double> Exponential(double start, double factor, int n);

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  double sum_ = 0, max_ = 0;
};

// Owns a server's metrics. Get* create on first use and return the same
// object for the same name and labels afterwards; the pointers stay valid as
// long as the registry. Thread-safe.
class MetricsRegistry {
 public:
  Counter* GetCounter(const std::string& name, const std::string& help,
                      const Labels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help,
                  const Labels& labels = {});
  // A counter that is kept elsewhere (a container's CPU seconds, which its
  // cgroup counts): Set it to the latest reading; it is served as a counter
  // (so `name` ends in _total), as client_golang's CounterFunc is.
  Gauge* GetCounterReading(const std::string& name, const std::string& help,
                           const Labels& labels = {});
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bounds,
                          const Labels& labels = {});

  // The Prometheus text exposition format (version 0.0.4).
  std::string PrometheusText() const;

 private:
  enum class Kind { kCounter, kGauge, kHistogram };
  struct Family {
    Kind kind;
    std::string help;
    std::map<Labels, std::unique_ptr<Counter>> counters;
    std::map<Labels, std::unique_ptr<Gauge>> gauges;
    std::map<Labels, std::unique_ptr<Histogram>> histograms;
  };
  Family* FamilyOf(const std::string& name, const std::string& help, Kind kind);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

// Serves GET /metrics (the registry's Prometheus text), and GET /healthz when
// given a health check, over plain HTTP/1.1 on its own thread, one request
// per connection, many connections at once.
// With an `authorize` check, /metrics is served only to a request whose
// Authorization header it accepts (it gets the header's value, "" without
// one): its Unauthenticated answers 401 with "WWW-Authenticate: Bearer",
// any other error 403, each with the check's message. The series name every
// user's containers and jobs, so a server with tokens passes one (kubelet's
// /metrics needs a token too); /healthz stays open, for probes.
// A client that has not sent its whole request within kRequestDeadline of
// connecting is dropped, so slow or silent clients never stall a scrape.
// Thread-safe; Stop() is idempotent.
class MetricsHttpServer {
 public:
  // Per request, not per read: a client trickling bytes is dropped too.
  static constexpr std::chrono::milliseconds kRequestDeadline{1000};

  // `address` is "HOST:PORT" (an IPv4 address, "localhost", or empty or "*"
  // for every interface); port 0 picks a free one.
  using Authorize = std::function<absl::Status(const std::string& authorization)>;

  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Create(
      const MetricsRegistry* registry, const std::string& address,
      Authorize authorize = nullptr);
  // Serves what `text` returns, called on the server's thread per request.
  // With `health`, GET /healthz answers 200 "ok" while it returns OK and 503
  // with its message otherwise (kubelet's /healthz, for probes).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Create(
      std::function<std::string()> text, const std::string& address,
      std::function<absl::Status()> health = nullptr, Authorize authorize = nullptr);
  virtual ~MetricsHttpServer() = default;
  virtual int port() const = 0;
  virtual void Stop() = 0;
};

}  // namespace deepnex

#endif  // DEEPNEX_METRICS_H_
