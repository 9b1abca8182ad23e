// The parameter server's bulk TCP connections: results equal gRPC's
// exactly, who is admitted, frames off the wire, and a peer that dies
// mid-request.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/ps.grpc.pb.h"
#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/bulk_channel.h"
#include "ps/ps_test_util.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::ps {
namespace {

namespace pb = ::deepnex::ps::proto;
using ::deepnex::test::IsOk;
using ::testing::HasSubstr;

TEST(PsBulkTest, RoundsOverBulkTcpEqualGrpcExactly) {
  RunResult bulk = RunRounds(Transport::kTcp, 256 << 20, /*bulk_tcp=*/true);
  RunResult grpc_only = RunRounds(Transport::kTcp, 256 << 20, /*bulk_tcp=*/false);
  // Clients that share the server's memory send only headers over it.
  RunResult shm = RunRounds(Transport::kShm, 256 << 20, /*bulk_tcp=*/true);
  EXPECT_EQ(bulk.bulk_connections, 2);
  EXPECT_GT(bulk.bulk_bytes, 0);
  EXPECT_EQ(grpc_only.bulk_connections, 0);
  EXPECT_EQ(grpc_only.bulk_bytes, 0);
  EXPECT_EQ(shm.bulk_connections, 2);
  EXPECT_GT(shm.bulk_bytes, 0);
  EXPECT_LT(shm.bulk_bytes, bulk.bulk_bytes / 10);
  EXPECT_GT(shm.shm_bytes, 0);
  ASSERT_EQ(grpc_only.trace[0].size(), 12u);
  EXPECT_EQ(bulk.trace, grpc_only.trace);
  EXPECT_EQ(shm.trace, grpc_only.trace);
  // Round 1 of "w": j - 0.5 * mean(1, 2) * (j % 5 + 1).
  EXPECT_EQ(bulk.trace[0][0][7], 7.0f - 0.5f * 1.5f * 3.0f);
}

// A pull reply carries the float32 and float64 partitions of at least
// Partition::kShareMinBytes by reference to the server's values, and the
// others (small ones, float16 converted) as copies between them. Two
// workers PushPull four such tensors in one call over every transport and
// get exact values in each round.
TEST(PsBulkTest, RepliesMixingSharedAndCopiedSlicesAreExactOnEveryTransport) {
  struct Case {
    const char* name;
    Transport transport;
    bool bulk_tcp;
  };
  for (const Case& c : {Case{"bulk tcp", Transport::kTcp, true},
                        Case{"grpc", Transport::kTcp, false}, Case{"shm", Transport::kShm, true}}) {
    SCOPED_TRACE(c.name);
    ServerOptions so;
    so.mode = Mode::kSync;
    so.num_workers = 2;
    so.optimizer.lr = 0.5;
    so.bulk_tcp = c.bulk_tcp;
    auto server = Server::Create(so);
    ASSERT_THAT(server.status(), IsOk());
    constexpr size_t kSmall = 2, kBig = 40000, kHalf = 50000, kWide = 10000;
    std::vector<absl::Status> status(2);
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w) {
      threads.emplace_back([&, w] {
        ClientOptions co;
        co.servers = {(*server)->address()};
        co.worker_id = w;
        co.transport = c.transport;
        co.partition_bytes = 96 << 10;  // "big" in two partitions, both shared
        auto client = Client::Create(co);
        if (!client.ok()) {
          status[w] = client.status();
          return;
        }
        std::vector<float> big(kBig), small(kSmall);
        std::vector<uint16_t> half(kHalf);
        std::vector<double> wide(kWide);
        auto tensors = [](std::vector<float>& b, std::vector<float>& s, std::vector<uint16_t>& h,
                          std::vector<double>& d) {
          auto n = [](const auto& v) { return std::vector<int64_t>{static_cast<int64_t>(v.size())}; };
          return std::vector<NamedTensor>{{"bias", TensorView(s.data(), DType::kFloat32, n(s))},
                                          {"big", TensorView(b.data(), DType::kFloat32, n(b))},
                                          {"half", TensorView(h.data(), DType::kFloat16, n(h))},
                                          {"wide", TensorView(d.data(), DType::kFloat64, n(d))}};
        };
        // Values j % 7, gradients (w + 1) r (j % 3 + 1): after round r,
        // j % 7 - 0.5 x 1.5 (j % 3 + 1) r (r + 1) / 2, quarters under 32,
        // exact in float16 too.
        auto fill = [&](auto& v, auto to, int r) {
          for (size_t j = 0; j < v.size(); ++j) {
            v[j] = to(r == 0 ? static_cast<float>(j % 7)
                             : static_cast<float>((w + 1) * r * (j % 3 + 1)));
          }
        };
        auto same = [](float x) { return x; };
        fill(big, same, 0);
        fill(small, same, 0);
        fill(half, FloatToHalf, 0);
        fill(wide, same, 0);
        absl::Status s = (*client)->Init(tensors(big, small, half, wide));
        for (int r = 1; r <= 4 && s.ok(); ++r) {
          fill(big, same, r);
          fill(small, same, r);
          fill(half, FloatToHalf, r);
          fill(wide, same, r);
          std::vector<float> out_big(kBig), out_small(kSmall);
          std::vector<uint16_t> out_half(kHalf);
          std::vector<double> out_wide(kWide);
          s = (*client)->PushPull(tensors(big, small, half, wide),
                                  tensors(out_big, out_small, out_half, out_wide));
          auto want = [r](size_t j) {
            return static_cast<float>(j % 7) - 0.75f * static_cast<float>((j % 3 + 1) * r * (r + 1) / 2);
          };
          auto check = [&](const char* key, size_t size, auto got) {
            for (size_t j = 0; j < size && s.ok(); ++j) {
              if (got(j) != want(j)) {
                s = absl::InternalError(absl::StrCat("worker ", w, " round ", r, " \"", key,
                                                     "\"[", j, "]: got ", got(j), ", want ",
                                                     want(j)));
              }
            }
          };
          if (!s.ok()) break;
          check("big", kBig, [&](size_t j) { return out_big[j]; });
          check("bias", kSmall, [&](size_t j) { return out_small[j]; });
          check("half", kHalf, [&](size_t j) { return HalfToFloat(out_half[j]); });
          check("wide", kWide, [&](size_t j) { return static_cast<float>(out_wide[j]); });
        }
        status[w] = s;
      });
    }
    for (std::thread& th : threads) th.join();
    for (int w = 0; w < 2; ++w) EXPECT_THAT(status[w], IsOk()) << "worker " << w;
  }
}

