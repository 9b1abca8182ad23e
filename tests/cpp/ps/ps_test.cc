// Parameter server end to end: servers and workers as threads on 127.0.0.1.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <utility>

#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/ps_test_util.h"
#include "test_matchers.h"

namespace deepnex::ps {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

struct Cluster {
  std::vector<std::unique_ptr<Server>> servers;
  std::vector<std::string> addresses;
};

Cluster StartServers(int n, ServerOptions options) {
  Cluster c;
  for (int i = 0; i < n; ++i) {
    auto server = Server::Create(options);
    EXPECT_THAT(server.status(), IsOk());
    c.addresses.push_back((*server)->address());
    c.servers.push_back(std::move(*server));
  }
  return c;
}

std::unique_ptr<Client> Connect(const Cluster& c, int worker,
                                ClientOptions options = {}) {
  options.servers = c.addresses;
  options.worker_id = worker;
  auto client = Client::Create(options);
  EXPECT_THAT(client.status(), IsOk());
  return client.ok() ? std::move(*client) : nullptr;
}

// Small partitions so that a 1000-element tensor spans both servers.
ClientOptions SmallParts() {
  ClientOptions o;
  o.partition_bytes = 512;
  o.request_bytes = 1024;
  return o;
}

float Grad(int worker, int round, size_t j) {
  return static_cast<float>((worker + 1) * round * static_cast<int>(j % 7 + 1));
}

class SyncTest : public ::testing::TestWithParam<int> {};

TEST_P(SyncTest, EveryWorkerPullsTheExactValuesAfterEachRound) {
  const int workers = GetParam();
  const int rounds = 5;
  const size_t n = 1000;
  ServerOptions so;
  so.mode = Mode::kSync;
  so.num_workers = workers;
  so.reduction = Reduction::kMean;
  so.optimizer.lr = 0.5;
  Cluster c = StartServers(2, so);

  std::vector<float> init(n);
  for (size_t j = 0; j < n; ++j) init[j] = static_cast<float>(j);
  // The exact trajectory: mean over workers of (w+1)*r*(j%7+1) is
  // r*(j%7+1)*(workers+1)/2, a multiple of 0.5 that float32 holds exactly.
  std::vector<std::vector<float>> expected(rounds + 1, init);
  for (int r = 1; r <= rounds; ++r) {
    for (size_t j = 0; j < n; ++j) {
      double mean = 0;
      for (int w = 0; w < workers; ++w) mean += Grad(w, r, j);
      mean /= workers;
      expected[r][j] = static_cast<float>(expected[r - 1][j] - 0.5 * mean);
    }
  }

  std::vector<std::thread> threads;
  std::vector<absl::Status> failures(workers);
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(c, w, SmallParts());
      std::vector<float> values = init, bias(3, 0.0f);
      absl::Status s = client->Init({View("w", values), View("b", bias)});
      std::vector<float> got(n), grad(n), bgot(3);
      if (s.ok()) s = client->Pull({View("w", got)});
      if (s.ok() && got != init) s = absl::InternalError("init values differ");
      for (int r = 1; r <= rounds && s.ok(); ++r) {
        for (size_t j = 0; j < n; ++j) grad[j] = Grad(w, r, j);
        s = client->PushPull({View("w", grad)}, {View("w", got)});
        if (s.ok() && got != expected[r]) {
          s = absl::InternalError(absl::StrCat("worker ", w, " round ", r, " differs"));
        }
      }
      failures[w] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    EXPECT_THAT(failures[w], IsOk()) << "worker " << w;
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, SyncTest, ::testing::Values(2, 4));

TEST(PsTest, FirstInitWinsAndEveryWorkerSeesTheSameValues) {
  ServerOptions so;
  so.num_workers = 4;
  Cluster c = StartServers(2, so);
  std::vector<std::vector<float>> seen(4, std::vector<float>(1000));
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(c, w, SmallParts());
      std::vector<float> mine(1000, static_cast<float>(w));
      ASSERT_THAT(client->Init({View("w", mine)}), IsOk());
      ASSERT_THAT(client->Pull({View("w", seen[w])}), IsOk());
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 1; w < 4; ++w) EXPECT_EQ(seen[w], seen[0]);
  // The values are one worker's, not a mix of parts from several.
  EXPECT_EQ(seen[0], std::vector<float>(1000, seen[0][0]));
}

