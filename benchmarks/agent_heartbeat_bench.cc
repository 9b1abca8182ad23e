// agent_heartbeat_bench: deepnex-central's CPU while N agents heartbeat.
//
//   agent_heartbeat_bench [--central-bin PATH] [--agents 1000] [--interval 2]
//                         [--window 10] [--repeats 3]
//
// Starts deepnex-central (a subprocess, so that its CPU is its own), then
// opens one agent stream per simulated node, as deepnex-agent does, and
// registers them all; one thread then heartbeats every stream once per
// --interval seconds, spread evenly. Central's user+system CPU (from
// /proc/PID/stat) is measured over --repeats windows of --window seconds,
// beside the same measure with no agent connected (its idle cost), and
// compared with the target: under 10% of one core. At the end every node
// must still be Ready.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/agent.grpc.pb.h"
#include "deepnex/central.grpc.pb.h"

#include "bench_util.h"

namespace {

using deepnex::bench::Median;

namespace apb = ::deepnex::agent::proto;
namespace gpb = ::deepnex::gpu::proto;
using Clock = std::chrono::steady_clock;

struct Flags {
  std::string central_bin;
  int agents = 1000;
  double interval = 2;
  double window = 10;
  int repeats = 3;
};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "agent_heartbeat_bench: %s\n", message.c_str());
  std::exit(1);
}

