#include "ps/server_metrics.h"

#include <string>

namespace deepnex::ps {

ServerMetrics::ServerMetrics(int num_workers)
    : pushes(registry.GetCounter("deepnex_ps_pushes_total", "Push requests applied.")),
      pulls(registry.GetCounter("deepnex_ps_pulls_total", "Pull requests served.")),
      bytes_in(registry.GetCounter("deepnex_ps_bytes_in_total", "Tensor bytes received.")),
      bytes_out(registry.GetCounter("deepnex_ps_bytes_out_total", "Tensor bytes sent.")),
      rounds(registry.GetCounter("deepnex_ps_rounds_total",
                                 "Rounds completed, summed over partitions.")),
      round_latency(registry.GetHistogram("deepnex_ps_round_latency_seconds",
                                          "From a round's first push to its update, per partition.",
                                          Histogram::Exponential(1e-4, 2, 20))),
      live_workers(registry.GetGauge("deepnex_ps_live_workers", "Workers holding a lease.")),
      lease_expiries(
          registry.GetCounter("deepnex_ps_lease_expiries_total", "Worker leases that expired.")),
      checkpoints(registry.GetCounter("deepnex_ps_checkpoints_total", "Checkpoints written.")),
      checkpoint_failures(registry.GetCounter(
          "deepnex_ps_checkpoint_failures_total",
          "Checkpoints that could not be written (a full disk); the previous one stays.")),
      checkpoint_round(registry.GetGauge("deepnex_ps_checkpoint_round",
                                         "The round of the last checkpoint written.")),
      pending_reply_bytes(registry.GetGauge(
          "deepnex_ps_pending_reply_bytes",
          "Pull reply bytes held for clients: waiting pulls and unread replies.")),
      deferred_push_bytes(
          registry.GetGauge("deepnex_ps_deferred_push_bytes",
                            "Bytes of pushes kept until an earlier push or round arrives.")),
      shm_segments(registry.GetGauge("deepnex_ps_shm_segments",
                                     "Shared-memory segments held for clients on this host.")),
      shm_bytes(registry.GetCounter(
          "deepnex_ps_shm_bytes_total",
          "Tensor bytes moved through shared memory instead of TCP, both ways.")),
      bulk_connections(registry.GetGauge(
          "deepnex_ps_bulk_connections",
          "Bulk TCP connections open to clients (pushes and pulls beside gRPC).")),
      bulk_bytes(registry.GetCounter(
          "deepnex_ps_bulk_bytes_total",
          "Request and reply bytes moved over bulk TCP connections, both ways.")) {
  for (int w = 0; w < num_workers; ++w) {
    Labels l{{"worker", std::to_string(w)}};
    worker_pushes.push_back(
        registry.GetCounter("deepnex_ps_worker_pushes_total", "Push requests per worker.", l));
    late.push_back(registry.GetCounter("deepnex_ps_late_pushes_total",
                                       "Pushes for rounds completed without them.", l));
    staleness.push_back(registry.GetHistogram(
        "deepnex_ps_staleness_rounds",
        "Rounds a worker was ahead of the applied version when its pull was served.",
        {0, 1, 2, 3, 4, 8, 16, 32}, l));
  }
}

}  // namespace deepnex::ps
