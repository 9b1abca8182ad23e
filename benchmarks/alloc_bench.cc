// alloc_bench: throughput of deepnex::gpu::Allocator and the fragmentation of
// its best-fit placement against a first-fit baseline, in one run.
//
//   alloc_bench [--nodes 1000] [--gpus 8] [--seconds 1.5] [--reps 3]
//               [--window 32] [--only NAME] [--dir D]
//
// Cluster: --nodes nodes of --gpus 80GiB GPUs, half exclusive, half shared.
// Throughput: allocate+release pairs per second against a cluster kept
// about half full, for a mix of exclusive (1-8 GPUs) and shared (1-2 GPUs,
// 4-40GiB) requests; in memory, and with the ledger on (fsync per
// acknowledged call, group commit across threads; and without fsync, which
// survives a process crash but not a machine crash); and through
// deepnex-central over loopback, 8 client threads. Each thread makes
// blocking calls, or keeps --window steps in flight through the
// asynchronous calls (AllocateGangAsync/ReleaseAsync), as a scheduler
// serving many jobs would. Median of --reps runs. --only runs the cases
// whose name contains NAME ("fragmentation" is one).
// Fragmentation: the same random stream of shared requests and releases fed
// to the allocator (best fit) and to a first-fit baseline; then refusals,
// wholly free GPUs and the free memory stranded on partly used GPUs.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"

#include "bench_util.h"

using namespace deepnex::gpu;  // NOLINT
using Clock = std::chrono::steady_clock;

