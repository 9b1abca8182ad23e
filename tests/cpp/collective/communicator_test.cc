// Ranks run as threads over a StoreServer on 127.0.0.1; inputs are
// integer-valued so every result is exact.
#include "deepnex/collective/communicator.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "collective/cpu_wire.h"
#include "collective/reduce.h"
#include "deepnex/collective/store.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::collective {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::AnyOf;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using std::chrono::milliseconds;

const DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16,
                         DType::kBFloat16, DType::kInt32, DType::kInt64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin,
                         ReduceOp::kProd};

// Values are kept as doubles and stored in the tensor's dtype.
void Store(DType d, void* base, size_t i, double v) {
  char* p = static_cast<char*>(base);
  switch (d) {
    case DType::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kFloat64: reinterpret_cast<double*>(p)[i] = v; break;
    case DType::kFloat16: reinterpret_cast<uint16_t*>(p)[i] = FloatToHalf(static_cast<float>(v)); break;
    case DType::kBFloat16:
      reinterpret_cast<uint16_t*>(p)[i] = FloatToBFloat16(static_cast<float>(v));
      break;
    case DType::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::kInt64: reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    default: break;
  }
}

double Load(DType d, const void* base, size_t i) {
  const char* p = static_cast<const char*>(base);
  switch (d) {
    case DType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DType::kFloat64: return reinterpret_cast<const double*>(p)[i];
    case DType::kFloat16: return HalfToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return BFloat16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::kInt32: return reinterpret_cast<const int32_t*>(p)[i];
    case DType::kInt64: return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    default: return NAN;
  }
}

// What the tensor's dtype makes of `v` (rounding), read back as a double.
double Round(DType d, double v) {
  char buf[8];
  Store(d, buf, 0, v);
  return Load(d, buf, 0);
}

double Input(ReduceOp op, int rank, size_t i) {
  if (op == ReduceOp::kProd) return static_cast<double>((i + rank) % 3 + 1);
  double v = static_cast<double>((i * 7 + rank * 3) % 11) + rank;
  return (i % 2) ? -v : v;
}

double Expected(DType d, ReduceOp op, int n, size_t i) {
  double acc = Input(op, 0, i);
  for (int r = 1; r < n; ++r) {
    double v = Input(op, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
    }
  }
  if (op == ReduceOp::kMean) {
    if (d == DType::kInt32 || d == DType::kInt64) return std::trunc(acc / n);
    if (d == DType::kFloat64) return acc / n;
    return Round(d, static_cast<float>(acc) / static_cast<float>(n));
  }
  return acc;
}

class CommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StoreServer::Create({});
    ASSERT_THAT(server, IsOk());
    store_ = std::move(*server);
  }

  CommunicatorOptions Options(int rank, int n, const std::string& prefix) {
    CommunicatorOptions o;
    o.rank = rank;
    o.world_size = n;
    o.store_address = store_->address();
    o.prefix = prefix;
    o.timeout = milliseconds(20000);
    return o;
  }

  // Creates `n` communicators concurrently (as ranks must) and runs `body`
  // on each rank's thread.
  void RunRanks(int n, const std::function<void(int, Communicator&)>& body,
                const std::function<void(CommunicatorOptions&)>& tweak = nullptr) {
    const std::string prefix = absl::StrCat("t", counter_++);
    ::deepnex::test::RunRanks(n, [&](int r) {
      CommunicatorOptions o = Options(r, n, prefix);
      if (tweak) tweak(o);
      auto comm = Communicator::Create(o);
      ASSERT_THAT(comm, IsOk()) << "rank " << r;
      body(r, **comm);
    });
  }

  std::unique_ptr<StoreServer> store_;
  int counter_ = 0;
};

TEST_F(CommunicatorTest, AllReduceEveryDTypeOpAndSize) {
  const size_t sizes[] = {0, 1, 2, 7, 13, 1021, 65537};
  for (int n = 1; n <= 4; ++n) {
    RunRanks(n, [&](int rank, Communicator& comm) {
      for (DType d : kDTypes) {
        for (ReduceOp op : kOps) {
          for (size_t count : sizes) {
            std::vector<char> buf(count * DTypeSize(d) + 1);
            for (size_t i = 0; i < count; ++i) Store(d, buf.data(), i, Input(op, rank, i));
            TensorView t(buf.data(), d, {static_cast<int64_t>(count)});
            ASSERT_OK(comm.AllReduce(t, op)) << DTypeName(d) << " " << ReduceOpName(op);
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(Load(d, buf.data(), i), Expected(d, op, n, i))
                  << "world " << n << " rank " << rank << " " << DTypeName(d) << " "
                  << ReduceOpName(op) << " count " << count << " element " << i;
            }
          }
        }
      }
    });
  }
}

