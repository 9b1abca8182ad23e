// One rank of benchmarks/allreduce_bench: times deepnex allreduces of each
// size and prints, from rank 0, "SIZE_BYTES MEDIAN_SECONDS TRANSPORT" per
// size, then "barrier SECONDS TRANSPORT" (median of rounds of 500 barriers).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "deepnex/collective/communicator.h"

using deepnex::DType;
using deepnex::TensorView;
using deepnex::collective::Communicator;
using deepnex::collective::CommunicatorOptions;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  CommunicatorOptions o;
  std::vector<uint64_t> sizes;
  double min_time = 0.3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i], v = argv[i + 1];
    if (f == "--store") o.store_address = v;
    else if (f == "--rank") o.rank = std::atoi(v.c_str());
    else if (f == "--world") o.world_size = std::atoi(v.c_str());
    else if (f == "--prefix") o.prefix = v;
    else if (f == "--transport") o.transport = *deepnex::collective::ParseTransport(v);
    else if (f == "--min-time") min_time = std::atof(v.c_str());
    else if (f == "--connections") o.connections_per_peer = std::atoi(v.c_str());
    else if (f == "--channels") o.shm_channels = std::atoi(v.c_str());
    else if (f == "--shm-buffer") o.shm_buffer_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (f == "--sizes") {
      for (char* p = std::strtok(v.data(), ","); p; p = std::strtok(nullptr, ","))
        sizes.push_back(std::strtoull(p, nullptr, 10));
    } else {
      std::fprintf(stderr, "allreduce_bench_worker: unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  o.timeout = std::chrono::milliseconds(120000);
  auto comm = Communicator::Create(o);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", o.rank, comm.status().ToString().c_str());
    return 1;
  }
  Communicator& c = **comm;
  for (uint64_t bytes : sizes) {
    size_t n = bytes / 4;
    std::vector<float> x(n, 1.0f);
    TensorView t(x.data(), DType::kFloat32, {int64_t(n)});
    // Warm-up, then enough timed runs to fill min_time (the same count on
    // every rank: rank 0 decides and broadcasts it).
    for (int i = 0; i < 2; ++i) c.AllReduce(t).IgnoreError();
    auto start = Clock::now();
    if (!c.AllReduce(t).ok()) return 1;
    double one = std::chrono::duration<double>(Clock::now() - start).count();
    int64_t iters = std::clamp<int64_t>(static_cast<int64_t>(min_time / std::max(one, 1e-6)), 5, 200);
    if (!c.Broadcast(TensorView(&iters, DType::kInt64, {1}), 0).ok()) return 1;
    std::vector<double> times;
    for (int64_t i = 0; i < iters; ++i) {
      if (!c.Barrier().ok()) return 1;
      auto t0 = Clock::now();
      absl::Status s = c.AllReduce(t);
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      if (!s.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", o.rank, s.ToString().c_str());
        return 1;
      }
    }
    // Correctness: integer-valued inputs sum exactly.
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>((i % 1000) + o.rank);
    if (!c.AllReduce(t).ok()) return 1;
    const int w = o.world_size;
    for (size_t i = 0; i < n; ++i) {
      if (x[i] != static_cast<float>(w * (i % 1000) + w * (w - 1) / 2)) {
        std::fprintf(stderr, "rank %d: WRONG RESULT at element %zu of %llu bytes\n", o.rank, i,
                     static_cast<unsigned long long>(bytes));
        return 1;
      }
    }
    std::sort(times.begin(), times.end());
    if (o.rank == 0) {
      std::printf("%llu %.9f %s\n", static_cast<unsigned long long>(bytes), times[times.size() / 2],
                  c.transport().c_str());
      std::fflush(stdout);
    }
  }
  // Barrier latency: rounds of back-to-back barriers, median per barrier.
  constexpr int kRounds = 7, kPerRound = 500;
  std::vector<double> rounds;
  for (int i = 0; i < 10; ++i) c.Barrier().IgnoreError();
  for (int k = 0; k < kRounds; ++k) {
    auto t0 = Clock::now();
    for (int i = 0; i < kPerRound; ++i) {
      if (!c.Barrier().ok()) return 1;
    }
    rounds.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / kPerRound);
  }
  std::sort(rounds.begin(), rounds.end());
  if (o.rank == 0) std::printf("barrier %.9f %s\n", rounds[kRounds / 2], c.transport().c_str());
  return 0;
}