namespace {

using deepnex::bench::Median;

constexpr uint64_t kGiB = uint64_t{1} << 30;

struct Flags {
  int nodes = 1000;
  int gpus = 8;
  double seconds = 1.5;
  int reps = 3;
  std::string dir = "/tmp/deepnex_alloc_bench";
  int window = 32;
  std::string only;  // run only the cases whose name contains this
};

Node MakeNode(int i, int gpus, Mode mode) {
  Node n;
  n.name = "node" + std::to_string(i);
  for (int g = 0; g < gpus; ++g) {
    Gpu gpu;
    gpu.memory = 80 * kGiB;
    gpu.switch_id = g / 4;
    n.gpus.push_back(gpu);
  }
  n.cpus = 128;
  n.memory = 1024 * kGiB;
  n.mode = mode;
  return n;
}

std::vector<Request> RequestPool(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  const int excl_gpus[] = {1, 1, 1, 2, 2, 4, 8};
  const uint64_t shared_mem[] = {4, 8, 10, 16, 20, 24, 40};
  std::vector<Request> out;
  for (size_t i = 0; i < n; ++i) {
    Request r;
    r.user = "user" + std::to_string(rng() % 16);
    if (rng() % 2) {
      r.mode = Mode::kExclusive;
      r.gpus = excl_gpus[rng() % 7];
      r.cpus = 1 + static_cast<int>(rng() % 8);
      r.memory = (1 + rng() % 32) * kGiB;
    } else {
      r.mode = Mode::kShared;
      r.gpus = rng() % 5 == 0 ? 2 : 1;
      r.gpu_memory = shared_mem[rng() % 7] * kGiB;
      r.cpus = 1 + static_cast<int>(rng() % 4);
      r.memory = (1 + rng() % 16) * kGiB;
    }
    out.push_back(r);
  }
  return out;
}

std::unique_ptr<Allocator> Build(const Flags& f, const std::string& state_dir, bool fsync) {
  AllocatorOptions o;
  o.state_dir = state_dir;
  o.fsync = fsync;
  auto a = Allocator::Create(o);
  if (!a.ok()) {
    std::fprintf(stderr, "alloc_bench: %s\n", a.status().ToString().c_str());
    std::exit(1);
  }
  for (int i = 0; i < f.nodes; ++i) {
    auto s = (*a)->AddNode(MakeNode(i, f.gpus, i % 2 ? Mode::kShared : Mode::kExclusive));
    if (!s.ok()) {
      std::fprintf(stderr, "alloc_bench: %s\n", s.ToString().c_str());
      std::exit(1);
    }
  }
  return std::move(a).value();
}

struct Throughput {
  double pairs_per_s;
  double refused;  // fraction of allocations refused (cluster full)
};

// Each thread keeps its own live allocations; every step allocates one
// request (wait=false) and releases one live allocation at random.
// `make_api(t)` gives thread t the object to call (the allocator itself, or
// a CentralClient of its own). window 0: blocking calls, one step at a time;
// window W: the asynchronous calls, W steps in flight per thread.
template <class MakeApi>
Throughput Measure(MakeApi make_api, int threads, int window, double seconds, uint64_t seed) {
  std::atomic<bool> stop{false}, go{false};
  std::atomic<int> filled{0};
  std::atomic<uint64_t> pairs{0}, refused{0};
  std::vector<std::thread> ts;
  AllocateOptions nowait;
  nowait.wait = false;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      auto api = make_api(t);
      auto& alloc = *api;
      std::vector<Request> pool = RequestPool(seed * 131 + t, 4096);
      std::mt19937_64 rng(seed + t);
      std::vector<std::string> live;
      // Fill this thread's share of about half the cluster first.
      const size_t target = 4000 / threads;
      size_t k = 0;
      while (live.size() < target) {
        auto a = alloc.Allocate(pool[k++ % pool.size()], nowait);
        if (a.ok()) live.push_back(a->id);
        if (k > target * 4) break;
      }
      ++filled;
      while (!go.load()) std::this_thread::yield();
      // Under mu once the callbacks run, on threads of the API's.
      std::mutex mu;
      std::condition_variable cv;
      int in_flight = 0;
      auto take_live = [&]() -> std::string {  // REQUIRES: mu held or no callbacks
        if (live.empty()) return "";
        size_t i = rng() % live.size();
        std::string id = std::move(live[i]);
        live[i] = std::move(live.back());
        live.pop_back();
        return id;
      };
      while (!stop.load(std::memory_order_relaxed)) {
        const Request& r = pool[k++ % pool.size()];
        if (window == 0) {
          auto a = alloc.Allocate(r, nowait);
          if (a.ok()) {
            live.push_back(std::move(a->id));
          } else {
            refused.fetch_add(1, std::memory_order_relaxed);
          }
          std::string id = take_live();
          if (!id.empty()) (void)alloc.Release(id);
          pairs.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        {
          std::unique_lock<std::mutex> lock(mu);
          // Refill in bursts: wake once half the window has drained.
          if (in_flight >= window) cv.wait(lock, [&] { return in_flight <= window / 2; });
          ++in_flight;
        }
        alloc.AllocateGangAsync(r, nowait, [&](absl::StatusOr<std::vector<Allocation>> a) {
          std::string id;
          {
            std::lock_guard<std::mutex> lock(mu);
            if (a.ok()) {
              live.push_back(std::move(a->front().id));
            } else {
              refused.fetch_add(1, std::memory_order_relaxed);
            }
            id = take_live();
          }
          alloc.ReleaseAsync(id, [&](absl::Status) {
            pairs.fetch_add(1, std::memory_order_relaxed);
            std::lock_guard<std::mutex> lock(mu);
            if (--in_flight <= window / 2) cv.notify_all();
          });
        });
      }
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return in_flight == 0; });
      }
      for (const auto& id : live) (void)alloc.Release(id);
    });
  }
  // Measure only once every thread has filled its share.
  while (filled.load() < threads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto t0 = Clock::now();
  go = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  // What completed until now counts; what is in flight finishes uncounted.
  const double done = static_cast<double>(pairs.load());
  const double no = static_cast<double>(refused.load());
  double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  stop = true;
  for (auto& t : ts) t.join();
  return {done / elapsed, done > 0 ? no / done : 0};
}

// ---- fragmentation: first-fit baseline on the same shared cluster

struct FirstFit {
  std::vector<std::vector<uint64_t>> free;  // per node, per GPU
  struct Grant {
    int node;
    std::vector<int> gpus;
    uint64_t mem;
  };
  FirstFit(int nodes, int gpus) : free(nodes, std::vector<uint64_t>(gpus, 80 * kGiB)) {}
  bool Allocate(int count, uint64_t mem, Grant* g) {
    for (size_t n = 0; n < free.size(); ++n) {
      std::vector<int> pick;
      for (size_t i = 0; i < free[n].size() && static_cast<int>(pick.size()) < count; ++i) {
        if (free[n][i] >= mem) pick.push_back(static_cast<int>(i));
      }
      if (static_cast<int>(pick.size()) == count) {
        for (int i : pick) free[n][i] -= mem;
        *g = {static_cast<int>(n), pick, mem};
        return true;
      }
    }
    return false;
  }
  void Release(const Grant& g) {
    for (int i : g.gpus) free[g.node][i] += g.mem;
  }
};

