// ps_soak: a bounded soak of the parameter server under worker crashes.
//
// 8 worker processes train 64 tensors of mixed sizes for 5,000 rounds in
// ssp(1) mode against an in-process server; every 500 rounds one worker
// kills itself with SIGKILL right after a round, stays dead past its lease
// (so the rounds shrink), and is restarted, rejoining at the current round.
// At the end every value must equal what the acknowledged pushes imply
// (constant integer gradients per worker, the `sum` optimizer), and the
// program prints rounds/s, round latency p50/p99 and the lease expiries.
//
//   ps_soak [--rounds 5000] [--kill-every 500] [--workers 8] [--max-seconds 900]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTensors = 64;

// Mixed sizes, 1 element to 16 Ki elements; about 1 MB in all.
int64_t TensorSize(int k) {
  static const int64_t kSizes[] = {1, 7, 100, 1000, 4096, 10000, 16384, 333};
  return kSizes[k % 8];
}

float Gradient(int worker) { return static_cast<float>(worker + 1); }

deepnex::TensorView View(std::vector<float>& v) {
  return deepnex::TensorView(v.data(), deepnex::DType::kFloat32,
                             {static_cast<int64_t>(v.size())});
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "ps_soak: %s\n", what.c_str());
  std::exit(1);
}

// One worker process: rounds from where the job is to `rounds`; appends
// "<worker> <acknowledged pushes>" to `log` before it exits or dies.
int RunWorker(const std::string& server, int worker, int rounds, int die_at,
              const std::string& log) {
  deepnex::ps::ClientOptions options;
  options.servers = {server};
  options.worker_id = worker;
  options.timeout = std::chrono::seconds(120);
  auto client = deepnex::ps::Client::Create(options);
  if (!client.ok()) Fail(std::string(client.status().message()));
  std::vector<std::vector<float>> params(kTensors), grads(kTensors);
  std::vector<deepnex::ps::NamedTensor> p, g;
  for (int k = 0; k < kTensors; ++k) {
    params[k].assign(TensorSize(k), 0.0f);
    grads[k].assign(TensorSize(k), Gradient(worker));
  }
  for (int k = 0; k < kTensors; ++k) {
    p.push_back({"t" + std::to_string(k), View(params[k])});
    g.push_back({"t" + std::to_string(k), View(grads[k])});
  }
  if (auto s = (*client)->Init(p); !s.ok()) Fail(std::string(s.message()));
  auto info = (*client)->Describe({"t0"});
  if (!info.ok()) Fail(std::string(info.status().message()));
  uint64_t acked = 0;
  auto record = [&] {
    std::ofstream(log, std::ios::app) << worker << " " << acked << "\n";
  };
  for (int t = static_cast<int>((*info)[0].version) + 1; t <= rounds; ++t) {
    if (auto s = (*client)->PushPull(g, p); !s.ok()) {
      record();
      Fail("worker " + std::to_string(worker) + ": " + std::string(s.message()));
    }
    ++acked;
    if (t == die_at) {
      record();
      raise(SIGKILL);
    }
  }
  record();
  (*client)->Close().IgnoreError();
  return 0;
}