// A raw peer of the server's bulk port, as a hostile or broken client.
class BulkPeer {
 public:
  // Connects to 127.0.0.1:port and sends `ticket`.
  BulkPeer(int port, const std::string& ticket) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{30, 0};  // a test that waits in vain fails instead of hanging
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    Send(ticket.data(), ticket.size());
  }
  ~BulkPeer() { close(fd_); }

  // True once the server admitted the ticket; false when it closed instead.
  bool Admitted() {
    char byte = 0;
    return recv(fd_, &byte, 1, MSG_WAITALL) == 1 && byte == 'k';
  }
  // True when the server closed the connection (end of file or reset).
  bool ClosedByServer() {
    char byte;
    ssize_t n = recv(fd_, &byte, 1, 0);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }
  void Send(const void* data, size_t n) {
    ASSERT_EQ(send(fd_, data, n, MSG_NOSIGNAL), static_cast<ssize_t>(n)) << std::strerror(errno);
  }
  void SendFrame(uint32_t kind, uint64_t id, const std::string& body, uint64_t body_size) {
    BulkFrame frame;
    frame.magic = kBulkMagic;
    frame.kind = kind;
    frame.id = id;
    frame.body = body_size;
    Send(&frame, sizeof(frame));
    if (!body.empty()) Send(body.data(), body.size());
  }
  struct Reply {
    BulkFrame frame;
    std::string text, body;
  };
  Reply Read() {
    Reply r;
    EXPECT_EQ(recv(fd_, &r.frame, sizeof(r.frame), MSG_WAITALL),
              static_cast<ssize_t>(sizeof(r.frame)));
    EXPECT_EQ(r.frame.magic, kBulkMagic);
    r.text.resize(r.frame.text);
    r.body.resize(r.frame.body);
    if (!r.text.empty()) recv(fd_, r.text.data(), r.text.size(), MSG_WAITALL);
    if (!r.body.empty()) recv(fd_, r.body.data(), r.body.size(), MSG_WAITALL);
    return r;
  }

 private:
  int fd_ = -1;
};

// Registers worker `worker` as `incarnation` with raw gRPC, asking for a
// bulk connection.
pb::RegisterReply RegisterForBulk(const std::string& address, int worker, uint64_t incarnation) {
  auto stub =
      pb::ParameterServer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  pb::RegisterRequest req;
  req.set_worker_id(worker);
  req.set_incarnation(incarnation);
  req.set_bulk(true);
  pb::RegisterReply reply;
  grpc::ClientContext ctx;
  EXPECT_TRUE(stub->Register(&ctx, req, &reply).ok());
  return reply;
}

// A client of `server` as `worker` over TCP (so, its bulk connection).
absl::StatusOr<std::unique_ptr<Client>> TcpClient(
    const Server& server, int worker,
    std::chrono::milliseconds timeout = ClientOptions().timeout) {
  ClientOptions co;
  co.servers = {server.address()};
  co.worker_id = worker;
  co.transport = Transport::kTcp;
  co.timeout = timeout;
  return Client::Create(co);
}

// The server's metric `name` once it is `want`, or after 30 s.
double AwaitMetric(const Server& server, const std::string& name, double want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  double now = Metric(server, name);
  while (now != want && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    now = Metric(server, name);
  }
  return now;
}

