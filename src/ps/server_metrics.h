// The parameter server's metrics, served as Prometheus text and in Stats
// replies. Private to libdeepnex.
#ifndef DEEPNEX_PS_SERVER_METRICS_H_
#define DEEPNEX_PS_SERVER_METRICS_H_

#include <cstdint>
#include <vector>

#include "deepnex/metrics.h"
#include "ps/partition.h"

namespace deepnex::ps {

// The server's metrics; partitions report into it.
class ServerMetrics final : public PartitionObserver {
 public:
  explicit ServerMetrics(int num_workers);

  void RoundCompleted(double latency) override {
    rounds->Add();
    round_latency->Observe(latency);
  }
  void PullServed(int worker, uint64_t lead) override {
    staleness[worker]->Observe(static_cast<double>(lead));
  }
  void LatePush(int worker) override { late[worker]->Add(); }

  MetricsRegistry registry;
  Counter* pushes;
  Counter* pulls;
  Counter* bytes_in;
  Counter* bytes_out;
  Counter* rounds;
  Histogram* round_latency;
  Gauge* live_workers;
  Counter* lease_expiries;
  Counter* checkpoints;
  Counter* checkpoint_failures;
  Gauge* checkpoint_round;
  Gauge* pending_reply_bytes;
  Gauge* deferred_push_bytes;
  Gauge* shm_segments;
  Counter* shm_bytes;
  Gauge* bulk_connections;
  Counter* bulk_bytes;
  std::vector<Counter*> worker_pushes, late;
  std::vector<Histogram*> staleness;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_SERVER_METRICS_H_