// Init claims and commits in batches per server, request_bytes apart
// (SmallParts: many of them): tensors that two workers init at once each
// hold one worker's values, whole, across both servers.
TEST(PsTest, ManyTensorsInitInBatchesAndEachHoldsOneWorkersValues) {
  ServerOptions so;
  so.num_workers = 2;
  Cluster c = StartServers(2, so);
  const int n = 3000;
  std::vector<std::vector<std::vector<float>>> seen(2, std::vector<std::vector<float>>(n));
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(c, w, SmallParts());
      std::vector<std::vector<float>> mine(n);
      std::vector<NamedTensor> init, out;
      for (int i = 0; i < n; ++i) {
        const std::string key = "k" + std::to_string(i);
        mine[i].assign(i % 300 + 1, static_cast<float>(2 * i + w));  // up to 3 parts
        seen[w][i].assign(mine[i].size(), -1.0f);
        init.push_back(View(key, mine[i]));
        out.push_back(View(key, seen[w][i]));
      }
      ASSERT_THAT(client->Init(init), IsOk());
      ASSERT_THAT(client->Pull(out), IsOk());
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < n; ++i) {
    const float first = seen[0][i][0];
    EXPECT_TRUE(first == 2 * i || first == 2 * i + 1) << "k" << i << ": " << first;
    EXPECT_EQ(seen[0][i], std::vector<float>(i % 300 + 1, first)) << "k" << i;
    EXPECT_EQ(seen[1][i], seen[0][i]) << "k" << i;
  }
}

TEST(PsTest, AsyncAppliesEveryPushExactly) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  so.num_workers = 3;
  so.optimizer.lr = 0.25;
  Cluster c = StartServers(2, so);
  const size_t n = 1000;
  const int pushes = 10;
  std::vector<float> init(n, 100.0f);
  {
    auto client = Connect(c, 0, SmallParts());
    ASSERT_THAT(client->Init({View("w", init)}), IsOk());
  }
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(c, w, SmallParts());
      std::vector<float> grad(n);
      for (int r = 1; r <= pushes; ++r) {
        for (size_t j = 0; j < n; ++j) grad[j] = Grad(w, r, j);
        ASSERT_THAT(client->Push({View("w", grad)}), IsOk());
      }
    });
  }
  for (auto& t : threads) t.join();
  auto client = Connect(c, 0, SmallParts());
  std::vector<float> got(n), expected(n, 100.0f);
  for (size_t j = 0; j < n; ++j) {
    for (int w = 0; w < 3; ++w) {
      for (int r = 1; r <= pushes; ++r) expected[j] -= 0.25f * Grad(w, r, j);
    }
  }
  ASSERT_THAT(client->Pull({View("w", got)}), IsOk());
  EXPECT_EQ(got, expected);
}

TEST(PsTest, LargeTensorRoundTripsAcrossThreeServers) {
  Cluster c = StartServers(3, {});
  ClientOptions co;
  co.partition_bytes = 256 << 10;
  co.request_bytes = 512 << 10;
  auto client = Connect(c, 0, co);
  const size_t n = (3 << 20) / 4 + 13;  // 3 MiB and a bit: 13 parts
  std::vector<float> values(n), got(n);
  for (size_t j = 0; j < n; ++j) values[j] = static_cast<float>(j) * 0.5f - 7.0f;
  std::vector<double> dvalues(n / 3), dgot(n / 3);
  for (size_t j = 0; j < dvalues.size(); ++j) dvalues[j] = 1.0 / (j + 1);
  ASSERT_THAT(
      client->Init({View("big", values),
                    {"f64", TensorView(dvalues.data(), DType::kFloat64,
                                       {static_cast<int64_t>(dvalues.size())})}}),
      IsOk());
  ASSERT_THAT(client->Pull({View("big", got),
                            {"f64", TensorView(dgot.data(), DType::kFloat64,
                                               {static_cast<int64_t>(dgot.size())})}}),
              IsOk());
  EXPECT_EQ(got, values);
  EXPECT_EQ(dgot, dvalues);
  auto info = client->Describe({"big"});
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ((*info)[0].shape, std::vector<int64_t>{static_cast<int64_t>(n)});
}