std::string Bytes(const grpc::ByteBuffer& buffer) {
  grpc::Slice whole;
  EXPECT_TRUE(buffer.DumpToSingleSlice(&whole).ok());
  return std::string(reinterpret_cast<const char*>(whole.begin()), whole.size());
}

TEST(PsBulkTest, ATicketAdmitsOneConnectionAndAGuessNone) {
  auto server = Server::Create(ServerOptions());
  ASSERT_THAT(server.status(), IsOk());
  pb::RegisterReply reply = RegisterForBulk((*server)->address(), 0, 5);
  ASSERT_NE(reply.bulk_port(), 0u);
  ASSERT_EQ(reply.bulk_ticket().size(), 32u);
  {
    BulkPeer guess(reply.bulk_port(), std::string(32, '0'));
    EXPECT_FALSE(guess.Admitted());
  }
  {
    BulkPeer silent(reply.bulk_port(), "");  // says nothing: closed at its deadline
    BulkPeer real(reply.bulk_port(), reply.bulk_ticket());
    EXPECT_TRUE(real.Admitted());  // while the silent one still waits
    BulkPeer again(reply.bulk_port(), reply.bulk_ticket());
    EXPECT_FALSE(again.Admitted());  // one use
    EXPECT_TRUE(silent.ClosedByServer());
  }
  // Only admitted connections are counted, and a closed one no longer.
  EXPECT_EQ(AwaitMetric(**server, "deepnex_ps_bulk_connections", 0), 0);
}

// Peers that connect and say nothing, reconnecting before their 3 s run
// out, held all 16 admission slots: a real worker was closed unread and
// fell back to gRPC, silently slower. The oldest silent one now makes way.
TEST(PsBulkTest, SilentPeersHoldingEveryAdmissionSlotDoNotKeepAWorkerOut) {
  auto server = Server::Create(ServerOptions());
  ASSERT_THAT(server.status(), IsOk());
  pb::RegisterReply reply = RegisterForBulk((*server)->address(), 0, 5);
  ASSERT_NE(reply.bulk_port(), 0u);
  std::vector<std::unique_ptr<BulkPeer>> silent;
  for (int i = 0; i < 24; ++i) silent.push_back(std::make_unique<BulkPeer>(reply.bulk_port(), ""));
  // Accepted in the order they connected, so after every silent one.
  BulkPeer real(reply.bulk_port(), reply.bulk_ticket());
  EXPECT_TRUE(real.Admitted());
  EXPECT_TRUE(silent.front()->ClosedByServer());  // the oldest made way
}

TEST(PsBulkTest, BadFramesGetErrorsNamingThemAndTheServerServesOn) {
  ServerOptions so;
  so.mode = Mode::kAsync;  // worker 0 here never pushes
  so.num_workers = 2;
  so.max_message_bytes = 1 << 20;
  auto server = Server::Create(so);
  ASSERT_THAT(server.status(), IsOk());
  // Worker 1, a real client, makes the tensor.
  auto client = TcpClient(**server, 1);
  ASSERT_THAT(client.status(), IsOk());
  std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f};
  ASSERT_THAT((*client)->Init({View("v", v)}), IsOk());

  pb::RegisterReply reply = RegisterForBulk((*server)->address(), 0, 7);
  {
    BulkPeer peer(reply.bulk_port(), reply.bulk_ticket());
    ASSERT_TRUE(peer.Admitted());
    // 2^62 bytes announced: refused by size, before anything is allocated.
    peer.SendFrame(kBulkPush, 1, "", 1ull << 62);
    BulkPeer::Reply r = peer.Read();
    EXPECT_EQ(r.frame.id, 1u);
    EXPECT_EQ(r.frame.kind, static_cast<uint32_t>(grpc::StatusCode::RESOURCE_EXHAUSTED));
    EXPECT_THAT(r.text, HasSubstr("a request of 4611686018427387904 bytes is over "
                                  "max_message_bytes (1048576)"));
  }
  reply = RegisterForBulk((*server)->address(), 0, 8);  // a fresh ticket
  BulkPeer peer(reply.bulk_port(), reply.bulk_ticket());
  ASSERT_TRUE(peer.Admitted());
  peer.SendFrame(9, 2, "abc", 3);
  BulkPeer::Reply r = peer.Read();
  EXPECT_EQ(r.frame.kind, static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(r.text, HasSubstr("unknown method 9"));

  peer.SendFrame(kBulkPush, 3, std::string(8, '\xff'), 8);
  r = peer.Read();
  EXPECT_EQ(r.frame.id, 3u);
  EXPECT_EQ(r.frame.kind, static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));

  // Worker 0's connection speaks for worker 0 only.
  pb::PushHeader header;
  header.set_worker_id(1);
  header.set_incarnation(8);
  std::string push = Bytes(EncodeFramed(header, {}));
  peer.SendFrame(kBulkPush, 4, push, push.size());
  r = peer.Read();
  EXPECT_EQ(r.frame.kind, static_cast<uint32_t>(grpc::StatusCode::PERMISSION_DENIED));
  EXPECT_THAT(r.text, HasSubstr("this bulk connection is worker 0's; the request names worker 1"));

  // Still usable: a pull comes back as the gRPC reply would, exactly.
  pb::PullRequest pull;
  pull.set_worker_id(0);
  pull.set_incarnation(8);
  pb::Slice* slice = pull.add_slices();
  slice->set_key("v");
  slice->set_count(4);
  slice->set_dtype(static_cast<int>(DType::kFloat32));
  std::string bytes = pull.SerializeAsString();
  peer.SendFrame(kBulkPull, 5, bytes, bytes.size());
  r = peer.Read();
  EXPECT_EQ(r.frame.id, 5u);
  ASSERT_EQ(r.frame.kind, 0u) << r.text;
  ASSERT_EQ(r.body.size(), r.frame.prefix + sizeof(float) * v.size());
  std::vector<float> got(v.size());
  std::memcpy(got.data(), r.body.data() + r.frame.prefix, r.body.size() - r.frame.prefix);
  EXPECT_EQ(got, v);

  // A frame without the magic ends the connection, and nothing else.
  peer.Send("garbage-garbage-garbage-garbage!", 32);
  EXPECT_TRUE(peer.ClosedByServer());
  std::vector<float> g(4, 1.0f), out(4);
  ASSERT_THAT((*client)->PushPull({View("v", g)}, {View("v", out)}), IsOk());
  EXPECT_GT(Metric(**server, "deepnex_ps_bulk_bytes_total"), 0);
}