TEST_F(CommunicatorTest, LargeAllReduceOverBothTransports) {
  const size_t count = (64ull << 20) / 4 + 3;  // 64 MiB and a bit, float32
  for (const char* transport : {"tcp", "shm"}) {
    RunRanks(
        2,
        [&](int rank, Communicator& comm) {
          EXPECT_EQ(comm.transport(), transport);
          std::vector<float> x(count);
          for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>((i % 1000) * (rank + 1));
          ASSERT_OK(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {int64_t(count)}),
                                   ReduceOp::kSum));
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(x[i], static_cast<float>((i % 1000) * 3)) << i;
          }
        },
        [&](CommunicatorOptions& o) {
          o.transport = *ParseTransport(transport);
          // Two stripes: with shm_channels = 0 two ranks on a 2-CPU host get one,
          // which the other shm tests cover.
          o.shm_channels = 2;
        });
  }
}

long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

TEST_F(CommunicatorTest, TheFirstPassThroughTheShmRingsTakesNoPageFaults) {
  // 100 allreduces of 8 KiB move 800 KiB each way through rings of 1 MiB,
  // touching each of their pages for the first time: unpopulated, that is a
  // fault per page on each side, over 400 in all.
  long before = 0, after = 0;
  RunRanks(
      2,
      [&](int rank, Communicator& comm) {
        std::vector<float> x(2048, 1.0f);
        ASSERT_OK(comm.Barrier());
        if (rank == 0) before = MinorFaults();
        ASSERT_OK(comm.Barrier());
        for (int i = 0; i < 100; ++i) {
          ASSERT_OK(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {2048})));
        }
        ASSERT_OK(comm.Barrier());
        if (rank == 0) after = MinorFaults();
      },
      [](CommunicatorOptions& o) { o.transport = Transport::kShm; });
  EXPECT_LT(after - before, 100);
}

// A probe's [nan, 1] and [1, nan] gave max [nan, 1]: a NaN counted only on
// the rank whose buffer it was reduced into.
TEST(ReduceTest, MaxAndMinKeepANaNFromEitherSide) {
  const float nan = std::nanf("");
  for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    float dst[3] = {nan, 1, 2}, src[3] = {1, nan, 3};
    ReduceInto(DType::kFloat32, op, reinterpret_cast<char*>(dst),
               reinterpret_cast<const char*>(src), 3);
    EXPECT_TRUE(std::isnan(dst[0]) && std::isnan(dst[1]));
    EXPECT_EQ(dst[2], op == ReduceOp::kMax ? 3.0f : 2.0f);
    double ddst[2] = {1, std::nan("")}, dsrc[2] = {std::nan(""), -1};
    ReduceInto(DType::kFloat64, op, reinterpret_cast<char*>(ddst),
               reinterpret_cast<const char*>(dsrc), 2);
    EXPECT_TRUE(std::isnan(ddst[0]) && std::isnan(ddst[1]));
    // bfloat16 1.0 and a NaN.
    uint16_t bdst[2] = {0x3f80, 0x7fc0}, bsrc[2] = {0x7fc0, 0x3f80};
    ReduceInto(DType::kBFloat16, op, reinterpret_cast<char*>(bdst),
               reinterpret_cast<const char*>(bsrc), 2);
    EXPECT_EQ(bdst[0] & 0x7fc0, 0x7fc0);
    EXPECT_EQ(bdst[1] & 0x7fc0, 0x7fc0);
    int32_t idst[2] = {-5, 7}, isrc[2] = {3, -9};
    ReduceInto(DType::kInt32, op, reinterpret_cast<char*>(idst),
               reinterpret_cast<const char*>(isrc), 2);
    EXPECT_EQ(idst[0], op == ReduceOp::kMax ? 3 : -5);
    EXPECT_EQ(idst[1], op == ReduceOp::kMax ? 7 : -9);
  }
}

TEST(ShmStripesTest, AnExplicitCountIsKeptAndAutoGivesEachRankItsShareOfTheCpus) {
  auto ranks = [](std::vector<std::string> masks) {
    std::vector<RankInfo> infos(masks.size());
    for (size_t i = 0; i < masks.size(); ++i) infos[i].cpus = masks[i];
    return infos;
  };
  EXPECT_EQ(ShmStripes(3, ranks({"1", "1"})), 3);
  EXPECT_EQ(ShmStripes(0, ranks({"3", "3"})), 1);          // 2 CPUs shared by 2 ranks
  EXPECT_EQ(ShmStripes(0, ranks({"1", "1", "1"})), 1);     // never below one
  EXPECT_EQ(ShmStripes(0, ranks({"F", "f"})), 2);          // 4 CPUs
  EXPECT_EQ(ShmStripes(0, ranks({"ffff", "ffff"})), kAutoShmChannels);
  EXPECT_EQ(ShmStripes(0, ranks({"3", "c"})), 2);          // pinned apart: 4 CPUs in all
  EXPECT_EQ(ShmStripes(0, ranks({"10000", "3", "4"})), 1);  // CPUs 0-2 and 16: 4 for 3 ranks
}