struct Frag {
  uint64_t refused = 0, requests = 0;
  uint64_t free_total = 0, stranded = 0;  // stranded: free memory on partly used GPUs
  int whole_free = 0, gpus = 0;
  uint64_t fits40 = 0;                    // 40GiB single-GPU requests that still fit
};

void Tally(const std::vector<uint64_t>& free_per_gpu, Frag* f) {
  for (uint64_t fr : free_per_gpu) {
    ++f->gpus;
    f->free_total += fr;
    if (fr == 80 * kGiB) {
      ++f->whole_free;
    } else {
      f->stranded += fr;
    }
    f->fits40 += fr / (40 * kGiB);
  }
}

void Fragmentation(const Flags& flags, Frag* best, Frag* first) {
  const int nodes = std::max(1, flags.nodes / 2);
  auto made = Allocator::Create();
  Allocator& alloc = **made;
  for (int i = 0; i < nodes; ++i) (void)alloc.AddNode(MakeNode(i, flags.gpus, Mode::kShared));
  FirstFit ff(nodes, flags.gpus);
  std::mt19937_64 rng(7);
  const uint64_t sizes[] = {4, 6, 8, 10, 12, 16, 20, 24, 30, 40};
  std::vector<std::string> live_b;
  std::vector<FirstFit::Grant> live_f;
  AllocateOptions nowait;
  nowait.wait = false;
  const uint64_t capacity = uint64_t(nodes) * flags.gpus * 80 * kGiB;
  uint64_t used_b = 0, used_f = 0;
  std::vector<uint64_t> mem_b;
  const int ops = 40 * nodes * flags.gpus;
  for (int op = 0; op < ops; ++op) {
    // Churn around 85% of the memory: allocate while below, else release.
    const bool grow = rng() % 100 < 60;
    const uint64_t mem = sizes[rng() % 10] * kGiB;
    const int count = rng() % 6 == 0 ? 2 : 1;
    const uint64_t pick = rng();
    if (grow) {
      if (used_b < capacity * 85 / 100) {
        ++best->requests;
        Request r;
        r.user = "u";
        r.mode = Mode::kShared;
        r.gpus = count;
        r.gpu_memory = mem;
        auto a = alloc.Allocate(r, nowait);
        if (a.ok()) {
          live_b.push_back(a->id);
          mem_b.push_back(mem * count);
          used_b += mem * count;
        } else {
          ++best->refused;
        }
      }
      if (used_f < capacity * 85 / 100) {
        ++first->requests;
        FirstFit::Grant g;
        if (ff.Allocate(count, mem, &g)) {
          live_f.push_back(g);
          used_f += mem * count;
        } else {
          ++first->refused;
        }
      }
    } else {
      if (!live_b.empty()) {
        size_t i = pick % live_b.size();
        (void)alloc.Release(live_b[i]);
        used_b -= mem_b[i];
        live_b[i] = live_b.back();
        mem_b[i] = mem_b.back();
        live_b.pop_back();
        mem_b.pop_back();
      }
      if (!live_f.empty()) {
        size_t i = pick % live_f.size();
        ff.Release(live_f[i]);
        used_f -= live_f[i].mem * live_f[i].gpus.size();
        live_f[i] = live_f.back();
        live_f.pop_back();
      }
    }
  }
  for (const auto& n : alloc.Nodes()) {
    std::vector<uint64_t> fr;
    for (size_t i = 0; i < n.node.gpus.size(); ++i) {
      fr.push_back(n.node.gpus[i].memory - n.gpu_memory_used[i]);
    }
    Tally(fr, best);
  }
  for (const auto& fr : ff.free) Tally(fr, first);
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "alloc_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--nodes") f.nodes = std::stoi(next());
    else if (a == "--gpus") f.gpus = std::stoi(next());
    else if (a == "--seconds") f.seconds = std::stod(next());
    else if (a == "--reps") f.reps = std::stoi(next());
    else if (a == "--dir") f.dir = next();
    else if (a == "--window") f.window = std::stoi(next());
    else if (a == "--only") f.only = next();
    else {
      std::fprintf(stderr,
                   "usage: alloc_bench [--nodes N] [--gpus G] [--seconds S] [--reps R] "
                   "[--window W] [--only NAME] [--dir D]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  std::printf("alloc_bench: %d nodes x %d GPUs (80GiB; half exclusive, half shared), "
              "%.1fs x %d runs each, median\n", f.nodes, f.gpus, f.seconds, f.reps);
  // threads x window: blocking calls from each thread (window 0), or
  // --window asynchronous steps in flight per thread.
  struct Case {
    std::string name;
    bool central;
    bool ledger;
    bool fsync;
    int threads;
    int window;
  };
  const std::string async = " x " + std::to_string(f.window) + " async";
  const Case cases[] = {
      {"in memory, 1 thread", false, false, false, 1, 0},
      {"in memory, 8 threads", false, false, false, 8, 0},
      {"ledger, no fsync, 1 thread", false, true, false, 1, 0},
      {"ledger, no fsync, 8 threads", false, true, false, 8, 0},
      {"ledger + fsync, 1 thread", false, true, true, 1, 0},
      {"ledger + fsync, 8 threads", false, true, true, 8, 0},
      {"ledger + fsync, 64 threads", false, true, true, 64, 0},
      {"ledger + fsync, 8 thr" + async, false, true, true, 8, f.window},
      {"central, in memory, 8 thr", true, false, false, 8, 0},
      {"central, ledger + fsync, 8 thr", true, true, true, 8, 0},
      {"central, in memory, 8 thr" + async, true, false, false, 8, f.window},
      {"central, ledger + fsync, 8 thr" + async, true, true, true, 8, f.window},
  };
  std::printf("\n%-42s %12s %10s\n", "allocate+release", "pairs/s", "refused");
  for (const Case& c : cases) {
    if (c.name.find(f.only) == std::string::npos) continue;
    std::vector<double> rates, refused;
    for (int rep = 0; rep < f.reps; ++rep) {
      std::string dir;
      if (c.ledger) {
        dir = f.dir + "/run";
        std::filesystem::remove_all(dir);
      }
      Throughput t;
      const uint64_t seed = 100 + rep;
      if (!c.central) {
        auto alloc = Build(f, dir, c.fsync);
        Allocator* raw = alloc.get();
        t = Measure([raw](int) { return raw; }, c.threads, c.window, f.seconds, seed);
      } else {
        // Over loopback: one CentralClient per thread.
        CentralServerOptions so;
        so.allocator.state_dir = dir;
        so.allocator.fsync = c.fsync;
        auto server = CentralServer::Create(so);
        if (!server.ok()) {
          std::fprintf(stderr, "alloc_bench: %s\n", server.status().ToString().c_str());
          return 1;
        }
        for (int i = 0; i < f.nodes; ++i) {
          (void)(*server)->allocator().AddNode(
              MakeNode(i, f.gpus, i % 2 ? Mode::kShared : Mode::kExclusive));
        }
        const std::string address = (*server)->address();
        t = Measure(
            [&](int) {
              CentralClientOptions co;
              co.address = address;
              auto client = CentralClient::Create(co);
              if (!client.ok()) std::exit(1);
              return std::move(client).value();
            },
            c.threads, c.window, f.seconds, seed);
      }
      rates.push_back(t.pairs_per_s);
      refused.push_back(t.refused);
      std::fprintf(stderr, "  %s run %d: %.0f pairs/s\n", c.name.c_str(), rep + 1, t.pairs_per_s);
    }
    std::printf("%-42s %12.0f %9.1f%%\n", c.name.c_str(), Median(rates), 100 * Median(refused));
  }
  std::filesystem::remove_all(f.dir);

  if (std::string("fragmentation").find(f.only) == std::string::npos) return 0;
  std::fprintf(stderr, "  fragmentation workload...\n");
  Frag best, first;
  Fragmentation(f, &best, &first);
  auto pct = [](uint64_t a, uint64_t b) { return b ? 100.0 * double(a) / double(b) : 0.0; };
  std::printf("\nfragmentation: %d shared nodes x %d GPUs, same random stream of 4-40GiB "
              "requests churning at ~85%% memory\n", std::max(1, f.nodes / 2), f.gpus);
  std::printf("%-22s %10s %12s %14s %16s\n", "placement", "refused", "whole free",
              "stranded free", "40GiB that fit");
  std::printf("%-22s %9.2f%% %12d %13.1f%% %16llu\n", "deepnex best fit",
              pct(best.refused, best.requests), best.whole_free,
              pct(best.stranded, best.free_total), (unsigned long long)best.fits40);
  std::printf("%-22s %9.2f%% %12d %13.1f%% %16llu\n", "first fit (baseline)",
              pct(first.refused, first.requests), first.whole_free,
              pct(first.stranded, first.free_total), (unsigned long long)first.fits40);
  std::printf("ratio (first fit / best fit) of wholly free GPUs: %.2f\n",
              best.whole_free ? double(first.whole_free) / best.whole_free : 0.0);
  return 0;
}