TEST(PsBulkTest, APeerThatDiesMidRequestLeavesNothingBehind) {
  ServerOptions so;
  so.num_workers = 2;
  auto server = Server::Create(so);
  ASSERT_THAT(server.status(), IsOk());
  pb::RegisterReply reply = RegisterForBulk((*server)->address(), 0, 9);
  {
    BulkPeer peer(reply.bulk_port(), reply.bulk_ticket());
    ASSERT_TRUE(peer.Admitted());
    // Half of a 1 MiB push, then gone.
    peer.SendFrame(kBulkPush, 1, std::string(512 << 10, '\0'), 1 << 20);
  }
  EXPECT_EQ(AwaitMetric(**server, "deepnex_ps_bulk_connections", 0), 0);
  EXPECT_EQ(Metric(**server, "deepnex_ps_pending_reply_bytes"), 0);
  // Worker 1 trains on, over its own bulk connection.
  auto client = TcpClient(**server, 1);
  ASSERT_THAT(client.status(), IsOk());
  std::vector<float> v(1000, 2.0f), out(1000);
  ASSERT_THAT((*client)->Init({View("v", v)}), IsOk());
  ASSERT_THAT((*client)->Pull({View("v", out)}), IsOk());
  EXPECT_EQ(out, v);
  EXPECT_EQ(Metric(**server, "deepnex_ps_bulk_connections"), 1);
}

TEST(PsBulkTest, ACallPastItsDeadlineFailsInTimeAndTheServerDropsIt) {
  ServerOptions so;
  so.num_workers = 2;  // worker 1 never comes: the round never completes
  so.lease_timeout = std::chrono::seconds(60);
  auto server = Server::Create(so);
  ASSERT_THAT(server.status(), IsOk());
  auto client = TcpClient(**server, 0, std::chrono::milliseconds(500));
  ASSERT_THAT(client.status(), IsOk());
  std::vector<float> v(1000, 1.0f), out(1000);
  ASSERT_THAT((*client)->Init({View("v", v)}), IsOk());
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = (*client)->PushPull({View("v", v)}, {View("v", out)});
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_THAT(s, ::deepnex::test::StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(s.message()), HasSubstr((*server)->address()));
  EXPECT_LT(took, std::chrono::milliseconds(500 + 2000));
  EXPECT_EQ(Metric(**server, "deepnex_ps_bulk_connections"), 1);
  // The server hears of it and lets the waiting reply go.
  EXPECT_EQ(AwaitMetric(**server, "deepnex_ps_pending_reply_bytes", 0), 0);
}

// A stream on one end of a socket pair, whose other end the test reads (or
// closes) when it chooses; `sent` collects the frames' sent callbacks.
struct StreamPair {
  StreamPair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    peer = fds[1];
    timeval tv{30, 0};  // a read that waits in vain fails instead of hanging
    setsockopt(peer, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    stream = std::make_shared<BulkStream>(fds[0], "test peer");
    // Whatever the stream made of its send buffer, a frame of a few hundred
    // KiB is more than the socket takes at once.
    int small = 128 << 10;
    setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    stream->Start([](const BulkFrame&) { return absl::OkStatus(); }, [](const absl::Status&) {});
  }
  ~StreamPair() {
    stream->Close();
    stream->Join();
    if (peer >= 0) close(peer);
  }
  // Sends frame `id` with `body`; its callback records (id, ok).
  void Send(uint64_t id, const std::string& body) {
    BulkFrame frame;
    frame.kind = kBulkPush;
    frame.id = id;
    grpc::Slice slice(body.data(), body.size());
    stream->Send(frame, "", grpc::ByteBuffer(&slice, 1), [this, id](bool ok) {
      std::lock_guard<std::mutex> lock(mu);
      sent.emplace_back(id, ok);
    });
  }
  // The callbacks once there are `n`, or after 30 s.
  std::vector<std::pair<uint64_t, bool>> Sent(size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (sent.size() >= n) return sent;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::lock_guard<std::mutex> lock(mu);
    return sent;
  }
  std::shared_ptr<BulkStream> stream;
  int peer = -1;
  std::mutex mu;
  std::vector<std::pair<uint64_t, bool>> sent;
};

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 31 + seed) % 251);
  return s;
}