TEST(ShmStripesTest, ARankPublishingAGarbledCpuMaskIsRefusedNamingIt) {
  ASSERT_OK_AND_ASSIGN(RankInfo info,
                       Decode(1, "10.77.0.2 4000 host-a /deepnex-coll-1 7 3f 2"));
  EXPECT_EQ(info.cpus, "3f");
  EXPECT_EQ(info.world_size, 2);
  for (const char* bad : {"10.77.0.2 4000 host-a - 7 3g 2", "10.77.0.2 4000 host-a - 7  2",
                          "10.77.0.2 4000 host-a - 7 3f", "10.77.0.2 4000 host-a - 7 3f x"}) {
    EXPECT_THAT(Decode(1, bad), StatusIs(absl::StatusCode::kInternal,
                                         HasSubstr("rank 1 published a garbled address")))
        << bad;
  }
}

TEST_F(CommunicatorTest, TransportsForcedAndSegmentsRemoved) {
  for (const char* transport : {"tcp", "shm"}) {
    for (int n : {2, 3}) {
      RunRanks(
          n,
          [&](int rank, Communicator& comm) {
            EXPECT_EQ(comm.transport(), transport);
            std::vector<int64_t> x(300001, rank + 1);
            ASSERT_OK(comm.AllReduce(TensorView(x.data(), DType::kInt64, {int64_t(x.size())}),
                                     ReduceOp::kSum));
            for (int64_t v : x) ASSERT_EQ(v, n * (n + 1) / 2);
          },
          [&](CommunicatorOptions& o) {
            o.transport = *ParseTransport(transport);
            o.shm_buffer_bytes = 64 << 10;  // many wrap-arounds
          });
    }
  }
  // Nothing of ours is left in /dev/shm.
  std::string mine = absl::StrCat("deepnex-coll-", getpid(), "-");
  DIR* dir = opendir("/dev/shm");
  ASSERT_NE(dir, nullptr);
  while (dirent* e = readdir(dir)) {
    EXPECT_NE(std::string(e->d_name).rfind(mine, 0), 0u) << e->d_name;
  }
  closedir(dir);
}

TEST_F(CommunicatorTest, BroadcastAllGatherReduceScatter) {
  for (int n = 1; n <= 4; ++n) {
    RunRanks(n, [&](int rank, Communicator& comm) {
      for (DType d : kDTypes) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{1031}, size_t{200003}}) {
          const size_t es = DTypeSize(d);
          // broadcast from every root
          for (int root = 0; root < n; ++root) {
            std::vector<char> b(count * es + 1);
            for (size_t i = 0; i < count; ++i) Store(d, b.data(), i, rank == root ? (i % 50) + root : -1);
            ASSERT_OK(comm.Broadcast(TensorView(b.data(), d, {int64_t(count)}), root));
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(Load(d, b.data(), i), double((i % 50) + root)) << DTypeName(d) << " " << i;
            }
          }
          // allgather
          std::vector<char> in(count * es + 1), out(n * count * es + 1);
          for (size_t i = 0; i < count; ++i) Store(d, in.data(), i, (i % 13) + 20 * rank);
          ASSERT_OK(comm.AllGather(TensorView(in.data(), d, {int64_t(count)}),
                                   TensorView(out.data(), d, {n, int64_t(count)})));
          for (int r = 0; r < n; ++r) {
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(Load(d, out.data(), r * count + i), double((i % 13) + 20 * r));
            }
          }
          // reduce_scatter: block b of rank r holds b + r + (i % 5)
          std::vector<char> rin(n * count * es + 1), rout(count * es + 1);
          for (int b = 0; b < n; ++b) {
            for (size_t i = 0; i < count; ++i) Store(d, rin.data(), b * count + i, b + rank + (i % 5));
          }
          std::vector<char> before = rin;
          ASSERT_OK(comm.ReduceScatter(TensorView(rin.data(), d, {int64_t(n * count)}),
                                       TensorView(rout.data(), d, {int64_t(count)}),
                                       ReduceOp::kSum));
          EXPECT_EQ(before, rin);  // the input is left alone
          for (size_t i = 0; i < count; ++i) {
            double want = 0;
            for (int r = 0; r < n; ++r) want += rank + r + (i % 5);
            ASSERT_EQ(Load(d, rout.data(), i), want) << DTypeName(d) << " " << i;
          }
        }
      }
      ASSERT_OK(comm.Barrier());
    });
  }
}

