#include "deepnex/collective/bucketing.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "deepnex/collective/store.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::collective {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;

TEST(GradientBucketerTest, BucketsInReverseOrderByDTypeAndSize) {
  CommunicatorOptions o;
  ASSERT_OK_AND_ASSIGN(auto comm, Communicator::Create(o));
  std::vector<float> a(100), b(100), big(1000);
  std::vector<double> c(10);
  BucketOptions opts;
  opts.bucket_bytes = 800;
  ASSERT_OK_AND_ASSIGN(
      auto bucketer,
      GradientBucketer::Create(comm.get(),
                               {TensorView(a.data(), DType::kFloat32, {100}),
                                TensorView(b.data(), DType::kFloat32, {100}),
                                TensorView(c.data(), DType::kFloat64, {10}),
                                TensorView(big.data(), DType::kFloat32, {1000})},
                               opts));
  // big alone (4000 bytes), c alone (another dtype), a and b together.
  std::vector<size_t> of = bucketer->BucketOf();
  EXPECT_EQ(of[0], of[1]);
  EXPECT_NE(of[2], of[0]);
  EXPECT_NE(of[3], of[0]);
  EXPECT_EQ(bucketer->num_buckets(), 3u);
  EXPECT_THAT(bucketer->MarkReady(9), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(bucketer->MarkReady(1));
  EXPECT_THAT(bucketer->MarkReady(1), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(bucketer->Wait(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(GradientBucketerTest, AveragesAcrossRanksWhateverTheMarkingOrder) {
  auto server = StoreServer::Create({});
  ASSERT_THAT(server, IsOk());
  const int n = 3;
  ::deepnex::test::RunRanks(n, [&](int r) {
    CommunicatorOptions o;
    o.rank = r;
    o.world_size = n;
    o.store_address = (*server)->address();
    o.prefix = "bucketing";
    auto comm = Communicator::Create(o);
    ASSERT_THAT(comm, IsOk());
    // 40 small tensors of various sizes and two dtypes.
    std::vector<std::vector<float>> f(30);
    std::vector<std::vector<int64_t>> i64(10);
    std::vector<TensorView> views;
    for (size_t k = 0; k < f.size(); ++k) {
      f[k].assign(1000 + 37 * k, 0.0f);
      views.emplace_back(f[k].data(), DType::kFloat32, std::vector<int64_t>{int64_t(f[k].size())});
    }
    for (size_t k = 0; k < i64.size(); ++k) {
      i64[k].assign(500 + k, 0);
      views.emplace_back(i64[k].data(), DType::kInt64, std::vector<int64_t>{int64_t(i64[k].size())});
    }
    BucketOptions opts;
    opts.bucket_bytes = 16 << 10;
    auto bucketer = GradientBucketer::Create(comm->get(), views, opts);
    ASSERT_THAT(bucketer, IsOk());
    EXPECT_GT((*bucketer)->num_buckets(), 4u);
    for (int round = 0; round < 3; ++round) {
      for (size_t k = 0; k < f.size(); ++k) std::fill(f[k].begin(), f[k].end(), float(3 * (r + round + k)));
      for (size_t k = 0; k < i64.size(); ++k) std::fill(i64[k].begin(), i64[k].end(), 3 * (r + k));
      // Each rank marks in its own order.
      std::vector<size_t> order;
      for (size_t k = 0; k < views.size(); k += (r == 2 ? 2 : 1)) order.push_back(k);
      if (r == 2) {
        for (size_t k = 1; k < views.size(); k += 2) order.push_back(k);
      }
      if (r == 1) std::reverse(order.begin(), order.end());
      for (size_t k : order) ASSERT_OK((*bucketer)->MarkReady(k));
      ASSERT_OK((*bucketer)->Wait());
      for (size_t k = 0; k < f.size(); ++k) {
        for (float v : f[k]) ASSERT_EQ(v, float(3 * (1 + round + k))) << k;  // mean of r = 0,1,2
      }
      for (size_t k = 0; k < i64.size(); ++k) {
        for (int64_t v : i64[k]) ASSERT_EQ(v, 3 * (1 + int64_t(k)));
      }
    }
  });
}

}  // namespace
}  // namespace deepnex::collective