TEST(BulkStreamTest, FramesArriveWholeAndInOrderWhetherTheSenderOrTheWriterThreadWritesThem) {
  StreamPair pair;
  // 8 MiB is more than the socket takes at once: the sender writes a part
  // and the writer thread the rest, with the small frame queued behind it.
  const std::vector<std::string> bodies = {Pattern(8 << 20, 1), Pattern(100, 2),
                                           Pattern(3 << 20, 3), Pattern(0, 4)};
  for (size_t i = 0; i < bodies.size(); ++i) pair.Send(i + 1, bodies[i]);
  for (size_t i = 0; i < bodies.size(); ++i) {
    BulkFrame frame;
    ASSERT_EQ(recv(pair.peer, &frame, sizeof(frame), MSG_WAITALL), ssize_t{sizeof(frame)});
    EXPECT_EQ(frame.magic, kBulkMagic);
    EXPECT_EQ(frame.id, i + 1);
    ASSERT_EQ(frame.body, bodies[i].size());
    std::string body(frame.body, '\0');
    if (!body.empty()) {
      ASSERT_EQ(recv(pair.peer, body.data(), body.size(), MSG_WAITALL), ssize_t(body.size()));
    }
    EXPECT_TRUE(body == bodies[i]) << "frame " << i + 1 << " arrived changed";
  }
  using Sent = std::vector<std::pair<uint64_t, bool>>;
  EXPECT_EQ(pair.Sent(4), (Sent{{1, true}, {2, true}, {3, true}, {4, true}}));
}

// The two ends of a loopback TCP connection (the test's end times out a
// read that waits in vain); -1s on failure.
std::pair<int, int> TcpPair() {
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int peer = -1;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      listen(listener, 1) == 0 &&
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    peer = accept(listener, nullptr, nullptr);
  }
  close(listener);
  timeval tv{30, 0};
  setsockopt(peer, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return {fd, peer};
}

// A stream on one end of a TCP pair that reads each frame's body whole
// and keeps it, with how each read and the stream ended; the test writes
// the wire bytes on the other end (`peer`).
struct ReadingStream {
  ReadingStream() {
    std::tie(fd, peer) = TcpPair();
    stream = std::make_shared<BulkStream>(fd, "test peer");
    stream->Start(
        [this](const BulkFrame& frame) {
          std::string body(frame.body, '\0');
          absl::Status s = stream->Read(body.data(), body.size());
          std::lock_guard<std::mutex> lock(mu);
          bodies.push_back(std::move(body));
          reads.push_back(s);
          return s;
        },
        [this](const absl::Status& s) {
          std::lock_guard<std::mutex> lock(mu);
          closed = s;
        });
  }
  ~ReadingStream() {
    stream->Close();
    stream->Join();
    if (peer >= 0) close(peer);
  }
  // A push frame's 32 bytes, announcing a body of `bytes`.
  static std::string Header(uint64_t id, uint64_t bytes) {
    BulkFrame frame;
    frame.magic = kBulkMagic;
    frame.kind = kBulkPush;
    frame.id = id;
    frame.body = bytes;
    return std::string(reinterpret_cast<const char*>(&frame), sizeof(frame));
  }
  // test::WaitFor, with `done` called under mu.
  ::testing::AssertionResult Await(const std::function<bool()>& done, const std::string& what) {
    return test::WaitFor(
        [&] {
          std::lock_guard<std::mutex> lock(mu);
          return done();
        },
        std::chrono::seconds(30), what);
  }
  int fd = -1;
  int peer = -1;
  std::shared_ptr<BulkStream> stream;
  std::mutex mu;
  std::vector<std::string> bodies;
  std::vector<absl::Status> reads;
  std::optional<absl::Status> closed;
};

