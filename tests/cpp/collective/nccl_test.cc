// The nccl backend on real GPUs (CTest label `gpu`). Every test skips, with
// a message, where there is no device. One rank per visible device, as
// threads; exact results with integer-valued inputs.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "deepnex/collective/communicator.h"
#include "deepnex/collective/store.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::collective {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;

int Devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

#define SKIP_WITHOUT_GPU()                                             \
  if (Devices() == 0) GTEST_SKIP() << "no CUDA device: the nccl tests need a GPU"

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = StoreServer::Create({});
    ASSERT_THAT(s, IsOk());
    store_ = std::move(*s);
  }
  void RunRanks(int n, const std::function<void(int, Communicator&)>& body) {
    const std::string prefix = "nccl" + std::to_string(counter_++);
    ::deepnex::test::RunRanks(n, [&](int r) {
      CommunicatorOptions o;
      o.rank = r;
      o.world_size = n;
      o.store_address = store_->address();
      o.prefix = prefix;
      o.backend = Backend::kNccl;
      o.device = r;
      o.timeout = std::chrono::milliseconds(60000);
      cudaSetDevice(r);
      auto comm = Communicator::Create(o);
      ASSERT_THAT(comm, IsOk()) << "rank " << r;
      body(r, **comm);
    });
  }
  std::unique_ptr<StoreServer> store_;
  int counter_ = 0;
};

TEST_F(NcclTest, AllReduceBroadcastAllGatherReduceScatter) {
  SKIP_WITHOUT_GPU();
  const int n = Devices();
  RunRanks(n, [&](int r, Communicator& comm) {
    const size_t count = 1000003;
    std::vector<float> host(count);
    for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 100 + r);
    float* dev = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), count * 4 * n), cudaSuccess);
    cudaMemcpy(dev, host.data(), count * 4, cudaMemcpyHostToDevice);
    TensorView t(dev, DType::kFloat32, {int64_t(count)});
    ASSERT_OK(comm.AllReduce(t, ReduceOp::kSum));
    cudaMemcpy(host.data(), dev, count * 4, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(host[i], static_cast<float>(n * (i % 100) + n * (n - 1) / 2)) << i;
    }
    ASSERT_OK(comm.AllReduce(t, ReduceOp::kMax));
    ASSERT_OK(comm.Broadcast(t, 0));
    float* gathered = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&gathered), count * 4 * n), cudaSuccess);
    ASSERT_OK(comm.AllGather(t, TensorView(gathered, DType::kFloat32, {n, int64_t(count)})));
    ASSERT_OK(comm.ReduceScatter(TensorView(gathered, DType::kFloat32, {n * int64_t(count)}),
                                 TensorView(dev, DType::kFloat32, {int64_t(count)}),
                                 ReduceOp::kSum));
    ASSERT_OK(comm.Barrier());
    // Host memory is refused, not crashed on.
    EXPECT_THAT(comm.AllReduce(TensorView(host.data(), DType::kFloat32, {int64_t(count)})),
                StatusIs(absl::StatusCode::kInvalidArgument));
    cudaFree(gathered);
    cudaFree(dev);
  });
}

// Collectives up to 1 MiB are issued by the thread that waits for them.
// Whatever device that thread has selected, each runs on the
// communicator's, and the thread keeps its own (with 2+ GPUs every rank
// selects another rank's device first).
TEST_F(NcclTest, AWaitingThreadIssuesOnTheCommunicatorsDeviceAndKeepsItsOwn) {
  SKIP_WITHOUT_GPU();
  const int n = Devices();
  RunRanks(n, [&](int r, Communicator& comm) {
    const int other = (r + 1) % n;
    for (size_t count : {size_t{1024}, size_t{1} << 18, size_t{1} << 20}) {  // 4 KiB..4 MiB
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      float* dev = nullptr;
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), count * 4), cudaSuccess);
      std::vector<float> host(count, static_cast<float>(r + 1));
      cudaMemcpy(dev, host.data(), count * 4, cudaMemcpyHostToDevice);
      ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
      TensorView t(dev, DType::kFloat32, {int64_t(count)});
      ASSERT_OK(comm.AllReduce(t, ReduceOp::kSum)) << count;
      auto work = comm.AllReduceAsync(t, ReduceOp::kSum);
      ASSERT_OK(work->Wait(std::chrono::milliseconds(60000))) << count;
      int current = -1;
      ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
      EXPECT_EQ(current, other) << count;
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      cudaMemcpy(host.data(), dev, count * 4, cudaMemcpyDeviceToHost);
      const float sum = static_cast<float>(n * (n + 1) / 2);  // of the ranks' r + 1
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(host[i], sum * n) << count << " " << i;
      cudaFree(dev);
    }
  });
}

TEST_F(NcclTest, BusBandwidthSweep) {
  SKIP_WITHOUT_GPU();
  const int n = Devices();
  RunRanks(n, [&](int r, Communicator& comm) {
    for (size_t bytes = 1 << 10; bytes <= (256u << 20); bytes <<= 2) {
      void* dev = nullptr;
      ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
      cudaMemset(dev, 0, bytes);
      TensorView t(dev, DType::kFloat32, {int64_t(bytes / 4)});
      for (int i = 0; i < 3; ++i) ASSERT_OK(comm.AllReduce(t));
      const int iters = 20;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) ASSERT_OK(comm.AllReduce(t));
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
      double busbw = bytes / secs * (n > 1 ? 2.0 * (n - 1) / n : 1.0) / 1e9;
      if (r == 0) {
        std::printf("nccl allreduce %d ranks %10zu bytes  %9.1f us  busbw %7.2f GB/s\n", n, bytes,
                    secs * 1e6, busbw);
      }
      cudaFree(dev);
    }
  });
}

}  // namespace
}  // namespace deepnex::collective