TEST_F(CommunicatorTest, AsyncCollectivesRunInOrder) {
  RunRanks(3, [&](int rank, Communicator& comm) {
    std::vector<std::vector<float>> xs(8, std::vector<float>(10007));
    std::vector<std::shared_ptr<Work>> works;
    for (size_t k = 0; k < xs.size(); ++k) {
      for (auto& v : xs[k]) v = static_cast<float>(k + rank);
      works.push_back(comm.AllReduceAsync(
          TensorView(xs[k].data(), DType::kFloat32, {int64_t(xs[k].size())}), ReduceOp::kSum));
    }
    works.push_back(comm.BarrierAsync());
    for (auto& w : works) ASSERT_OK(w->Wait(milliseconds(20000)));
    for (size_t k = 0; k < xs.size(); ++k) {
      for (float v : xs[k]) ASSERT_EQ(v, static_cast<float>(3 * k + 3));
    }
    EXPECT_TRUE(works.back()->Done());
  });
}

TEST_F(CommunicatorTest, MismatchedCallsFailOnEveryRankAndLeaveItUsable) {
  RunRanks(3, [&](int rank, Communicator& comm) {
    std::vector<float> x(100 + (rank == 1 ? 1 : 0), 1.0f);
    EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {int64_t(x.size())})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 1: allreduce of 101")));
    std::vector<int32_t> y(100, 1);
    DType d = rank == 2 ? DType::kFloat32 : DType::kInt32;
    EXPECT_THAT(comm.AllReduce(TensorView(y.data(), d, {100})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("disagree")));
    // A different collective on one rank.
    absl::Status s = rank == 0 ? comm.Broadcast(TensorView(y.data(), DType::kInt32, {100}), 0)
                               : comm.AllReduce(TensorView(y.data(), DType::kInt32, {100}));
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("broadcast")));
    // A locally invalid call (bad root) fails everywhere too.
    EXPECT_THAT(comm.Broadcast(TensorView(y.data(), DType::kInt32, {100}), rank == 0 ? 7 : 0),
                StatusIs(absl::StatusCode::kInvalidArgument));
    // Still usable.
    ASSERT_OK(comm.AllReduce(TensorView(y.data(), DType::kInt32, {100})));
    EXPECT_EQ(y[0], 3);
  });
}

// A shape with a negative dimension (or past 2^63 bytes) and an op that is
// no ReduceOp are refused on every rank, on the pair, small and ring paths
// and alone: a probe's {-8} crashed in memcpy, and op 99 returned rank 0's
// data as the "result".
TEST_F(CommunicatorTest, ANegativeDimensionOrUnknownOpFailsEveryRankAndLeavesItUsable) {
  for (int n : {1, 2, 3}) {
    RunRanks(n, [&](int rank, Communicator& comm) {
      std::vector<float> x(8, float(rank + 1));
      const std::vector<int64_t> bad = rank == n - 1 ? std::vector<int64_t>{-8}
                                                     : std::vector<int64_t>{8};
      // The other ranks hear which rank's call was invalid.
      EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, bad)),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr(rank == n - 1 ? "negative dimension -8 in [-8] float32"
                                                   : "invalid arguments on rank")));
      EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {int64_t{1} << 62, 4})),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 2^63 bytes")));
      EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {8}),
                                 static_cast<ReduceOp>(99)),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("op 99 is not a ReduceOp")));
      std::vector<float> big(20000, float(rank + 1));  // the ring, past the small path
      EXPECT_THAT(comm.ReduceScatter(TensorView(big.data(), DType::kFloat32, {20000}),
                                     TensorView(big.data(), DType::kFloat32, {-1})),
                  StatusIs(absl::StatusCode::kInvalidArgument));
      EXPECT_EQ(x[0], float(rank + 1)) << "a refused call changed the data";
      ASSERT_OK(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {8})));
      EXPECT_EQ(x[7], float(n * (n + 1) / 2));
    });
  }
}

// Up to 64 KiB among up to 8 ranks, allreduce folds the data into the
// header exchange; a rank on that path and one on the ring must still fail
// together and leave the streams in step.
TEST_F(CommunicatorTest, SmallAndLargeDisagreeingFailEveryRankAndLeaveItUsable) {
  RunRanks(3, [&](int rank, Communicator& comm) {
    std::vector<float> x(rank == 1 ? 20000 : 100, 1.0f);  // 80 KB against 400 B
    EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {int64_t(x.size())})),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("rank 1: allreduce of 20000 float32")));
    std::vector<float> y(100, 1.0f);
    ASSERT_OK(comm.AllReduce(TensorView(y.data(), DType::kFloat32, {100})));
    EXPECT_EQ(y[99], 3.0f);
  });
}