// A body of a few MiB that arrives in pieces with pauses between, its last
// piece smaller than any chunk the reader waits for, then a small frame:
// the reader takes each whole, waiting for no more than is still to come.
TEST(BulkStreamTest, ABodyThatTricklesInIsReadWholeAndSoIsTheNextFrame) {
  ReadingStream r;
  ASSERT_GE(r.peer, 0);
  const std::vector<std::string> sent = {Pattern((3 << 20) + 7, 1), Pattern(5, 2)};
  std::string wire;
  for (size_t i = 0; i < sent.size(); ++i) {
    wire += ReadingStream::Header(i + 1, sent[i].size()) + sent[i];
  }
  const size_t second = sizeof(BulkFrame) + sent[0].size();
  size_t at = 0;
  for (size_t cut : {size_t{1} << 20, (size_t{1} << 20) + 100000, second - 10, second,
                     wire.size()}) {
    ASSERT_EQ(send(r.peer, wire.data() + at, cut - at, MSG_NOSIGNAL), ssize_t(cut - at));
    at = cut;
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  ASSERT_TRUE(r.Await([&] { return r.bodies.size() == sent.size(); },
                      "both bodies (a body still waited for more than was sent)"));
  std::lock_guard<std::mutex> lock(r.mu);
  EXPECT_TRUE(r.bodies[0] == sent[0]);
  EXPECT_EQ(r.bodies[1], sent[1]);
}

// A peer that sends part of a big body and then nothing, connection open:
// the reader waits in poll for the next MiB. Stopping the stream (as
// Server::Stop does) must free it, with an error, and leave no thread.
TEST(BulkStreamTest, AReaderWaitingForTheRestOfABigBodyIsFreedByClose) {
  ReadingStream r;
  ASSERT_GE(r.peer, 0);
  const std::string wire = ReadingStream::Header(1, 4 << 20) + Pattern((3 << 20) / 2, 3);
  ASSERT_EQ(send(r.peer, wire.data(), wire.size(), MSG_NOSIGNAL), ssize_t(wire.size()));
  // Closed once the reader is in the body: it took the frame and some of
  // the body, and waits (below SO_RCVLOWAT) for more than will come.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int queued = static_cast<int>(wire.size());
  while (std::chrono::steady_clock::now() < deadline) {
    if (ioctl(r.fd, FIONREAD, &queued) == 0 && queued < (1 << 20)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_LT(queued, 1 << 20) << "the reader never started on the body";
  r.stream->Close();
  ASSERT_TRUE(r.Await([&] { return r.closed.has_value(); },
                      "the stream to end (Close left the reader waiting for the rest of the body)"));
  std::lock_guard<std::mutex> lock(r.mu);
  ASSERT_EQ(r.reads.size(), 1u);
  EXPECT_FALSE(r.reads[0].ok());
  EXPECT_FALSE(r.closed->ok());
}

TEST(BulkStreamTest, ABatchOfFourMiBIsWrittenWholeByTheThreadThatSendsIt) {
  if (BulkSendBufferBytes() < (4 << 20)) {
    GTEST_SKIP() << "this host caps send buffers under 4 MiB, or autotunes them past 8 MiB: "
                    "bulk streams leave them to the kernel";
  }
  auto [fd, peer] = TcpPair();
  ASSERT_GE(peer, 0);
  auto stream = std::make_shared<BulkStream>(fd, "test peer");
  stream->Start([](const BulkFrame&) { return absl::OkStatus(); }, [](const absl::Status&) {});

  // The peer reads nothing yet: all of it must fit in the send buffer.
  const std::string body = Pattern(4 << 20, 7);
  grpc::Slice slice(body.data(), body.size());
  std::optional<std::thread::id> sent_on;
  BulkFrame frame;
  frame.id = 1;
  stream->Send(frame, "", grpc::ByteBuffer(&slice, 1),
               [&](bool ok) { sent_on = ok ? std::this_thread::get_id() : std::thread::id(); });
  EXPECT_EQ(sent_on, std::this_thread::get_id()) << "the writer thread sent the rest";

  ASSERT_EQ(recv(peer, &frame, sizeof(frame), MSG_WAITALL), ssize_t{sizeof(frame)});
  ASSERT_EQ(frame.body, body.size());
  std::string got(body.size(), '\0');
  ASSERT_EQ(recv(peer, got.data(), got.size(), MSG_WAITALL), ssize_t(got.size()));
  EXPECT_TRUE(got == body);
  stream->Close();
  stream->Join();
  close(peer);
}

TEST(BulkStreamTest, FramesFromConcurrentSendersArriveWholeEachSendersInOrder) {
  StreamPair pair;
  constexpr int kSenders = 2, kFrames = 60;
  // Sizes past what the socket takes at once, so that senders meet frames
  // half-written by another sender or by the writer thread.
  auto body_of = [](uint64_t id) { return Pattern(id % 3 == 0 ? 10 : 300 << 10, int(id)); };
  std::vector<std::thread> senders;
  for (int t = 0; t < kSenders; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kFrames; ++i) {
        const uint64_t id = uint64_t(t) << 32 | uint64_t(i);
        pair.Send(id, body_of(id));
      }
    });
  }
  std::vector<int> next(kSenders, 0);
  for (int got = 0; got < kSenders * kFrames; ++got) {
    BulkFrame frame;
    ASSERT_EQ(recv(pair.peer, &frame, sizeof(frame), MSG_WAITALL), ssize_t{sizeof(frame)});
    ASSERT_EQ(frame.magic, kBulkMagic) << "frame " << got << " does not start where one ended";
    const int t = int(frame.id >> 32), i = int(frame.id & 0xffffffff);
    ASSERT_TRUE(t >= 0 && t < kSenders);
    EXPECT_EQ(i, next[t]++) << "sender " << t;
    const std::string want = body_of(frame.id);
    ASSERT_EQ(frame.body, want.size());
    std::string body(frame.body, '\0');
    ASSERT_EQ(recv(pair.peer, body.data(), body.size(), MSG_WAITALL), ssize_t(body.size()));
    EXPECT_TRUE(body == want) << "frame " << t << "/" << i << " arrived changed";
  }
  for (std::thread& s : senders) s.join();
  EXPECT_EQ(pair.Sent(kSenders * kFrames).size(), size_t{kSenders * kFrames});
}

