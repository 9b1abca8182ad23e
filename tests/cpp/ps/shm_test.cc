// The parameter server's same-host shared-memory path: results equal TCP's
// exactly, forcing TCP, who may fetch a segment, and regions off the wire.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/ps.grpc.pb.h"
#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/ps_test_util.h"
#include "ps/shm_channel.h"
#include "test_matchers.h"

namespace deepnex::ps {
namespace {

namespace pb = ::deepnex::ps::proto;
using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty()) {
      unsetenv(name_);
    } else {
      setenv(name_, old_.c_str(), 1);
    }
  }

 private:
  const char* name_;
  std::string old_;
};

TEST(PsShmTest, RoundsOverSharedMemoryEqualTcpExactly) {
  RunResult tcp = RunRounds(Transport::kTcp, 256 << 20);
  RunResult shm = RunRounds(Transport::kShm, 256 << 20);
  // A segment too small for some requests: those go over TCP.
  RunResult mixed = RunRounds(Transport::kShm, 768);
  EXPECT_EQ(tcp.shm_segments, 0);
  EXPECT_EQ(tcp.shm_bytes, 0);
  EXPECT_EQ(shm.shm_segments, 2);
  EXPECT_GT(shm.shm_bytes, 0);
  EXPECT_GT(mixed.shm_bytes, 0);
  EXPECT_LT(mixed.shm_bytes, shm.shm_bytes);
  ASSERT_EQ(tcp.trace[0].size(), 12u);
  EXPECT_EQ(shm.trace, tcp.trace);
  EXPECT_EQ(mixed.trace, tcp.trace);
  // Round 1 of "w": j - 0.5 * mean(1, 2) * (j % 5 + 1).
  EXPECT_EQ(tcp.trace[0][0][7], 7.0f - 0.5f * 1.5f * 3.0f);
}

TEST(PsShmTest, ForcingTcpByOptionOrEnvironment) {
  ServerOptions so;
  auto server = Server::Create(so);
  ASSERT_THAT(server.status(), IsOk());
  ClientOptions co;
  co.servers = {(*server)->address()};
  {
    ScopedEnv env("DEEPNEX_PS_TRANSPORT", "tcp");
    co.transport = Transport::kShm;  // the environment wins
    auto client = Client::Create(co);
    ASSERT_THAT(client.status(), IsOk());
    std::vector<float> v(64, 1.0f), out(64);
    ASSERT_THAT((*client)->Init({View("v", v)}), IsOk());
    ASSERT_THAT((*client)->PushPull({View("v", v)}, {View("v", out)}), IsOk());
    EXPECT_EQ(Metric(**server, "deepnex_ps_shm_segments"), 0);
    EXPECT_EQ(Metric(**server, "deepnex_ps_shm_bytes_total"), 0);
  }
  {
    ScopedEnv env("DEEPNEX_PS_TRANSPORT", "carrier-pigeon");
    EXPECT_THAT(Client::Create(co).status(),
                StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(std::string(Client::Create(co).status().message()),
                HasSubstr("DEEPNEX_PS_TRANSPORT: transport \"carrier-pigeon\""));
  }
  // A server with shared memory off: auto falls back, shm is refused.
  so.max_shm_bytes = 0;
  auto tcp_only = Server::Create(so);
  ASSERT_THAT(tcp_only.status(), IsOk());
  co.servers = {(*tcp_only)->address()};
  co.transport = Transport::kAuto;
  ASSERT_THAT(Client::Create(co).status(), IsOk());
  co.transport = Transport::kShm;
  absl::Status refused = Client::Create(co).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("transport=shm: server "));
}

// A server on this host by its hostname and boot id but in another network
// namespace (a container): its broker's abstract socket is out of reach. A
// probe's client with transport=shm got InternalError.
TEST(PsShmTest, ABrokerOutOfReachIsAFailedPreconditionSayingWhy) {
  auto broker = ShmBroker::Start(1 << 20);
  ASSERT_THAT(broker.status(), IsOk());
  auto offer = (*broker)->Open(0, 7, 4096);
  ASSERT_THAT(offer.status(), IsOk());
  absl::Status s = FetchSegment(offer->socket + "-elsewhere", offer->ticket,
                                std::chrono::milliseconds(5000))
                       .status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition,
                          HasSubstr("-elsewhere is out of reach (Connection refused): the server "
                                    "is in another network namespace or container")));
}