// An async push that replies has the values its push made, in every
// partition (small ones across two servers, and big ones), with the
// optimizer's state carried from push to push.
TEST(PsTest, AsyncPushPullRepliesWithTheValuesItsPushMade) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  so.optimizer.kind = OptimizerKind::kSgd;
  so.optimizer.lr = 0.25;
  so.optimizer.momentum = 0.5;
  Cluster c = StartServers(2, so);
  for (auto [n, options] : {std::pair<size_t, ClientOptions>{1000, SmallParts()},
                            std::pair<size_t, ClientOptions>{300000, ClientOptions()}}) {
    auto client = Connect(c, 0, options);
    const std::string key = "w" + std::to_string(n);
    std::vector<float> w(n, 100.0f), m(n, 0.0f), grad(n), got(n);
    ASSERT_THAT(client->Init({View(key, w)}), IsOk());
    for (int r = 1; r <= 6; ++r) {
      for (size_t j = 0; j < n; ++j) {
        grad[j] = static_cast<float>(static_cast<int>((j * 7 + r) % 5) - 2);
        m[j] = 0.5f * m[j] + grad[j];
        w[j] -= 0.25f * m[j];
      }
      ASSERT_THAT(client->PushPull({View(key, grad)}, {View(key, got)}), IsOk());
      ASSERT_EQ(got, w) << key << " after push " << r;
    }
    std::fill(got.begin(), got.end(), 0.0f);
    ASSERT_THAT(client->Pull({View(key, got)}), IsOk());
    EXPECT_EQ(got, w) << key;
  }
}

TEST(PsTest, HalfPrecisionTensorsKeepFloat32State) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  so.optimizer.kind = OptimizerKind::kSum;
  Cluster c = StartServers(1, so);
  auto client = Connect(c, 0);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    std::string key = DTypeName(dtype);
    auto to = dtype == DType::kFloat16 ? FloatToHalf : FloatToBFloat16;
    auto from = dtype == DType::kFloat16 ? HalfToFloat : BFloat16ToFloat;
    std::vector<uint16_t> init = {to(1.0f), to(-2.0f), to(0.5f)};
    std::vector<uint16_t> grad = {to(1.0f), to(1.0f), to(0.25f)};
    std::vector<uint16_t> got(3);
    ASSERT_THAT(client->Init({{key, TensorView(init.data(), dtype, {3})}}), IsOk());
    ASSERT_THAT(client->PushPull({{key, TensorView(grad.data(), dtype, {3})}},
                                 {{key, TensorView(got.data(), dtype, {3})}}),
                IsOk());
    EXPECT_EQ(from(got[0]), 2.0f);
    EXPECT_EQ(from(got[1]), -1.0f);
    EXPECT_EQ(from(got[2]), 0.75f);
  }
}

// The same keys in the same order go as one call per request (a push that
// replies with the values); other keys as a push and a pull: both exact.
TEST(PsTest, PushPullOfTheSameOrOtherKeys) {
  ServerOptions so;
  so.mode = Mode::kSync;
  so.reduction = Reduction::kSum;
  so.optimizer.kind = OptimizerKind::kSum;
  Cluster c = StartServers(2, so);
  auto client = Connect(c, 0, SmallParts());
  std::vector<float> w(1000, 1.0f), b(3, 5.0f), g(1000, 2.0f), gb(3, 1.0f);
  ASSERT_THAT(client->Init({View("w", w), View("b", b)}), IsOk());
  std::vector<float> got_w(1000), got_b(3);
  ASSERT_THAT(client->PushPull({View("w", g), View("b", gb)}, {View("w", got_w), View("b", got_b)}),
              IsOk());
  EXPECT_EQ(got_w, std::vector<float>(1000, 3.0f));
  EXPECT_EQ(got_b, std::vector<float>(3, 6.0f));
  // Pulling others than those pushed, and in another order.
  ASSERT_THAT(client->PushPull({View("w", g)}, {View("b", got_b), View("w", got_w)}), IsOk());
  EXPECT_EQ(got_w, std::vector<float>(1000, 5.0f));
  EXPECT_EQ(got_b, std::vector<float>(3, 6.0f));
}