TEST(BulkStreamTest, FramesThePeerNeverTakesReportNotSent) {
  StreamPair pair;
  pair.Send(1, Pattern(8 << 20, 1));  // partly written, the rest pending
  pair.Send(2, Pattern(100, 2));      // queued behind it
  close(std::exchange(pair.peer, -1));
  using Sent = std::vector<std::pair<uint64_t, bool>>;
  EXPECT_EQ(pair.Sent(2), (Sent{{1, false}, {2, false}}));
  pair.Send(3, Pattern(100, 3));  // after the end: at once, on this thread
  EXPECT_EQ(pair.Sent(3), (Sent{{1, false}, {2, false}, {3, false}}));
}

// One socket-pair end as a client's on-demand stream: each frame's body is
// read whole and recorded with the thread that read it.
struct OnDemandPair {
  OnDemandPair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    peer = fds[1];
    stream = std::make_shared<BulkStream>(fds[0], "test server");
    stream->Start(
        [this](const BulkFrame& frame) {
          {
            std::lock_guard<std::mutex> lock(mu);
            in_frame = frame.id;
          }
          std::string body(frame.body, '\0');
          absl::Status s = stream->Read(body.data(), body.size());
          std::lock_guard<std::mutex> lock(mu);
          if (s.ok()) read.push_back({frame.id, std::this_thread::get_id()});
          return s;
        },
        [this](const absl::Status& s) {
          std::lock_guard<std::mutex> lock(mu);
          closed = s;
          closed_on = std::this_thread::get_id();
        },
        /*on_demand=*/true);
  }
  ~OnDemandPair() {
    stream->Close();
    stream->Join();
    if (peer >= 0) close(peer);
  }
  // The peer sends frame `id` with a body of `n` bytes, of which only
  // `sent` (all, by default) now.
  void Reply(uint64_t id, size_t n, size_t sent = SIZE_MAX) {
    BulkFrame frame;
    frame.magic = kBulkMagic;
    frame.id = id;
    frame.body = n;
    std::string bytes(reinterpret_cast<const char*>(&frame), sizeof(frame));
    bytes += Pattern(std::min(n, sent), 1);
    ASSERT_EQ(send(peer, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
  }
  void Rest(size_t n) {
    std::string bytes = Pattern(n, 2);
    ASSERT_EQ(send(peer, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
  }
  bool Seen(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [i, t] : read) {
      if (i == id) return true;
    }
    return false;
  }
  // Waits up to 30 s for `cond`.
  template <typename Cond>
  bool Await(Cond cond) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!cond()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return true;
  }
  std::shared_ptr<BulkStream> stream;
  int peer = -1;
  std::mutex mu;
  uint64_t in_frame = 0;  // the frame on_frame last began
  std::vector<std::pair<uint64_t, std::thread::id>> read;
  std::optional<absl::Status> closed;
  std::thread::id closed_on;
};

constexpr std::chrono::milliseconds kPoll(20);

TEST(BulkStreamTest, ALeaderReadsWhatComesUntilItsReplyAndTheReaderThreadTheRest) {
  OnDemandPair pair;
  pair.stream->Expect(/*claim=*/true);   // reply 1: this thread's
  pair.stream->Expect(/*claim=*/false);  // reply 2: another caller's
  // Reply 2 comes first; with a claim outstanding, the reader thread leaves
  // it to the leader, which hands it on and reads on to its own.
  pair.Reply(2, 100 << 10);
  pair.Reply(1, 10);
  EXPECT_TRUE(pair.stream->Lead([&] { return pair.Seen(1); }, kPoll));
  const auto me = std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> lock(pair.mu);
    ASSERT_EQ(pair.read.size(), 2u);
    EXPECT_EQ(pair.read[0].first, 2u);
    EXPECT_EQ(pair.read[1].first, 1u);
    EXPECT_EQ(pair.read[0].second, me);
    EXPECT_EQ(pair.read[1].second, me);
  }
  // Without a leader, a reply expected is the reader thread's.
  pair.stream->Expect(/*claim=*/false);
  pair.Reply(3, 10);
  ASSERT_TRUE(pair.Await([&] { return pair.Seen(3); }));
  std::lock_guard<std::mutex> lock(pair.mu);
  EXPECT_NE(pair.read[2].second, me);
}