TEST(PsShmTest, ASegmentGoesOnceToItsTicketAndItsOwnersUidOnly) {
  auto broker = ShmBroker::Start(1 << 20);
  ASSERT_THAT(broker.status(), IsOk());
  auto offer = (*broker)->Open(0, 7, 4096);
  ASSERT_THAT(offer.status(), IsOk());
  EXPECT_EQ(offer->bytes, 4096u);
  const auto timeout = std::chrono::milliseconds(5000);
  std::string guess(offer->ticket.size(), '0');
  EXPECT_THAT(FetchSegment(offer->socket, guess, timeout).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));

  if (geteuid() == 0) {
    // Another uid with the right ticket gets nothing, and spends no ticket.
    pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(2);
      auto got = FetchSegment(offer->socket, offer->ticket, timeout);
      _exit(absl::IsPermissionDenied(got.status()) ? 0 : 1);
    }
    int wstatus = 0;
    ASSERT_EQ(waitpid(child, &wstatus, 0), child);
    EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  }

  auto segment = FetchSegment(offer->socket, offer->ticket, timeout);
  ASSERT_THAT(segment.status(), IsOk());
  EXPECT_EQ((*segment)->size(), 4096u);
  struct stat st;
  ASSERT_EQ(fstat((*segment)->fd(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A client cannot shrink it under the server (its accesses would fault).
  EXPECT_NE(ftruncate((*segment)->fd(), 0), 0);
  (*segment)->data()[100] = 'x';
  auto held = (*broker)->Find(0, 7);
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->data()[100], 'x');
  EXPECT_EQ((*broker)->Find(0, 8), nullptr);
  EXPECT_THAT(FetchSegment(offer->socket, offer->ticket, timeout).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));  // one use
  (*broker)->Drop(0, 8);  // another incarnation's leave
  EXPECT_EQ((*broker)->Count(), 1u);
  (*broker)->Drop(0, 0);  // the lease expired
  EXPECT_EQ((*broker)->Count(), 0u);
}

// A raw connection to the broker's abstract socket `name`, or -1.
int ConnectTo(const std::string& name) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the broker closed `fd`, waiting up to `wait_ms` for it.
bool ClosedByBroker(int fd, int wait_ms) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, wait_ms) != 1) return false;
  char byte;
  return recv(fd, &byte, 1, MSG_DONTWAIT) == 0;
}

TEST(PsShmTest, SilentPeersHoldUpNoOneElsesSegment) {
  auto broker = ShmBroker::Start(1 << 20);
  ASSERT_THAT(broker.status(), IsOk());
  auto offer = (*broker)->Open(0, 1, 4096);
  ASSERT_THAT(offer.status(), IsOk());
  // Connected before the client, so accepted first: one sends nothing, one
  // a part of the real ticket.
  int silent = ConnectTo(offer->socket);
  ASSERT_GE(silent, 0) << std::strerror(errno);
  int partial = ConnectTo(offer->socket);
  ASSERT_GE(partial, 0) << std::strerror(errno);
  ASSERT_EQ(send(partial, offer->ticket.data(), 5, MSG_NOSIGNAL), 5);
  auto segment = FetchSegment(offer->socket, offer->ticket, std::chrono::seconds(30));
  ASSERT_THAT(segment.status(), IsOk());
  EXPECT_EQ((*segment)->size(), 4096u);
  // Served while both are still connected (a broker that waited out each
  // one's ticket first would have closed them).
  EXPECT_FALSE(ClosedByBroker(silent, 0));
  EXPECT_FALSE(ClosedByBroker(partial, 0));
  // Each is closed at its own deadline.
  EXPECT_TRUE(ClosedByBroker(silent, 30000));
  EXPECT_TRUE(ClosedByBroker(partial, 30000));
  close(silent);
  close(partial);
}

