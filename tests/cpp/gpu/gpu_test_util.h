// Helpers shared by the gpu allocator tests.
#ifndef DEEPNEX_TESTS_GPU_GPU_TEST_UTIL_H_
#define DEEPNEX_TESTS_GPU_GPU_TEST_UTIL_H_

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/types.h"
#include "test_util.h"

namespace deepnex::gpu::test {

inline constexpr uint64_t kGiB = uint64_t{1} << 30;

inline Node MakeNode(const std::string& name, int gpus, uint64_t gpu_memory = 80 * kGiB,
                     Mode mode = Mode::kExclusive, int cpus = 64, uint64_t memory = 512 * kGiB,
                     std::map<std::string, std::string> labels = {}) {
  Node n;
  n.name = name;
  for (int i = 0; i < gpus; ++i) {
    Gpu g;
    g.memory = gpu_memory;
    n.gpus.push_back(g);
  }
  n.cpus = cpus;
  n.memory = memory;
  n.mode = mode;
  n.labels = std::move(labels);
  return n;
}

inline Request Shared(const std::string& user, int gpus, uint64_t gpu_memory, int cpus = 0,
                      uint64_t memory = 0) {
  Request r;
  r.user = user;
  r.gpus = gpus;
  r.mode = Mode::kShared;
  r.gpu_memory = gpu_memory;
  r.cpus = cpus;
  r.memory = memory;
  return r;
}

inline Request Exclusive(const std::string& user, int gpus, int cpus = 0, uint64_t memory = 0) {
  Request r;
  r.user = user;
  r.gpus = gpus;
  r.mode = Mode::kExclusive;
  r.cpus = cpus;
  r.memory = memory;
  return r;
}

inline AllocateOptions NoWait() {
  AllocateOptions o;
  o.wait = false;
  return o;
}

// Each user's use against the quota that applies to them, from one view of
// the allocator's state (Quotas reads it under the allocator's lock): empty
// when every user is within, else who is over and by what.
inline std::string OverQuota(const std::vector<UserQuota>& quotas) {
  for (const UserQuota& e : quotas) {
    const Quota& q = e.quota;
    const Usage& u = e.usage;
    if ((q.gpus && u.gpus > *q.gpus) || (q.gpu_memory && u.gpu_memory > *q.gpu_memory) ||
        (q.cpus && u.cpus > *q.cpus) || (q.memory && u.memory > *q.memory)) {
      return "user " + e.user + " holds gpus=" + std::to_string(u.gpus) +
             " gpu_memory=" + std::to_string(u.gpu_memory) + " cpus=" + std::to_string(u.cpus) +
             " memory=" + std::to_string(u.memory) + " over " + q.ToString();
    }
  }
  return "";
}

using TempDir = ::deepnex::test::TempDir;

#ifdef DEEPNEX_CENTRAL_BIN
// The deepnex-central binary, started with `--listen 127.0.0.1:0` and `args`.
// `address` is empty when it did not come up. The caller signals and reaps it.
// Its TMPDIR is `tmp`, removed with this object: a daemon a test kills with
// SIGKILL cannot remove its launcher's temporary state directory itself.
struct CentralDaemon {
  pid_t pid = -1;
  std::string address;
  std::unique_ptr<TempDir> tmp = std::make_unique<TempDir>();
};

inline CentralDaemon StartCentralDaemon(std::vector<std::string> args) {
  args.insert(args.begin(), {DEEPNEX_CENTRAL_BIN, "--listen", "127.0.0.1:0"});
  int out[2];
  if (pipe(out) != 0) return {};
  CentralDaemon d;
  const std::string tmpdir = d.tmp->path();
  d.pid = fork();
  if (d.pid == 0) {
    if (!tmpdir.empty()) setenv("TMPDIR", tmpdir.c_str(), 1);
    dup2(out[1], 1);
    close(out[0]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line += c;
  close(out[0]);
  const std::string prefix = "deepnex-central listening on ";
  if (line.rfind(prefix, 0) == 0) d.address = line.substr(prefix.size());
  return d;
}
#endif

}  // namespace deepnex::gpu::test

#endif  // DEEPNEX_TESTS_GPU_GPU_TEST_UTIL_H_