TEST(BulkStreamTest, ALeaderLeavesWhatItDidNotWaitForToTheReaderThread) {
  OnDemandPair pair;
  pair.stream->Expect(/*claim=*/true);
  pair.stream->Expect(/*claim=*/true);  // a second caller's, who drops it
  pair.stream->Unclaim();
  pair.Reply(1, 10);
  EXPECT_TRUE(pair.stream->Lead([&] { return pair.Seen(1); }, kPoll));
  pair.Reply(2, 10);  // after the leader left: the reader thread reads it
  ASSERT_TRUE(pair.Await([&] { return pair.Seen(2); }));
  std::lock_guard<std::mutex> lock(pair.mu);
  EXPECT_NE(pair.read[1].second, std::this_thread::get_id());
}

TEST(BulkStreamTest, ACallerFindingTheReaderThreadInAFrameLeavesTheReadingToIt) {
  OnDemandPair pair;
  pair.stream->Expect(/*claim=*/false);
  pair.Reply(1, 1000, /*sent=*/10);  // the reader thread waits in its body
  ASSERT_TRUE(pair.Await([&] {
    std::lock_guard<std::mutex> lock(pair.mu);
    return pair.in_frame == 1;
  }));
  pair.stream->Expect(/*claim=*/true);
  EXPECT_FALSE(pair.stream->Lead([] { return false; }, kPoll));
  pair.Rest(990);
  pair.Reply(2, 10);
  ASSERT_TRUE(pair.Await([&] { return pair.Seen(2); }));
  std::lock_guard<std::mutex> lock(pair.mu);
  for (const auto& [id, t] : pair.read) EXPECT_NE(t, std::this_thread::get_id()) << id;
}

TEST(BulkStreamTest, ALeaderStuckInAFrameIsFreedByCloseAndTheReaderThreadReportsTheEnd) {
  OnDemandPair pair;
  pair.stream->Expect(/*claim=*/true);
  pair.Reply(1, 1000, /*sent=*/10);  // and never the rest
  std::thread closer([&] {
    EXPECT_TRUE(pair.Await([&] { return pair.stream->LeaderInFrame(); }));
    pair.stream->Close();
  });
  EXPECT_TRUE(pair.stream->Lead([] { return false; }, kPoll));
  closer.join();
  EXPECT_FALSE(pair.stream->LeaderInFrame());
  ASSERT_TRUE(pair.Await([&] {
    std::lock_guard<std::mutex> lock(pair.mu);
    return pair.closed.has_value();
  }));
  std::lock_guard<std::mutex> lock(pair.mu);
  EXPECT_FALSE(pair.closed->ok());
  EXPECT_NE(pair.closed_on, std::this_thread::get_id());
  EXPECT_TRUE(pair.read.empty());
}

TEST(PsBulkTest, ThreadsSharingAClientEachGetTheirOwnValuesExactly) {
  ServerOptions so;
  so.num_workers = 1;
  so.reduction = Reduction::kSum;
  so.optimizer.lr = 0.5;
  auto server = Server::Create(so);
  ASSERT_THAT(server.status(), IsOk());
  auto client = TcpClient(**server, 0);
  ASSERT_THAT(client.status(), IsOk());
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::vector<float>> init(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    init[t].assign(1000 << t, 0.0f);  // 4 KB to 32 KB: replies of every size interleave
    ASSERT_THAT((*client)->Init({View("k" + std::to_string(t), init[t])}), IsOk());
  }
  // Each thread pushes 2.0 (t + 1) times per element on its own key: the
  // sync ones read replies for each other (and for the async ones), the
  // async ones leave theirs to the reader thread.
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(kThreads);
  std::vector<std::vector<float>> out(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string key = "k" + std::to_string(t);
      std::vector<float> grad(init[t].size(), 2.0f * (t + 1));
      out[t].assign(init[t].size(), 0.0f);
      for (int r = 0; r < kRounds && status[t].ok(); ++r) {
        if (t == kThreads - 1 && r % 2 == 1) {
          status[t] = (*client)->PushPullAsync({View(key, grad)}, {View(key, out[t])})->Wait();
        } else {
          status[t] = (*client)->PushPull({View(key, grad)}, {View(key, out[t])});
        }
        // lr 0.5 x 2 (t + 1) per round, exact in float.
        const float want = -static_cast<float>(t + 1) * static_cast<float>(r + 1);
        if (status[t].ok() && (out[t].front() != want || out[t].back() != want)) {
          status[t] = absl::InternalError(absl::StrCat("thread ", t, " round ", r, ": got ",
                                                       out[t].front(), ", want ", want));
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_THAT(status[t], IsOk()) << "thread " << t;
  EXPECT_EQ(Metric(**server, "deepnex_ps_bulk_connections"), 1);
}

}  // namespace
}  // namespace deepnex::ps