pid_t Spawn(const char* self, const std::string& server, int worker, int rounds, int die_at,
            const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    execl(self, self, "--worker", std::to_string(worker).c_str(), "--server", server.c_str(),
          "--rounds", std::to_string(rounds).c_str(), "--die-at",
          std::to_string(die_at).c_str(), "--log", log.c_str(), (char*)nullptr);
    _exit(127);
  }
  return pid;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"--rounds", "5000"}, {"--kill-every", "500"}, {"--workers", "8"},
      {"--max-seconds", "900"}, {"--lease", "1.0"}, {"--worker", ""}, {"--server", ""},
      {"--die-at", "0"}, {"--log", ""}};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!flags.count(argv[i])) Fail(std::string("unknown flag ") + argv[i]);
    flags[argv[i]] = argv[i + 1];
  }
  const int rounds = std::atoi(flags["--rounds"].c_str());
  if (!flags["--worker"].empty()) {
    return RunWorker(flags["--server"], std::atoi(flags["--worker"].c_str()), rounds,
                     std::atoi(flags["--die-at"].c_str()), flags["--log"]);
  }

  const int workers = std::atoi(flags["--workers"].c_str());
  const int kill_every = std::atoi(flags["--kill-every"].c_str());
  const double lease = std::atof(flags["--lease"].c_str());
  const auto limit = std::chrono::seconds(std::atoi(flags["--max-seconds"].c_str()));
  deepnex::ps::ServerOptions so;
  so.mode = deepnex::ps::Mode::kSsp;
  so.staleness = 1;
  so.num_workers = workers;
  so.optimizer.kind = deepnex::ps::OptimizerKind::kSum;
  so.reduction = deepnex::ps::Reduction::kSum;
  so.lease_timeout = std::chrono::milliseconds(static_cast<int>(lease * 1000));
  auto server = deepnex::ps::Server::Create(so);
  if (!server.ok()) Fail(std::string(server.status().message()));
  std::string address = (*server)->address();
  char log_template[] = "/tmp/ps_soak_XXXXXX";
  int fd = mkstemp(log_template);
  close(fd);
  const std::string log = log_template;

  // Kill k (at round k * kill_every) falls on worker 1 + (k - 1) % (workers - 1);
  // worker 0 is never killed, so the job always has a live worker.
  auto next_kill = [&](int worker, int from_round) {
    for (int r = kill_every; r < rounds; r += kill_every) {
      int victim = 1 + (r / kill_every - 1) % (workers - 1);
      if (victim == worker && r >= from_round) return r;
    }
    return 0;
  };
  std::printf("ps_soak: %d workers, %d tensors, %d rounds, ssp(1), lease %.1f s, "
              "a worker killed every %d rounds\n", workers, kTensors, rounds, lease, kill_every);
  std::fflush(stdout);
  const auto start = Clock::now();
  std::map<pid_t, int> running;
  for (int w = 0; w < workers; ++w) {
    running[Spawn(argv[0], address, w, rounds, next_kill(w, 1), log)] = w;
  }
  int kills = 0;
  deepnex::ps::ClientOptions observer;
  observer.servers = {address};
  observer.worker_id = -1;
  auto watch = deepnex::ps::Client::Create(observer);
  if (!watch.ok()) Fail(std::string(watch.status().message()));
  while (!running.empty()) {
    if (Clock::now() - start > limit) {
      for (auto& [pid, w] : running) kill(pid, SIGKILL);
      Fail("did not finish within --max-seconds");
    }
    int status = 0;
    pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    int w = running[pid];
    running.erase(pid);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
      ++kills;
      // Stay dead past the lease, so the rounds shrink, then rejoin.
      std::this_thread::sleep_for(std::chrono::duration<double>(lease * 1.3));
      auto info = (*watch)->Describe({"t0"});
      int from = info.ok() ? static_cast<int>((*info)[0].version) + 1 : 1;
      std::printf("  round %5d: worker %d killed and restarted (kill %d)\n", from, w, kills);
      std::fflush(stdout);
      running[Spawn(argv[0], address, w, rounds, next_kill(w, from + 1), log)] = w;
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      for (auto& [p, v] : running) kill(p, SIGKILL);
      Fail("worker " + std::to_string(w) + " failed");
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  // Every value must be what the acknowledged pushes imply.
  std::map<int, uint64_t> acked;
  std::ifstream in(log);
  for (int w; in >> w;) {
    uint64_t n;
    in >> n;
    acked[w] += n;
  }
  std::remove(log.c_str());
  double expected = 0;
  for (auto& [w, n] : acked) expected += Gradient(w) * static_cast<double>(n);
  int bad = 0;
  for (int k = 0; k < kTensors; ++k) {
    std::vector<float> got(TensorSize(k));
    deepnex::TensorView view = View(got);
    if (auto s = (*watch)->Pull({{"t" + std::to_string(k), view}}); !s.ok()) {
      Fail(std::string(s.message()));
    }
    for (float v : got) bad += v != static_cast<float>(expected);
  }
  auto stats = (*watch)->Stats();
  if (!stats.ok()) Fail(std::string(stats.status().message()));
  const auto& st = (*stats)[0];
  std::printf("\n| rounds | seconds | rounds/s | round latency p50 | p99 | kills | lease "
              "expiries | values |\n|---|---|---|---|---|---|---|---|\n");
  std::printf("| %llu | %.1f | %.1f | %.2f ms | %.2f ms | %d | %llu | %s |\n",
              static_cast<unsigned long long>(st.min_version), seconds,
              st.min_version / seconds, st.round_latency_p50 * 1e3,
              st.round_latency_p99 * 1e3, kills,
              static_cast<unsigned long long>(st.lease_expiries),
              bad == 0 ? "exact" : "WRONG");
  if (bad != 0) {
    std::printf("ps_soak: %d values differ from %.0f\n", bad, expected);
    return 1;
  }
  (*server)->Stop();
  return 0;
}