// Two ranks reduce a sum, mean or prod of up to 1 MiB straight from the link;
// with payloads larger than a ring, only data already sent may be
// overwritten, and neither rank may wait for the other to finish sending.
TEST_F(CommunicatorTest, TwoRankSmallAllReduceThroughATinyRing) {
  // 64 KiB and 1 MiB of float32: 16 and 256 rings' worth.
  const size_t counts[] = {(64 << 10) / 4, (1 << 20) / 4};
  for (const char* transport : {"shm", "tcp"}) {
    RunRanks(
        2,
        [&](int rank, Communicator& comm) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kProd}) {
            for (size_t count : counts) {
              std::vector<char> buf(count * 4);
              for (size_t i = 0; i < count; ++i) {
                Store(DType::kFloat32, buf.data(), i, Input(op, rank, i));
              }
              ASSERT_OK(
                  comm.AllReduce(TensorView(buf.data(), DType::kFloat32, {int64_t(count)}), op));
              for (size_t i = 0; i < count; ++i) {
                ASSERT_EQ(Load(DType::kFloat32, buf.data(), i),
                          Expected(DType::kFloat32, op, 2, i))
                    << transport << " rank " << rank << " " << ReduceOpName(op) << " count "
                    << count << " element " << i;
              }
            }
          }
        },
        [&](CommunicatorOptions& o) {
          o.transport = *ParseTransport(transport);
          o.shm_buffer_bytes = 4096;
        });
  }
}

TEST_F(CommunicatorTest, TwoRankSmallMismatchLeavesBothTensorsUntouched) {
  RunRanks(2, [&](int rank, Communicator& comm) {
    // Rank 0 on the two-rank path (sum), rank 1 on the general one (max).
    std::vector<float> x(100, static_cast<float>(rank + 1));
    EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {100}),
                               rank == 0 ? ReduceOp::kSum : ReduceOp::kMax),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("disagree")));
    EXPECT_EQ(x, std::vector<float>(100, static_cast<float>(rank + 1)));
    // Both on the two-rank path, different sizes.
    std::vector<float> y(rank == 0 ? 100 : 200, static_cast<float>(rank + 1));
    EXPECT_THAT(comm.AllReduce(TensorView(y.data(), DType::kFloat32, {int64_t(y.size())})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 1: allreduce of 200")));
    EXPECT_EQ(y, std::vector<float>(y.size(), static_cast<float>(rank + 1)));
    // Rank 1 past the two-rank path's 1 MiB, on the ring.
    std::vector<float> z(rank == 0 ? 100 : (1 << 18) + 1, static_cast<float>(rank + 1));
    EXPECT_THAT(comm.AllReduce(TensorView(z.data(), DType::kFloat32, {int64_t(z.size())})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("disagree")));
    EXPECT_EQ(z, std::vector<float>(z.size(), static_cast<float>(rank + 1)));
    ASSERT_OK(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {100})));
    EXPECT_EQ(x[99], 3.0f);
  });
}

TEST_F(CommunicatorTest, SmallAllReduceUpToEightRanksAndPast) {
  for (int n : {8, 9}) {  // 9 ranks take the ring
    RunRanks(n, [&](int rank, Communicator& comm) {
      for (size_t count : {size_t{1}, size_t{1021}, size_t{16384}}) {
        std::vector<int64_t> x(count);
        for (size_t i = 0; i < count; ++i) x[i] = static_cast<int64_t>(i) * (rank + 1);
        ASSERT_OK(comm.AllReduce(TensorView(x.data(), DType::kInt64, {int64_t(count)})));
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(x[i], static_cast<int64_t>(i) * n * (n + 1) / 2)
              << "world " << n << " rank " << rank << " count " << count << " element " << i;
        }
      }
    });
  }
}

TEST_F(CommunicatorTest, RankLeavingBetweenSmallCollectivesFailsTheOther) {
  for (const char* transport : {"tcp", "shm"}) {
    RunRanks(
        2,
        [&](int rank, Communicator& comm) {
          std::vector<float> x(256, 1.0f);
          TensorView t(x.data(), DType::kFloat32, {256});
          if (rank == 1) {
            for (int i = 0; i < 50; ++i) ASSERT_OK(comm.AllReduce(t));
            comm.Abort();  // as if the process died: its connections close
            return;
          }
          auto start = std::chrono::steady_clock::now();
          absl::Status s;
          for (int i = 0; i < 1000 && s.ok(); ++i) s = comm.AllReduce(t);
          EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted))
              << transport << ": " << s;
          EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(10000));
        },
        [&](CommunicatorOptions& o) { o.transport = *ParseTransport(transport); });
  }
}

