// ps_bench_worker: one deepnex parameter-server worker for benchmarks/ps_bench.
//
// Connects to the servers given by --server, initializes a --mb MiB (or
// --bytes bytes) float32 model cut into --partitions tensors "p0".."pN-1" (16 x 4 MiB by default, so
// one push to a server is one batched request), then runs rounds of
// push+pull: PushPull(grads, params) by default (the same shape of step as the
// torch.distributed.rpc peer, one call that pushes and pulls back), or
// Push(grads) then Pull(params) with --op push-pull.
//
// Timing, as in tcp_ceiling and torch_rpc_ps.py: --warmup rounds, then, with
// --sync-start, the worker prints {"event":"warm"} on stdout and waits for a
// line on stdin (the driver releases all workers at once), then --rounds timed
// rounds. The JSON line at the end carries every timed round time; the driver
// takes, per round, the longest over workers and the median over rounds.
// cpu_s is this process's CPU time (all threads) over the timed rounds.
//
// Gradients are zeros (the driver runs SGD with lr 0), so parameters stay
// finite whatever the server's mode.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/ps/client.h"
#include "deepnex/tensor.h"

#include "bench_util.h"

namespace {

using deepnex::bench::Median;
using deepnex::bench::ProcessCpuSeconds;

using Clock = std::chrono::steady_clock;

struct Flags {
  std::vector<std::string> servers;
  int worker_id = 0;
  int workers = 1;
  uint64_t bytes = 64ull << 20;  // --mb N sets N MiB
  int partitions = 16;
  int rounds = 20;
  int warmup = 3;
  std::string op = "pushpull";  // or "push-pull"
  std::string mode = "async";   // the server's mode, reported only
  int connections = 0;          // 0: ClientOptions' default
  uint64_t request_mb = 0;      // 0: ClientOptions' default
  int timeout_s = 120;
  bool sync_start = false;
};

[[noreturn]] void Usage(const char* why = nullptr) {
  if (why) std::fprintf(stderr, "ps_bench_worker: %s\n", why);
  std::fprintf(
      stderr,
      "usage: ps_bench_worker --server HOST:PORT[,HOST:PORT...] "
      "[--worker-id N] [--workers N] [--mb N | --bytes N] [--partitions N] [--rounds N] "
      "[--warmup N] [--op pushpull|push-pull] [--mode async|sync|ssp] "
      "[--connections N] [--request-mb N] [--timeout-s N] [--sync-start]\n");
  std::exit(2);
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto str = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    auto num = [&]() -> long long {
      std::string v = str();
      char* end = nullptr;
      long long n = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 0)
        Usage(("bad value for " + a + ": " + v).c_str());
      return n;
    };
    if (a == "--server") f.servers = Split(str(), ',');
    else if (a == "--worker-id") f.worker_id = static_cast<int>(num());
    else if (a == "--workers") f.workers = static_cast<int>(num());
    else if (a == "--mb") f.bytes = static_cast<uint64_t>(num()) << 20;
    else if (a == "--bytes") f.bytes = num();
    else if (a == "--partitions") f.partitions = static_cast<int>(num());
    else if (a == "--rounds") f.rounds = static_cast<int>(num());
    else if (a == "--warmup") f.warmup = static_cast<int>(num());
    else if (a == "--op") f.op = str();
    else if (a == "--mode") f.mode = str();
    else if (a == "--connections") f.connections = static_cast<int>(num());
    else if (a == "--request-mb") f.request_mb = num();
    else if (a == "--timeout-s") f.timeout_s = static_cast<int>(num());
    else if (a == "--sync-start") f.sync_start = true;
    else Usage(("unknown flag " + a).c_str());
  }
  if (f.servers.empty() || f.servers[0].empty()) Usage("--server is required");
  if (f.op != "pushpull" && f.op != "push-pull") Usage("--op: pushpull or push-pull");
  if (f.mode != "async" && f.mode != "sync" && f.mode != "ssp")
    Usage("--mode: async, sync or ssp");
  if (f.rounds < 1 || f.partitions < 1 || f.bytes < 4 || f.timeout_s < 1)
    Usage("--rounds, --partitions, --mb/--bytes and --timeout-s must be positive");
  if (f.bytes % (4ull * f.partitions) != 0)
    Usage("--mb/--bytes of float32 must split evenly into --partitions");
  return f;
}

