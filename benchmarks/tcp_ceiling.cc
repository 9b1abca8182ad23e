// tcp_ceiling: the raw loopback TCP ceiling for the parameter-server
// benchmark (benchmarks/ps_bench). Plain blocking sockets move the same bytes
// a parameter-server round moves: each of --workers clients, on its own
// connection, sends --bytes to the server (the "push") and the server sends
// --bytes back (the "pull"). A message of --wake-bytes (default 1 MiB) or
// more is received as deepnex's bulk connections receive one: what is there,
// and when nothing is, a wait with SO_RCVLOWAT for --wake-bytes more (or the
// rest), instead of a blocking recv that wakes at every packet; on these
// 2-CPU hosts that halved the CPU of a 4 MiB round. --wake-bytes 0 gives the
// plain blocking recv (the ceiling as measured before 2026-12-05).
//
// Timing matches ps_bench_worker and torch_rpc_ps.py: every client does its
// warm-up rounds, all clients meet at one barrier, then each runs its timed
// rounds on its own. Round k takes the longest of the clients' k-th round
// times; the figure is the median of those over the timed rounds, and
//   goodput = (push + pull bytes over all clients) / median round time,
// in GB/s of 1e9 bytes. cpu_s is the process's CPU time (all threads, server
// and clients) from the barrier to the end: the CPU the timed rounds cost.
//
// Output: one JSON line on stdout. Progress and errors on stderr.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"

namespace {

using deepnex::bench::Median;
using deepnex::bench::ProcessCpuSeconds;

using Clock = std::chrono::steady_clock;

struct Flags {
  uint64_t bytes = 64ull << 20;
  int rounds = 20;
  int warmup = 3;
  int workers = 1;
  // 0 leaves the kernel's autotuning alone.
  int sockbuf = 0;
  uint64_t wake_bytes = 1 << 20;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tcp_ceiling: %s: %s\n", what.c_str(),
               errno ? std::strerror(errno) : "failed");
  std::exit(1);
}

void Usage() {
  std::fprintf(stderr,
               "usage: tcp_ceiling [--bytes N] [--mb N] [--rounds N] "
               "[--warmup N] [--workers N] [--sockbuf BYTES] [--wake-bytes BYTES]\n");
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> long long {
      if (i + 1 >= argc) Usage();
      char* end = nullptr;
      long long v = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0' || v < 0) {
        std::fprintf(stderr, "tcp_ceiling: bad value for %s: %s\n", a.c_str(),
                     argv[i]);
        std::exit(2);
      }
      return v;
    };
    if (a == "--bytes") f.bytes = value();
    else if (a == "--mb") f.bytes = static_cast<uint64_t>(value()) << 20;
    else if (a == "--rounds") f.rounds = static_cast<int>(value());
    else if (a == "--warmup") f.warmup = static_cast<int>(value());
    else if (a == "--workers") f.workers = static_cast<int>(value());
    else if (a == "--sockbuf") f.sockbuf = static_cast<int>(value());
    else if (a == "--wake-bytes") f.wake_bytes = static_cast<uint64_t>(value());
    else Usage();
  }
  if (f.bytes == 0 || f.rounds < 1 || f.workers < 1) Usage();
  return f;
}

void SetSocketOptions(int fd, const Flags& f) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
    Die("setsockopt(TCP_NODELAY)");
  if (f.sockbuf > 0) {
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &f.sockbuf, sizeof f.sockbuf) ||
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &f.sockbuf, sizeof f.sockbuf))
      Die("setsockopt(SO_SNDBUF/SO_RCVBUF)");
  }
}

void SendAll(int fd, const char* p, uint64_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      Die("send");
    }
    p += k;
    n -= static_cast<uint64_t>(k);
  }
}

void RecvAll(int fd, char* p, uint64_t n, uint64_t wake_bytes) {
  const bool chunked = wake_bytes > 0 && n >= wake_bytes;
  int lowat = 1;
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, chunked ? MSG_DONTWAIT : 0);
    if (k < 0 && chunked && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int want = static_cast<int>(std::min(n, wake_bytes));  // never more than comes
      if (want != lowat && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) != 0)
        Die("setsockopt(SO_RCVLOWAT)");
      lowat = want;
      pollfd pfd{fd, POLLIN, 0};
      if (::poll(&pfd, 1, -1) < 0 && errno != EINTR) Die("poll");
      continue;
    }
    if (k < 0) {
      if (errno == EINTR) continue;
      Die("recv");
    }
    if (k == 0) {
      errno = 0;
      Die("recv: peer closed the connection early");
    }
    p += k;
    n -= static_cast<uint64_t>(k);
  }
  int one = 1;
  if (lowat != 1) setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
}