// Destroying a communicator with a collective in flight ends it at once,
// Aborted, as Abort does: a probe's destructor waited out the timeout.
TEST_F(CommunicatorTest, DestroyingACommunicatorEndsItsCollectiveInFlight) {
  std::vector<std::unique_ptr<Communicator>> comms(2);
  ::deepnex::test::RunRanks(2, [&](int r) {
    auto comm = Communicator::Create(Options(r, 2, "destroyed"));  // 20 s timeout
    ASSERT_THAT(comm, IsOk());
    comms[r] = std::move(*comm);
  });
  std::vector<float> x(1 << 20, 1.0f);
  // Rank 1 never joins.
  std::shared_ptr<Work> work =
      comms[0]->AllReduceAsync(TensorView(x.data(), DType::kFloat32, {1 << 20}), ReduceOp::kSum);
  std::this_thread::sleep_for(milliseconds(100));
  const auto start = std::chrono::steady_clock::now();
  comms[0].reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5000));
  EXPECT_THAT(work->Wait(), StatusIs(absl::StatusCode::kAborted, HasSubstr("aborted")));
  // Its peer learns it left.
  EXPECT_FALSE(comms[1]->AllReduce(TensorView(x.data(), DType::kFloat32, {1 << 20})).ok());
}

TEST_F(CommunicatorTest, MissingRankAtInitIsDeadlineExceededNamingIt) {
  ::deepnex::test::RunRanks(2, [&](int r) {
    CommunicatorOptions o = Options(r, 4, "missing");
    o.timeout = milliseconds(1000);
    auto start = std::chrono::steady_clock::now();
    auto comm = Communicator::Create(o);
    EXPECT_THAT(comm, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank 2, 3")));
    EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(4000));
  });
}

// A rank whose timeout ran out first takes its keys back: a rank still
// waiting named it as never come (CI: "rank 0, 2, 3" for two ranks that
// failed together), and as a generation apart.
TEST_F(CommunicatorTest, ARankThatGaveUpFirstIsNamedAsComeAndGone) {
  const std::string store = store_->address();
  ::deepnex::test::RunRanks(2, [&](int r) {
    CommunicatorOptions o = Options(r, 3, "gave-up");
    o.timeout = milliseconds(r == 0 ? 300 : 1500);
    EXPECT_THAT(Communicator::Create(o),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         r == 0 ? EndsWith(": rank 2 did not arrive at the store " + store +
                                           " within 300 ms")
                                : EndsWith(": rank 2 did not arrive at the store " + store +
                                           " within 1500 ms; rank 0 came and left again (its "
                                           "own start failed first)")));
  });
  // Rank 1 comes after rank 0 gave up, or tries again alone: rank 0 is not
  // there this time (a probe's retry named it as come and gone), nor
  // waiting under another generation.
  CommunicatorOptions o = Options(0, 2, "too-late");
  o.timeout = milliseconds(300);
  EXPECT_THAT(Communicator::Create(o), StatusIs(absl::StatusCode::kDeadlineExceeded));
  o.rank = 1;
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_THAT(Communicator::Create(o),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         EndsWith(": rank 0 did not arrive at the store " + store +
                                  " within 300 ms")));
  }
}

// A rank killed while starting keeps its join: started again, it waits a
// generation ahead of the others. A probe's restarted rank that waited
// longest said only "rank 0, 2 did not arrive": they had come, under the
// generation behind, and gone.
TEST_F(CommunicatorTest, RanksAGenerationApartAreToldSoEitherWay) {
  StoreClientOptions so;
  so.address = store_->address();
  so.prefix = "killed";
  ASSERT_OK_AND_ASSIGN(auto store, StoreClient::Create(so));
  ASSERT_OK(store->Add("c_gen/1", 1).status());  // rank 1's first start, killed
  const std::string apart = " time(s) and this rank ";
  ::deepnex::test::RunRanks(3, [&](int r) {
    CommunicatorOptions o = Options(r, 3, "killed");
    o.timeout = milliseconds(r == 1 ? 1500 : 500);
    EXPECT_THAT(Communicator::Create(o),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         HasSubstr(r == 1 ? "(it has joined \"killed\" 1" + apart + "2: they wait "
                                            "under different generations"
                                          : "(it has joined \"killed\" 2" + apart + "1: they wait "
                                            "under different generations")))
        << "rank " << r;
  });
}

