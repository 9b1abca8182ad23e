// Helpers of the parameter-server tests: tensors, metrics, raw calls.
#ifndef DEEPNEX_TESTS_PS_PS_TEST_UTIL_H_
#define DEEPNEX_TESTS_PS_PS_TEST_UTIL_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"
#include "gtest/gtest.h"

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

}  // namespace deepnex::ps

#endif  // DEEPNEX_TESTS_PS_PS_TEST_UTIL_H_