// user + system CPU seconds of `pid`.
double CpuSeconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::istringstream rest(text.substr(text.rfind(") ") + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stod(field);
    if (i == 15) stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Central's CPU as a fraction of one core over `seconds`.
double CpuShare(pid_t pid, double seconds) {
  const double before = CpuSeconds(pid);
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  return (CpuSeconds(pid) - before) / wall;
}

struct FakeAgent {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<apb::AgentMessage, apb::CentralMessage>> stream;
};

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  std::string self = argv[0];
  flags.central_bin = self.substr(0, self.rfind('/') + 1) + "deepnex-central";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--central-bin") flags.central_bin = v;
    else if (k == "--agents") flags.agents = std::stoi(v);
    else if (k == "--interval") flags.interval = std::stod(v);
    else if (k == "--window") flags.window = std::stod(v);
    else if (k == "--repeats") flags.repeats = std::stoi(v);
    else Die("unknown flag " + k);
  }
  if (flags.agents < 1 || flags.interval <= 0 || flags.window <= 0 || flags.repeats < 1) {
    Die("--agents, --interval, --window and --repeats must be positive");
  }

  // deepnex-central, its address read from its first line.
  int out[2];
  if (pipe(out) != 0) Die("pipe failed");
  const pid_t central = fork();
  if (central == 0) {
    dup2(out[1], 1);
    close(out[0]);
    // A line per registered node would drown the table.
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 2);
    // node-timeout 3x the interval: agents are told to heartbeat every
    // --interval (central tells min(2s, timeout/3)).
    const std::string timeout = std::to_string(std::max(3 * flags.interval, 6.0));
    execl(flags.central_bin.c_str(), flags.central_bin.c_str(), "--listen", "127.0.0.1:0",
          "--node-timeout", timeout.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  FILE* lines = fdopen(out[0], "r");
  char buf[256] = {0};
  if (fgets(buf, sizeof(buf), lines) == nullptr) Die("deepnex-central did not start");
  std::string line = buf;
  const std::string address = line.substr(line.rfind(' ') + 1, line.size() - line.rfind(' ') - 2);

  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("agent_heartbeat_bench: deepnex-central pid %d at %s; %d agents, heartbeat every "
              "%.1fs\n", central, address.c_str(), flags.agents, flags.interval);
  std::vector<double> idle;
  for (int r = 0; r < flags.repeats; ++r) idle.push_back(CpuShare(central, flags.window));

  // A few connections carry every stream, as many agents behind one NAT would.
  auto credentials = grpc::InsecureChannelCredentials();
  std::vector<std::unique_ptr<apb::Agents::Stub>> stubs;
  for (int c = 0; c < 8; ++c) {
    stubs.push_back(apb::Agents::NewStub(deepnex::MakeChannel(address, credentials)));
  }
  std::vector<FakeAgent> agents(flags.agents);
  const auto reg_start = Clock::now();
  for (int i = 0; i < flags.agents; ++i) {
    FakeAgent& a = agents[i];
    a.ctx = std::make_unique<grpc::ClientContext>();
    a.stream = stubs[i % stubs.size()]->Connect(a.ctx.get());
    apb::AgentMessage m;
    gpb::Node* node = m.mutable_register_()->mutable_node();
    node->set_name("b" + std::to_string(i));
    node->set_cpus(4);
    node->set_memory(8ull << 30);
    node->set_mode("exclusive");
    node->add_gpus()->set_memory(16ull << 30);
    m.mutable_register_()->set_backend("process");
    if (!a.stream->Write(m)) Die("registering agent " + std::to_string(i) + " failed");
    apb::CentralMessage reply;
    if (!a.stream->Read(&reply) || !reply.has_registered()) {
      Die("agent " + std::to_string(i) + " was not registered");
    }
  }
  const double reg_s = std::chrono::duration<double>(Clock::now() - reg_start).count();

  std::atomic<bool> stop{false};
  std::thread beat([&] {
    const auto gap = std::chrono::duration<double>(flags.interval / flags.agents);
    auto next = Clock::now();
    apb::AgentMessage hb;
    hb.mutable_heartbeat();
    while (!stop) {
      for (auto& a : agents) {
        if (stop) break;
        a.stream->Write(hb);
        next += std::chrono::duration_cast<Clock::duration>(gap);
        std::this_thread::sleep_until(next);
      }
    }
  });
  std::vector<double> busy;
  for (int r = 0; r < flags.repeats; ++r) {
    busy.push_back(CpuShare(central, flags.window));
    std::fprintf(stderr, "window %d/%d: %.2f%% of a core\n", r + 1, flags.repeats,
                 100 * busy.back());
  }
  stop = true;
  beat.join();

  auto central_stub =
      gpb::Central::NewStub(deepnex::MakeChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  gpb::Nodes nodes;
  int ready = 0;
  if (central_stub->ListNodes(&ctx, gpb::Empty(), &nodes).ok()) {
    for (const auto& n : nodes.nodes()) ready += !n.not_ready();
  }

  const double b = Median(busy), i = Median(idle);
  std::printf("\n%-34s %8s %10s %10s %12s %8s\n", "what", "agents", "interval", "windows",
              "CPU % core", "ratio");
  std::printf("%-34s %8d %9.1fs %7dx%.0fs %11.2f%% %8s\n", "central, idle (peer)", 0,
              flags.interval, flags.repeats, flags.window, 100 * i, "");
  // The ratio of the busy figure to the idle peer, and to the target.
  const std::string vs_idle = i > 0 ? std::to_string(b / i).substr(0, 5) + "x" : "-";
  std::printf("%-34s %8d %9.1fs %7dx%.0fs %11.2f%% %8s\n", "central, agents heartbeating",
              flags.agents, flags.interval, flags.repeats, flags.window, 100 * b,
              vs_idle.c_str());
  std::printf("%-34s %8s %10s %10s %11.2f%% %7.2fx\n", "target (busy / target)", "", "", "",
              10.0, b / 0.10);
  std::printf("registration of %d agents: %.2fs; Ready at the end: %d/%d\n", flags.agents, reg_s,
              ready, flags.agents);

  for (auto& a : agents) {
    a.ctx->TryCancel();
    a.stream->Finish().ok();  // Cancelled
  }
  agents.clear();
  kill(central, SIGTERM);
  waitpid(central, nullptr, 0);
  return ready == flags.agents ? 0 : 1;
}