TEST(PsTest, AsyncOpsCanBeWaitedWithATimeout) {
  ServerOptions so;
  so.num_workers = 2;  // sync: worker 0's pull waits for worker 1
  Cluster c = StartServers(1, so);
  auto w0 = Connect(c, 0);
  auto w1 = Connect(c, 1);
  std::vector<float> v = {1, 2, 3}, g0 = {2, 2, 2}, g1 = {4, 4, 4}, got(3);
  ASSERT_THAT(w0->Init({View("w", v)}), IsOk());
  ASSERT_THAT(w0->Push({View("w", g0)}), IsOk());
  auto pull = w0->PullAsync({View("w", got)});
  EXPECT_THAT(pull->Wait(std::chrono::milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_FALSE(pull->Done());
  ASSERT_THAT(w1->PushAsync({View("w", g1)})->Wait(), IsOk());
  ASSERT_THAT(pull->Wait(std::chrono::seconds(10)), IsOk());
  // mean of 2 and 4 is 3; sgd lr 0.01
  EXPECT_EQ(got, (std::vector<float>{1 - 0.01f * 3, 2 - 0.01f * 3, 3 - 0.01f * 3}));
}

// ---- bad input: each refused with a clear error; the server keeps
// serving and its values are unchanged.

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions so;
    so.num_workers = 2;
    so.mode = Mode::kAsync;
    so.optimizer.lr = 1.0;
    so.max_message_bytes = 64 << 10;
    cluster_ = StartServers(1, so);
    client_ = Connect(cluster_, 0);
    ASSERT_THAT(client_->Init({View("fc1.weight", values_)}), IsOk());
  }

  void ExpectUnchanged() {
    std::vector<float> got(values_.size());
    ASSERT_THAT(client_->Pull({View("fc1.weight", got)}), IsOk());
    EXPECT_EQ(got, values_);
  }

  std::vector<float> values_ = std::vector<float>(8192, 1.5f);
  Cluster cluster_;
  std::unique_ptr<Client> client_;
};

TEST_F(BadInputTest, PushWithWrongElementCount) {
  std::vector<float> grad(4096, 1.0f);
  EXPECT_THAT(client_->Push({View("fc1.weight", grad)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("push of \"fc1.weight\": got 4096 float32 values, "
                                 "the tensor has 8192")));
  ExpectUnchanged();
}

TEST_F(BadInputTest, PushWithWrongDtype) {
  std::vector<double> grad(8192, 1.0);
  EXPECT_THAT(client_->Push({{"fc1.weight", TensorView(grad.data(), DType::kFloat64, {8192})}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("got float64 values, the tensor is float32")));
  ExpectUnchanged();
}

TEST_F(BadInputTest, UnknownKeyAndPullBeforeInit) {
  std::vector<float> x(4);
  EXPECT_THAT(client_->Push({View("nope", x)}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\"")));
  EXPECT_THAT(client_->Pull({View("later", x)}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"later\"")));
  ExpectUnchanged();
}

