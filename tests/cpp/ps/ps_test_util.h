// Helpers of the parameter-server tests: tensors, metrics, raw calls.
#ifndef DEEPNEX_TESTS_PS_PS_TEST_UTIL_H_
#define DEEPNEX_TESTS_PS_PS_TEST_UTIL_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::ps {

inline constexpr char kPushMethod[] = "/deepnex.ps.proto.ParameterServer/Push";

// `v` as the float32 tensor `key`, without a copy.
inline NamedTensor View(const std::string& key, std::vector<float>& v) {
  return {key, TensorView(v.data(), DType::kFloat32, {static_cast<int64_t>(v.size())})};
}

// The value of an unlabelled metric in the server's Prometheus text.
inline double Metric(const Server& server, const std::string& name) {
  std::istringstream text(server.MetricsText());
  for (std::string line; std::getline(text, line);) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  ADD_FAILURE() << name << " is not in the metrics";
  return -1;
}

// One raw call of `method`, waited for (GenericStub has no blocking call).
inline grpc::Status CallAndWait(grpc::GenericStub& stub, grpc::ClientContext* ctx,
                                const char* method, grpc::ByteBuffer request,
                                grpc::ByteBuffer* response) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(ctx, method, grpc::StubOptions(), &request, response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = s;
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return status;
}

// What each worker pulled after each round: "w" by PushPull of the pushed
// keys, "b" by a push and then a pull, "c" pulled with a push of "b".
using Trace = std::vector<std::vector<std::vector<float>>>;  // [worker][step]

struct RunResult {
  Trace trace;
  double shm_segments = 0;
  double shm_bytes = 0;
  double bulk_connections = 0;
  double bulk_bytes = 0;
};

// Two workers training over `transport` for 4 sync rounds, against a server
// with or without bulk TCP connections.
inline RunResult RunRounds(Transport transport, uint64_t shm_bytes, bool bulk_tcp = true) {
  ServerOptions so;
  so.mode = Mode::kSync;
  so.num_workers = 2;
  so.optimizer.lr = 0.5;
  so.bulk_tcp = bulk_tcp;
  auto server = Server::Create(so);
  EXPECT_THAT(server.status(), ::deepnex::test::IsOk());
  if (!server.ok()) return {};
  const size_t n = 1000;
  RunResult result;
  result.trace.resize(2);
  std::vector<absl::Status> status(2);
  std::vector<std::unique_ptr<Client>> clients(2);
  for (int w = 0; w < 2; ++w) {
    ClientOptions co;
    co.servers = {(*server)->address()};
    co.worker_id = w;
    co.partition_bytes = 512;  // several partitions, batches and regions
    co.request_bytes = 1024;
    co.transport = transport;
    co.shm_bytes = shm_bytes;
    auto client = Client::Create(co);
    EXPECT_THAT(client.status(), ::deepnex::test::IsOk());
    if (!client.ok()) return {};
    clients[w] = std::move(*client);
  }
  result.shm_segments = Metric(**server, "deepnex_ps_shm_segments");
  result.bulk_connections = Metric(**server, "deepnex_ps_bulk_connections");
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      Client& c = *clients[w];
      std::vector<float> wv(n), bv(300), cv(40);
      for (size_t j = 0; j < n; ++j) wv[j] = static_cast<float>(j);
      absl::Status s = c.Init({View("w", wv), View("b", bv), View("c", cv)});
      for (int r = 1; r <= 4 && s.ok(); ++r) {
        // Integers times 0.5: exact in float32 whatever the order.
        std::vector<float> gw(n), gb(300), out_w(n), out_b(300), out_c(40);
        for (size_t j = 0; j < n; ++j) gw[j] = static_cast<float>((w + 1) * r * (j % 5 + 1));
        for (size_t j = 0; j < gb.size(); ++j) gb[j] = static_cast<float>(w * 3 + r);
        s = c.PushPull({View("w", gw)}, {View("w", out_w)});
        if (s.ok()) s = c.Push({View("b", gb)});
        if (s.ok()) s = c.Pull({View("b", out_b)});
        if (s.ok()) s = c.PushPull({View("b", gb)}, {View("c", out_c)});
        result.trace[w].push_back(out_w);
        result.trace[w].push_back(out_b);
        result.trace[w].push_back(out_c);
      }
      status[w] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 2; ++w) EXPECT_THAT(status[w], ::deepnex::test::IsOk()) << "worker " << w;
  result.shm_bytes = Metric(**server, "deepnex_ps_shm_bytes_total");
  result.bulk_bytes = Metric(**server, "deepnex_ps_bulk_bytes_total");
  return result;
}

}  // namespace deepnex::ps

#endif  // DEEPNEX_TESTS_PS_PS_TEST_UTIL_H_