TEST(PsShmTest, AnotherUidsConnectionIsClosedUnread) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  auto broker = ShmBroker::Start(1 << 20);
  ASSERT_THAT(broker.status(), IsOk());
  auto offer = (*broker)->Open(0, 1, 4096);
  ASSERT_THAT(offer.status(), IsOk());
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(2);
    int fd = ConnectTo(offer->socket);
    if (fd < 0) _exit(3);
    // Closed before the ticket went: refused at once.
    if (send(fd, offer->ticket.data(), offer->ticket.size(), MSG_NOSIGNAL) < 0) {
      _exit(errno == EPIPE || errno == ECONNRESET ? 0 : 4);
    }
    timeval tv{30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char byte;
    ssize_t n = recv(fd, &byte, 1, 0);
    // A socket closed with the ticket unread resets its peer; one closed
    // after reading it gives end of file (5).
    _exit(n < 0 && errno == ECONNRESET ? 0 : n == 0 ? 5 : 6);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  EXPECT_TRUE(WIFEXITED(wstatus)) << wstatus;
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
  // The ticket is unspent.
  EXPECT_THAT(FetchSegment(offer->socket, offer->ticket, std::chrono::seconds(30)).status(),
              IsOk());
}

TEST(PsShmTest, OtherTokensGetNoSegmentAndRegionsAreChecked) {
  ServerOptions so;
  so.token = "job-token";
  so.max_message_bytes = 2048;
  auto server = Server::Create(so);
  ASSERT_THAT(server.status(), IsOk());
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto stub = pb::ParameterServer::NewStub(channel);
  auto call = [&](const std::string& token, auto fn) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kAuthorizationKey, BearerValue(token));
    return fn(&ctx);
  };
  pb::RegisterRequest req;
  req.set_worker_id(0);
  req.set_incarnation(5);
  req.set_host_id(HostIdentity());
  req.set_shm_bytes(4096);
  pb::RegisterReply reply;
  grpc::Status s = call("other-token", [&](grpc::ClientContext* ctx) {
    return stub->Register(ctx, req, &reply);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(reply.shm_ticket(), "");
  EXPECT_EQ(Metric(**server, "deepnex_ps_shm_segments"), 0);
  // Another host's client gets none either.
  req.set_host_id("elsewhere/" + HostIdentity());
  s = call("job-token", [&](grpc::ClientContext* ctx) { return stub->Register(ctx, req, &reply); });
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(reply.shm_socket(), "");
  req.set_host_id(HostIdentity());
  s = call("job-token", [&](grpc::ClientContext* ctx) { return stub->Register(ctx, req, &reply); });
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(reply.shm_socket(), "");
  EXPECT_EQ(reply.shm_bytes(), 4096u);

  grpc::GenericStub generic(channel);
  auto push = [&](uint64_t incarnation, uint64_t offset, uint64_t bytes) {
    pb::PushHeader header;
    header.set_worker_id(0);
    header.set_incarnation(incarnation);
    header.mutable_shm()->set_offset(offset);
    header.mutable_shm()->set_bytes(bytes);
    grpc::ByteBuffer response;
    grpc::ClientContext ctx;
    ctx.AddMetadata(kAuthorizationKey, BearerValue("job-token"));
    return CallAndWait(generic, &ctx, kPushMethod, EncodeFramed(header, {}), &response);
  };
  grpc::Status past_end = push(5, 4000, 400);
  EXPECT_EQ(past_end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(past_end.error_message(),
              HasSubstr("shm region at offset 4000 of 400 bytes passes the end of the "
                        "4096-byte segment"));
  grpc::Status wrapping = push(5, ~uint64_t{0} - 10, 64);
  EXPECT_EQ(wrapping.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Over shared memory as over TCP: no request past max_message_bytes.
  grpc::Status too_big = push(5, 0, 4096);
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(too_big.error_message(),
              HasSubstr("shm region of 4096 bytes is over max_message_bytes (2048)"));
  grpc::Status other = push(6, 0, 64);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(other.error_message(), HasSubstr("no shared-memory segment here as incarnation 6"));
}

}  // namespace
}  // namespace deepnex::ps