TEST_F(BadInputTest, SecondInitWithAnotherShape) {
  std::vector<float> other(8192, 9.0f);
  EXPECT_THAT(
      client_->Init({{"fc1.weight", TensorView(other.data(), DType::kFloat32, {64, 128})}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("[64, 128] float32 differs from the existing [8192] float32")));
  // Same shape: a no-op, the first values stay.
  EXPECT_THAT(client_->Init({View("fc1.weight", other)}), IsOk());
  ExpectUnchanged();
}

// A claim is all or none: an init refused for one tensor (another shape
// than the existing one, or two shapes of one key) claims none of the
// others, which another worker then inits at once. One claimed and never
// written held every other init until its deadline.
TEST_F(BadInputTest, AnInitRefusedForOneTensorClaimsNoneOfTheOthers) {
  std::vector<float> fine(4, 2.0f), other(8192, 9.0f);
  EXPECT_THAT(
      client_->Init({View("n1", fine),
                     {"fc1.weight", TensorView(other.data(), DType::kFloat32, {64, 128})}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("init of \"fc1.weight\": [64, 128] float32 differs from the existing "
                         "[8192] float32")));
  EXPECT_THAT(client_->Init({View("n2", fine),
                             {"n2", TensorView(fine.data(), DType::kFloat32, {2, 2})}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("init of \"n2\": [2, 2] float32 differs from the existing "
                                 "[4] float32")));
  ClientOptions co;
  co.timeout = std::chrono::seconds(5);
  auto w1 = Connect(cluster_, 1, co);
  std::vector<float> mine(4, 3.0f);
  ASSERT_THAT(w1->Init({View("n1", mine), View("n2", mine)}), IsOk());
  for (const char* key : {"n1", "n2"}) {
    std::vector<float> got(4);
    ASSERT_THAT(client_->Pull({View(key, got)}), IsOk());
    EXPECT_EQ(got, mine) << key;
  }
  ExpectUnchanged();
}

// Checked before any claim: a null pointer used to win the claim and fail
// sending (UNAVAILABLE "Bad address"), leaving the key claimed and unset.
TEST_F(BadInputTest, InitWithNoDataOrANegativeDimensionClaimsNothing) {
  std::vector<float> fine(4, 2.0f);
  EXPECT_THAT(client_->Init({View("ok", fine), {"b", TensorView(nullptr, DType::kFloat32, {4})}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("init of \"b\": no data")));
  EXPECT_THAT(client_->Init({{"b", TensorView(fine.data(), DType::kFloat32, {-4})}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("init of \"b\": negative dimension -4")));
  // Neither key was claimed: a correct init of both goes through at once.
  ASSERT_THAT(client_->Init({View("ok", fine), View("b", fine)}), IsOk());
  std::vector<float> got(4);
  ASSERT_THAT(client_->Pull({View("b", got)}), IsOk());
  EXPECT_EQ(got, fine);
  ExpectUnchanged();
}

TEST_F(BadInputTest, WorkerIdOutOfRange) {
  ClientOptions co;
  co.servers = cluster_.addresses;
  co.worker_id = 2;
  EXPECT_THAT(Client::Create(co).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("worker_id 2 is outside 0..1")));
  ExpectUnchanged();
}

TEST_F(BadInputTest, MessageOverTheSizeLimit) {
  ClientOptions co;
  co.partition_bytes = 1 << 20;
  co.request_bytes = 1 << 20;
  auto big_client = Connect(cluster_, 1, co);
  std::vector<float> big(64 << 10, 1.0f);  // 256 KiB in one request
  EXPECT_THAT(big_client->Init({View("big", big)}),
              StatusIs(absl::StatusCode::kResourceExhausted));
  std::vector<float> grad(8192, 1.0f);
  EXPECT_THAT(big_client->Push({View("fc1.weight", grad)}), IsOk());
  std::vector<float> got(8192);
  ASSERT_THAT(client_->Pull({View("fc1.weight", got)}), IsOk());
  EXPECT_EQ(got, std::vector<float>(8192, 0.5f));  // still serving, lr 1
}

// A probe's partition_bytes=8 cut a 16 MiB tensor into 2^21 parts: its init
// took 21 s and 4 GB, and its push timed out. A tensor that would have more
// than kMaxParts parts is refused at init, naming the least partition_bytes
// that does.
TEST_F(BadInputTest, PartsSoSmallThatATensorWouldHaveTooManyAreRefusedAtInit) {
  ClientOptions co;
  co.partition_bytes = 8;
  auto tiny = Connect(cluster_, 1, co);
  std::vector<float> v(1 << 16, 1.0f);  // 256 KiB: 32768 parts of 8 bytes
  EXPECT_THAT(tiny->Init({View("v", v)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("init of \"v\": partition_bytes=8 would cut its 262144 bytes "
                                 "into more than 16384 parts, the most a tensor has; give "
                                 "partition_bytes >= 16")));
  ExpectUnchanged();
  tiny.reset();
  co.partition_bytes = 16;
  co.request_bytes = 8 << 10;  // the servers' max_message_bytes is 64 KiB
  EXPECT_THAT(Connect(cluster_, 1, co)->Init({View("v", v)}), IsOk());  // 16384 parts
}

TEST_F(BadInputTest, GarbledRequestBody) {
  auto channel = grpc::CreateChannel(cluster_.addresses[0],
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  for (const char* method : {"/deepnex.ps.proto.ParameterServer/Push",
                             "/deepnex.ps.proto.ParameterServer/Pull",
                             "/deepnex.ps.proto.ParameterServer/WriteParts"}) {
    std::string junk = "\x0a\xff\xff\xff\x0fgarbage";
    grpc::Slice slice(junk);
    grpc::ByteBuffer response;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status status =
        CallAndWait(stub, &ctx, method, grpc::ByteBuffer(&slice, 1), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(status.error_message(), HasSubstr("garbled")) << method;
  }
  ExpectUnchanged();
}

TEST_F(BadInputTest, NonFiniteGradientsAreRefusedByDefault) {
  std::vector<float> grad(8192, 1.0f);
  grad[17] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(client_->Push({View("fc1.weight", grad)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"fc1.weight\": the gradient holds NaN or Inf (element 17")));
  grad[17] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(client_->Push({View("fc1.weight", grad)}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectUnchanged();
}

TEST(PsTest, NonFiniteFoundAnywhereInALargeOrHalfPrecisionPush) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  Cluster c = StartServers(1, so);
  auto client = Connect(c, 0);
  // 1 M floats arrive in many slices; the bad one is near the end.
  std::vector<float> v(1 << 20, 0.0f), g(1 << 20, 1.0f);
  g[(1 << 20) - 3] = -std::numeric_limits<float>::infinity();
  ASSERT_THAT(client->Init({View("big", v)}), IsOk());
  EXPECT_THAT(client->Push({View("big", g)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("element 1048573 is NaN or Inf")));
  std::vector<uint16_t> h(5, FloatToHalf(1.0f)), hg(5, FloatToHalf(1.0f));
  hg[4] = 0x7e00;  // a half NaN
  ASSERT_THAT(client->Init({{"h", TensorView(h.data(), DType::kFloat16, {5})}}), IsOk());
  EXPECT_THAT(client->Push({{"h", TensorView(hg.data(), DType::kFloat16, {5})}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 4")));
  std::vector<float> got(1 << 20);
  ASSERT_THAT(client->Pull({View("big", got)}), IsOk());
  EXPECT_EQ(got, v);
}

// In sync mode a single-slice push is checked in the pass that adds it to
// the round (no pass of its own): a bad push, first or later into its
// round, must still leave the round as it was, so that the good pushes
// complete it exactly. Under both policies for dead workers' contributions
// (a running sum, or one buffer per worker).
class SyncNonFiniteTest : public ::testing::TestWithParam<bool> {};

TEST_P(SyncNonFiniteTest, RefusedPushLeavesTheRoundAsItWas) {
  ServerOptions so;
  so.mode = Mode::kSync;
  so.num_workers = 2;
  so.keep_dead_contributions = GetParam();
  so.reduction = Reduction::kSum;
  so.optimizer.kind = OptimizerKind::kSum;
  Cluster c = StartServers(1, so);
  auto c0 = Connect(c, 0);
  auto c1 = Connect(c, 1);
  // 1 M floats: one 4 MiB partition, whose push arrives in many spans.
  const size_t n = 1 << 20;
  std::vector<float> v(n, 0.0f), ones(n, 1.0f), twos(n, 2.0f), bad(n, 1.0f), got(n);
  bad[n - 3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint16_t> h(5, FloatToHalf(0.0f)), hg(5, FloatToHalf(1.0f)), hbad = hg, hgot(5);
  hbad[4] = 0x7c00;  // half +Inf
  auto half = [](std::vector<uint16_t>& x) {
    return NamedTensor{"h", TensorView(x.data(), DType::kFloat16, {5})};
  };
  ASSERT_THAT(c0->Init({View("big", v), half(h)}), IsOk());

  // Round 1: the bad push comes second, onto a sum already started.
  ASSERT_THAT(c0->Push({View("big", ones)}), IsOk());
  EXPECT_THAT(c1->Push({View("big", bad)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("push of \"big\": the gradient holds NaN or Inf (element "
                                 "1048573 is NaN or Inf); refused, nothing applied")));
  ASSERT_THAT(c1->Push({View("big", twos)}), IsOk());
  ASSERT_THAT(c0->Pull({View("big", got)}), IsOk());
  EXPECT_EQ(got, std::vector<float>(n, 3.0f));

  // Round 2: the bad push comes first, into an empty round.
  EXPECT_THAT(c0->Push({View("big", bad)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 1048573")));
  ASSERT_THAT(c0->Push({View("big", ones)}), IsOk());
  ASSERT_THAT(c1->Push({View("big", twos)}), IsOk());
  ASSERT_THAT(c1->Pull({View("big", got)}), IsOk());
  EXPECT_EQ(got, std::vector<float>(n, 6.0f));

  // Half precision goes through the conversion chunk: checked there too.
  ASSERT_THAT(c0->Push({half(hg)}), IsOk());
  EXPECT_THAT(c1->Push({half(hbad)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(element 4 is NaN or Inf)")));
  ASSERT_THAT(c1->Push({half(hg)}), IsOk());
  ASSERT_THAT(c0->Pull({half(hgot)}), IsOk());
  EXPECT_EQ(hgot, std::vector<uint16_t>(5, FloatToHalf(2.0f)));
}

INSTANTIATE_TEST_SUITE_P(Policies, SyncNonFiniteTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "KeepDead" : "DropDead"; });

TEST(PsTest, NonFiniteGradientsAreAppliedWhenAccepted) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  so.reject_nonfinite = false;
  so.optimizer.lr = 1.0;
  Cluster c = StartServers(1, so);
  auto client = Connect(c, 0);
  std::vector<float> v = {1, 2}, g = {std::numeric_limits<float>::infinity(), 1}, got(2);
  ASSERT_THAT(client->Init({View("w", v)}), IsOk());
  ASSERT_THAT(client->PushPull({View("w", g)}, {View("w", got)}), IsOk());
  EXPECT_TRUE(std::isinf(got[0]));
  EXPECT_EQ(got[1], 1.0f);
}

TEST(PsTest, TokensAreChecked) {
  ServerOptions so;
  so.token = "s3cret";
  Cluster c = StartServers(1, so);
  ClientOptions co;
  co.servers = c.addresses;
  EXPECT_THAT(Client::Create(co).status(),
              StatusIs(absl::StatusCode::kUnauthenticated));
  co.token = "wrong";
  EXPECT_THAT(Client::Create(co).status(),
              StatusIs(absl::StatusCode::kUnauthenticated));
  co.token = "s3cret";
  auto client = Client::Create(co);
  ASSERT_THAT(client.status(), IsOk());
  std::vector<float> v = {1, 2};
  EXPECT_THAT((*client)->Init({View("w", v)}), IsOk());
}

TEST(PsTest, JobScopedTokenOfAnotherJobIsPermissionDenied) {
  std::string path = ::testing::TempDir() + "/ps_tokens.txt";
  {
    std::ofstream f(path);
    f << "# token name role job\n"
         "tok-a alice user job-a\n"
         "tok-b bob user job-b\n";
  }
  ServerOptions so;
  so.token_file = path;
  so.job_id = "job-a";
  Cluster c = StartServers(1, so);
  ClientOptions co;
  co.servers = c.addresses;
  co.token = "tok-b";
  EXPECT_THAT(Client::Create(co).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  co.token = "tok-a";
  EXPECT_THAT(Client::Create(co).status(), IsOk());
  std::remove(path.c_str());
}

TEST(PsTest, ClosedClientRefusesCalls) {
  Cluster c = StartServers(1, {});
  auto client = Connect(c, 0);
  ASSERT_THAT(client->Close(), IsOk());
  std::vector<float> v = {1};
  EXPECT_THAT(client->Init({View("w", v)}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(PsTest, UnreachableServerIsUnavailableWithinTheTimeout) {
  ClientOptions co;
  co.servers = {"127.0.0.1:1"};
  co.timeout = std::chrono::milliseconds(500);
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(Client::Create(co).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("127.0.0.1:1")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// Options a C++ caller can set out of range are refused naming the field and
// the value (a probe's transport=42, retry_backoff=-1ms and a million
// connections per server were accepted).
TEST(PsTest, ClientOptionsOutOfRangeAreRefusedNamingThem) {
  ClientOptions o;
  o.servers = {"127.0.0.1:1"};
  ASSERT_OK(o.Validate());
  auto refused = [&](const std::string& what) {
    EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
    o = ClientOptions();
    o.servers = {"127.0.0.1:1"};
  };
  o.transport = static_cast<Transport>(42);
  refused("transport=42: not a Transport (auto, tcp, shm)");
  o.retry_backoff = std::chrono::milliseconds(-1);
  refused("retry_backoff=-1ms: must not be negative");
  o.connections_per_server = 1000000;
  refused("connections_per_server=1000000: must be 1..16");
  o.partition_bytes = 0;
  refused("partition_bytes=0: must be at least 8");
  o.timeout = std::chrono::milliseconds::max();  // the deadline wrapped: DeadlineExceeded at once
  refused("timeout=9223372036854775807ms: must be at most 1000000000000ms");
  o.retry_backoff = std::chrono::milliseconds::max();
  refused("retry_backoff=9223372036854775807ms: must be at most");
}

// A probe's lease_timeout=max expired every worker's lease at once, and
// mode=Mode(7) served a mode that does not exist.
TEST(PsTest, ServerOptionsOutOfRangeAreRefusedNamingThem) {
  auto refused = [](const ServerOptions& o, const std::string& what) {
    EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
  };
  ServerOptions o;
  o.lease_timeout = std::chrono::milliseconds::max();
  refused(o, "lease_timeout=9223372036854775807ms: must be at most 1000000000000ms");
  o = ServerOptions();
  o.mode = static_cast<Mode>(7);
  refused(o, "mode=7: not a Mode (sync, ssp, async)");
  o = ServerOptions();
  o.checkpoint_interval = std::chrono::milliseconds(-1);
  refused(o, "checkpoint_interval=-1ms: must be >= 0");
}

// An empty directory was Internal ("cannot create directory"), a negative
// timeout DeadlineExceeded "within -5 ms" (probe).
TEST(PsTest, ACheckpointWithoutADirectoryOrWithANegativeTimeoutIsRefused) {
  Cluster c = StartServers(1, {});
  EXPECT_THAT(c.servers[0]->Checkpoint("", std::chrono::seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "checkpoint: the directory is empty"));
  EXPECT_THAT(c.servers[0]->Checkpoint("/tmp", std::chrono::milliseconds(-5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "checkpoint: timeout=-5ms: must be >= 0"));
}

// After Stop no round completes: a checkpoint with a tensor behind waited
// its whole timeout (60 s by default) and then said DeadlineExceeded.
TEST(PsTest, ACheckpointAfterStopDoesNotWaitForRoundsThatCannotComplete) {
  ServerOptions so;
  so.num_workers = 2;
  Cluster c = StartServers(1, so);
  auto w0 = Connect(c, 0);
  auto w1 = Connect(c, 1);
  std::vector<float> v(4, 1.0f);
  ASSERT_THAT(w0->Init({View("a", v), View("b", v)}), IsOk());
  // "a" completes round 1; "b" waits for worker 0's push, which never comes.
  ASSERT_THAT(w0->Push({View("a", v)}), IsOk());
  ASSERT_THAT(w1->Push({View("a", v), View("b", v)}), IsOk());
  ASSERT_THAT(w0->Pull({View("a", v)}), IsOk());
  const std::string dir = ::testing::TempDir() + "/ps_checkpoint_after_stop";
  c.servers[0]->Stop();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(c.servers[0]->Checkpoint(dir, std::chrono::seconds(30)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("\"b\" part 0 did not reach round 1 within 0 ms; the server "
                                 "is stopped and completes no more rounds")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  std::filesystem::remove_all(dir);
}

// milliseconds::max(), C++'s "no limit", waits: it overflowed into a
// deadline already past, DeadlineExceeded at once (probe).
TEST(PsTest, AWaitOfMillisecondsMaxWaitsForTheOp) {
  ServerOptions so;
  so.num_workers = 2;  // sync: worker 0's pull waits for worker 1
  Cluster c = StartServers(1, so);
  auto w0 = Connect(c, 0);
  auto w1 = Connect(c, 1);
  std::vector<float> v = {1, 2, 3}, g = {2, 2, 2}, got(3);
  ASSERT_OK(w0->Init({View("w", v)}));
  ASSERT_OK(w0->Push({View("w", g)}));
  auto pull = w0->PullAsync({View("w", got)});
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_OK(w1->Push({View("w", g)}));
  });
  EXPECT_OK(pull->Wait(std::chrono::milliseconds::max()));
  late.join();
  EXPECT_EQ(got, (std::vector<float>{1 - 0.01f * 2, 2 - 0.01f * 2, 3 - 0.01f * 2}));
}

// Close ends what is in flight before it returns: a probe's async push went
// on reading the caller's gradient until its deadline, 3 s after Close said
// OK (a use after free once the caller let the gradient go).
// Over gRPC, the bulk TCP connection and shared memory.
class CloseTest : public ::testing::TestWithParam<std::pair<Transport, bool>> {};

TEST_P(CloseTest, CloseEndsTheOpsInFlightBeforeItReturns) {
  ServerOptions so;
  so.num_workers = 2;  // sync: worker 0's round waits for worker 1, who never comes
  so.bulk_tcp = GetParam().second;
  Cluster c = StartServers(1, so);
  ClientOptions co;
  co.transport = GetParam().first;
  co.timeout = std::chrono::seconds(60);
  auto w0 = Connect(c, 0, co);
  std::vector<float> v = {1, 2, 3}, g = {2, 2, 2}, got(3);
  ASSERT_OK(w0->Init({View("w", v)}));
  auto op = w0->PushPullAsync({View("w", g)}, {View("w", got)});
  ASSERT_FALSE(op->Done());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_OK(w0->Close());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_TRUE(op->Done());
  absl::Status s = op->Wait(std::chrono::milliseconds(0));
  EXPECT_FALSE(s.ok());
  // Nothing promises to go again after a Close.
  EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("goes again, exactly once")));
}

INSTANTIATE_TEST_SUITE_P(Transports, CloseTest,
                         ::testing::Values(std::make_pair(Transport::kTcp, false),
                                           std::make_pair(Transport::kTcp, true),
                                           std::make_pair(Transport::kShm, true)));

}  // namespace
}  // namespace deepnex::ps