TEST_F(CommunicatorTest, RankLeavingMidCollectiveFailsTheOthersQuickly) {
  for (const char* transport : {"tcp", "shm"}) {
    RunRanks(
        3,
        [&](int rank, Communicator& comm) {
          std::vector<float> x(4 << 20, 1.0f);
          TensorView t(x.data(), DType::kFloat32, {int64_t(x.size())});
          if (rank == 2) {
            auto work = comm.AllReduceAsync(t, ReduceOp::kSum);
            std::this_thread::sleep_for(milliseconds(5));
            comm.Abort();  // as if the process died: its connections close
            EXPECT_THAT(work->Wait(), StatusIs(absl::StatusCode::kAborted));
            return;
          }
          auto start = std::chrono::steady_clock::now();
          absl::Status s = comm.AllReduce(t, ReduceOp::kSum);
          // A rank may also have finished before the abort reached it; then
          // the next collective fails.
          if (s.ok()) s = comm.AllReduce(t, ReduceOp::kSum);
          EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted))
              << s;
          EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(10000));
          EXPECT_THAT(comm.Barrier(), StatusIs(absl::StatusCode::kAborted));
        },
        [&](CommunicatorOptions& o) { o.transport = *ParseTransport(transport); });
  }
}

// In a ring, a rank's failure spreads rank by rank: a probe's rank 0, two
// hops from a killed rank 2, said only "rank 3 closed the connection",
// blaming a healthy rank. Each rank that breaks off records why in the
// store, and its neighbours say where the failure began.
TEST_F(CommunicatorTest, ARankFarFromAFailureSaysWhereItBegan) {
  for (const char* transport : {"tcp", "shm"}) {
    std::atomic<int> waiting{0};
    RunRanks(
        4,
        [&](int rank, Communicator& comm) {
          std::vector<float> x(1 << 20, 1.0f);
          TensorView t(x.data(), DType::kFloat32, {int64_t(x.size())});
          if (rank == 2) {
            // Once the others are in their collective: never one in flight.
            ASSERT_TRUE(WaitFor([&] { return waiting.load() == 3; }, milliseconds(60000),
                                "the other ranks' AllReduce"));
            std::this_thread::sleep_for(milliseconds(50));
            comm.Abort();  // as if the process died: its connections close
            return;
          }
          auto work = comm.AllReduceAsync(t, ReduceOp::kSum);
          ++waiting;
          absl::Status s = work->Wait();
          EXPECT_THAT(s.code(), absl::StatusCode::kUnavailable) << transport << " " << s;
          // Two hops away, rank 0 learns it from a neighbour that broke off.
          EXPECT_THAT(std::string(s.message()),
                      ::testing::ContainsRegex(rank == 0 ? "; the failure began elsewhere: .*rank 2"
                                                       : "rank 2"))
              << transport << " rank " << rank;
          EXPECT_THAT(comm.Barrier(), StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 2")));
        },
        [&](CommunicatorOptions& o) { o.transport = *ParseTransport(transport); });
  }
}

// With the store gone, each rank asked it why its neighbour broke off, for
// 2-3 s, before breaking off in turn: a probe's ring of 5 learned of a
// killed rank 2-8 s late, later than a short timeout; over shared memory
// with the store stopped, 0.7 s a rank.
TEST_F(CommunicatorTest, AFailureGoesRoundTheRingAlsoWithTheStoreGone) {
  for (const char* transport : {"tcp", "shm"}) {
    SetUp();  // a store for this round
    std::atomic<int> ready{0};
    std::atomic<bool> store_gone{false};
    RunRanks(
        8,
        [&](int rank, Communicator& comm) {
          if (++ready == 8) {
            store_.reset();
            store_gone = true;
          }
          ASSERT_TRUE(WaitFor([&] { return store_gone.load(); }, milliseconds(60000),
                              "the store to stop"));
          if (rank == 2) {
            comm.Abort();  // as if the process died: its connections close
            return;
          }
          std::vector<float> x(1000, 1.0f);
          // Unavailable (a neighbour left), not DeadlineExceeded.
          EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {1000})),
                      StatusIs(absl::StatusCode::kUnavailable))
              << transport << " rank " << rank;
        },
        [&](CommunicatorOptions& o) {
          o.transport = *ParseTransport(transport);
          o.timeout = milliseconds(4000);
        });
  }
}

TEST_F(CommunicatorTest, StalledRankIsDeadlineExceeded) {
  // Rank 1 stalls until rank 0's collective has ended: had it left first (a
  // fixed stall, on a loaded machine), rank 0 would see it gone instead.
  std::atomic<bool> ended{false};
  RunRanks(
      2,
      [&](int rank, Communicator& comm) {
        if (rank == 1) {
          EXPECT_TRUE(WaitFor([&] { return ended.load(); }, milliseconds(60000),
                              "rank 0's AllReduce to end"));
          return;
        }
        std::vector<float> x(1000, 1.0f);
        auto start = std::chrono::steady_clock::now();
        // Naming the neighbour it waited on (a probe's stalls and cut links
        // said only "a neighbour").
        EXPECT_THAT(comm.AllReduce(TensorView(x.data(), DType::kFloat32, {1000})),
                    StatusIs(absl::StatusCode::kDeadlineExceeded,
                             HasSubstr("allreduce on rank 0: timed out waiting for data "
                                       "from rank 1")));
        EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(3000));
        ended = true;
      },
      [](CommunicatorOptions& o) { o.timeout = milliseconds(700); });
}