// Buffers are touched up front so page faults stay out of the timed rounds.
std::vector<char> TouchedBuffer(uint64_t n, char fill) {
  return std::vector<char>(n, fill);
}

// Records the process's CPU time when the last one arrives.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  double released_cpu_s() const { return released_cpu_s_; }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    int gen = generation_;
    if (++waiting_ == n_) {
      released_cpu_s_ = ProcessCpuSeconds();
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen != generation_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int waiting_ = 0;
  int generation_ = 0;
  double released_cpu_s_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  const int total_rounds = f.warmup + f.rounds;

  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) Die("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;  // the OS picks
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    Die("bind 127.0.0.1:0");
  if (::listen(listener, f.workers) != 0) Die("listen");
  socklen_t len = sizeof addr;
  if (::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    Die("getsockname");

  // Server: one thread per accepted connection; each round it receives the
  // push in full, then sends the pull.
  std::vector<std::thread> server_threads;
  std::thread acceptor([&] {
    for (int i = 0; i < f.workers; ++i) {
      int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) Die("accept");
      SetSocketOptions(fd, f);
      server_threads.emplace_back([fd, &f, total_rounds] {
        std::vector<char> in = TouchedBuffer(f.bytes, 0);
        std::vector<char> out = TouchedBuffer(f.bytes, 1);
        for (int r = 0; r < total_rounds; ++r) {
          RecvAll(fd, in.data(), f.bytes, f.wake_bytes);
          SendAll(fd, out.data(), f.bytes);
        }
        ::close(fd);
      });
    }
  });

  Barrier start(f.workers);
  std::vector<std::vector<double>> times(f.workers);
  std::vector<std::thread> clients;
  for (int w = 0; w < f.workers; ++w) {
    clients.emplace_back([&, w] {
      int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0) Die("socket");
      SetSocketOptions(fd, f);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
        Die("connect");
      std::vector<char> push = TouchedBuffer(f.bytes, 2);
      std::vector<char> pull = TouchedBuffer(f.bytes, 3);
      for (int r = 0; r < total_rounds; ++r) {
        if (r == f.warmup) start.Wait();
        auto t0 = Clock::now();
        SendAll(fd, push.data(), f.bytes);
        RecvAll(fd, pull.data(), f.bytes, f.wake_bytes);
        double s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (r >= f.warmup) times[w].push_back(s);
      }
      ::close(fd);
    });
  }
  for (auto& t : clients) t.join();
  acceptor.join();
  for (auto& t : server_threads) t.join();
  const double cpu_s = ProcessCpuSeconds() - start.released_cpu_s();
  ::close(listener);

  // Round k lasts as long as its slowest client.
  std::vector<double> round_s(f.rounds, 0.0);
  for (int k = 0; k < f.rounds; ++k)
    for (int w = 0; w < f.workers; ++w)
      round_s[k] = std::max(round_s[k], times[w][k]);
  const double median_s = Median(round_s);
  const double moved = 2.0 * static_cast<double>(f.bytes) * f.workers;
  const double gbps = moved / median_s / 1e9;
  auto [mn, mx] = std::minmax_element(round_s.begin(), round_s.end());

  std::string rounds_json;
  for (int k = 0; k < f.rounds; ++k) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.6f", k ? "," : "", round_s[k]);
    rounds_json += buf;
  }
  std::printf(
      "{\"bench\":\"tcp_ceiling\",\"workers\":%d,\"bytes_per_worker\":%llu,"
      "\"warmup\":%d,\"rounds\":%d,\"sockbuf\":%d,\"wake_bytes\":%llu,\"median_s\":%.6f,"
      "\"min_s\":%.6f,\"max_s\":%.6f,\"goodput_gbps\":%.4f,\"cpu_s\":%.6f,"
      "\"round_s\":[%s]}\n",
      f.workers, static_cast<unsigned long long>(f.bytes), f.warmup, f.rounds,
      f.sockbuf, static_cast<unsigned long long>(f.wake_bytes), median_s, *mn, *mx, gbps,
      cpu_s, rounds_json.c_str());
  std::fflush(stdout);
  return 0;
}