[[noreturn]] void Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "ps_bench_worker %s: %s\n", what.c_str(),
               s.ToString().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  // Keep glibc from mapping and unmapping multi-MiB buffers every round
  // (ENGINES.md: thousands of page faults per round otherwise). 32 MiB is the
  // largest threshold glibc accepts.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);

  const Flags f = ParseFlags(argc, argv);
  const int64_t numel = static_cast<int64_t>(f.bytes / 4 / f.partitions);
  const uint64_t model_bytes = f.bytes;

  deepnex::ps::ClientOptions options;
  options.servers = f.servers;
  options.worker_id = f.worker_id;
  options.timeout = std::chrono::milliseconds(1000LL * f.timeout_s);
  if (f.connections > 0) options.connections_per_server = f.connections;
  if (f.request_mb > 0) options.request_bytes = f.request_mb << 20;
  auto client_or = deepnex::ps::Client::Create(options);
  if (!client_or.ok()) Fail("Client::Create", client_or.status());
  std::unique_ptr<deepnex::ps::Client> client = std::move(client_or).value();

  // Zero-filled, so every page is touched before the timed rounds.
  std::vector<std::vector<float>> params(f.partitions,
                                         std::vector<float>(numel, 0.0f));
  std::vector<std::vector<float>> grads(f.partitions,
                                        std::vector<float>(numel, 0.0f));
  std::vector<deepnex::ps::NamedTensor> param_views, grad_views;
  for (int i = 0; i < f.partitions; ++i) {
    const std::string key = "p" + std::to_string(i);
    param_views.push_back(
        {key, deepnex::TensorView(params[i].data(), deepnex::DType::kFloat32,
                                  {numel})});
    grad_views.push_back(
        {key, deepnex::TensorView(grads[i].data(), deepnex::DType::kFloat32,
                                  {numel})});
  }

  if (absl::Status s = client->Init(param_views); !s.ok()) Fail("Init", s);

  auto round = [&]() -> absl::Status {
    if (f.op == "pushpull") return client->PushPull(grad_views, param_views);
    DEEPNEX_RETURN_IF_ERROR(client->Push(grad_views));
    return client->Pull(param_views);
  };

  std::vector<double> times;
  double cpu_start_s = 0;
  const int total = f.warmup + f.rounds;
  for (int r = 0; r < total; ++r) {
    if (r == f.warmup && f.sync_start) {
      std::printf("{\"event\":\"warm\",\"worker_id\":%d}\n", f.worker_id);
      std::fflush(stdout);
      std::string line;
      if (!std::getline(std::cin, line)) {
        std::fprintf(stderr, "ps_bench_worker %d: stdin closed before go\n",
                     f.worker_id);
        return 1;
      }
    }
    if (r == f.warmup) cpu_start_s = ProcessCpuSeconds();
    auto t0 = Clock::now();
    if (absl::Status s = round(); !s.ok())
      Fail("round " + std::to_string(r + 1), s);
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r >= f.warmup) times.push_back(dt);
  }

  const double cpu_s = ProcessCpuSeconds() - cpu_start_s;

  // Zero gradients with lr 0 leave the zero-initialized model unchanged;
  // anything else means the pull did not deliver what the server holds.
  for (int i = 0; i < f.partitions; ++i) {
    if (std::any_of(params[i].begin(), params[i].end(),
                    [](float v) { return v != 0.0f; })) {
      std::fprintf(stderr,
                   "ps_bench_worker %d: note: pulled p%d is not all zeros "
                   "(server lr not 0, or another writer)\n",
                   f.worker_id, i);
      break;
    }
  }
  if (absl::Status s = client->Close(); !s.ok()) Fail("Close", s);

  const double median_s = Median(times);
  auto [mn, mx] = std::minmax_element(times.begin(), times.end());
  std::string rounds_json;
  for (size_t k = 0; k < times.size(); ++k) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.6f", k ? "," : "", times[k]);
    rounds_json += buf;
  }
  std::printf(
      "{\"bench\":\"deepnex_ps_worker\",\"worker_id\":%d,\"workers\":%d,"
      "\"mode\":\"%s\",\"op\":\"%s\",\"bytes_per_worker\":%llu,"
      "\"partitions\":%d,\"warmup\":%d,\"rounds\":%d,\"median_s\":%.6f,"
      "\"min_s\":%.6f,\"max_s\":%.6f,\"goodput_gbps\":%.4f,\"cpu_s\":%.6f,"
      "\"round_s\":[%s]}\n",
      f.worker_id, f.workers, f.mode.c_str(), f.op.c_str(),
      static_cast<unsigned long long>(model_bytes), f.partitions, f.warmup,
      f.rounds, median_s, *mn, *mx, 2.0 * model_bytes / median_s / 1e9, cpu_s,
      rounds_json.c_str());
  std::fflush(stdout);
  return 0;
}