TEST(CommunicatorOptionsTest, Validation) {
  CommunicatorOptions o;
  o.world_size = 2;
  o.rank = 2;
  EXPECT_THAT(Communicator::Create(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank=2")));
  o.rank = 0;
  EXPECT_THAT(Communicator::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("store_address")));
  o.store_address = "127.0.0.1:1";
  // A typo'd world size is refused before its rendezvous takes the memory
  // for 2^31 addresses.
  for (int n : {0, CommunicatorOptions::kMaxWorldSize + 1, 2147483647}) {
    o.world_size = n;
    EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr(absl::StrCat("world_size=", n,
                                                              ": must be in 1..65536"))));
  }
  o.world_size = CommunicatorOptions::kMaxWorldSize;
  EXPECT_OK(o.Validate());
  o.world_size = 2;
  for (int channels : {-1, 17}) {
    o.shm_channels = channels;
    EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr(absl::StrCat("shm_channels=", channels,
                                                              ": must be 0 (auto) or 1..16"))));
  }
  for (int channels : {0, 1, 16}) {
    o.shm_channels = channels;
    EXPECT_OK(o.Validate()) << channels;
  }
  // A cast integer is no enumerator.
  o.backend = static_cast<Backend>(7);
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("backend=7: not a Backend")));
  o.backend = Backend::kCpu;
  o.transport = static_cast<Transport>(42);
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("transport=42: not a Transport")));
  o.transport = Transport::kAuto;
  // Was taken as -1 (the local rank's device).
  o.device = -5;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("device=-5: must be a device index, or -1")));
  o.device = -1;
  // A probe's 2^40 made a 2 TiB segment in /dev/shm and filled the host's
  // memory until the OOM killer came.
  for (uint64_t bytes : {uint64_t{4095}, (uint64_t{256} << 20) + 1, uint64_t{1} << 40}) {
    o.shm_buffer_bytes = bytes;
    EXPECT_THAT(o.Validate(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("shm_buffer_bytes=", bytes,
                                                ": must be 4096..268435456 (256MiB)"))));
  }
  o.shm_buffer_bytes = CommunicatorOptions::kMaxShmBufferBytes;
  EXPECT_OK(o.Validate());
  o.timeout = std::chrono::milliseconds::max();
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("timeout=9223372036854775807ms: must be at most")));
  o.timeout = std::chrono::seconds(10);
  EXPECT_THAT(ParseReduceOp("avg"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("avg")));
  EXPECT_THAT(ParseBackend("mpi"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseTransport("rdma"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CommunicatorOptionsTest, UnsupportedDTypeIsInvalidArgument) {
  CommunicatorOptions o;
  ASSERT_OK_AND_ASSIGN(auto comm, Communicator::Create(o));
  uint8_t b[4] = {1, 2, 3, 4};
  EXPECT_THAT(comm->AllReduce(TensorView(b, DType::kUInt8, {4})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("uint8")));
  float x[3] = {1, 2, 3};
  ASSERT_OK(comm->AllReduce(TensorView(x, DType::kFloat32, {3}), ReduceOp::kMean));
  EXPECT_EQ(x[2], 3.0f);
}

TEST(CommunicatorOptionsTest, FromContext) {
  Context c;
  c.job_id = "mnist-7";
  c.rank = 2;
  c.world_size = 4;
  c.local_rank = 1;
  c.store_addr = "10.0.0.1:29500";
  c.token = "tok";
  CommunicatorOptions o = CommunicatorOptions::FromContext(c);
  EXPECT_EQ(o.rank, 2);
  EXPECT_EQ(o.world_size, 4);
  EXPECT_EQ(o.store_address, "10.0.0.1:29500");
  EXPECT_EQ(o.prefix, "mnist-7");
  EXPECT_EQ(o.token, "tok");
  EXPECT_EQ(o.device, 1);
  EXPECT_OK(o.Validate());
}

TEST(CommunicatorOptionsTest, ShmRingHoldsATwoRankMegabyteAllReduce) {
  EXPECT_EQ(CommunicatorOptions().shm_buffer_bytes, (1u << 20) + (64u << 10));
}

TEST(CommunicatorNcclTest, NcclWithoutADeviceIsFailedPrecondition) {
  CommunicatorOptions o;
  o.backend = Backend::kNccl;
  auto comm = Communicator::Create(o);
  if (comm.ok()) GTEST_SKIP() << "a GPU is present; the gpu-labelled tests cover nccl";
  EXPECT_THAT(comm, StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace deepnex::collective
