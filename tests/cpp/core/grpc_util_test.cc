#include "core/grpc_util.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/impl/codegen/server_callback_handlers.h>
#include <grpcpp/impl/rpc_method.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/wrappers.pb.h"

#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// A port the OS considered free a moment ago; nothing listens on it.
int ClosedPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

// A gRPC server on `address` (its own port when 0) that answers every
// method UNIMPLEMENTED; gRPC starts no server without a service.
struct TestServer {
  explicit TestServer(const std::string& address) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterCallbackGenericService(&service);
    server = builder.BuildAndStart();
  }
  ~TestServer() {
    if (server) server->Shutdown();
  }
  grpc::CallbackGenericService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

// The message's bytes in one 8-byte-aligned buffer, as a bulk connection
// receives it.
struct Flat {
  explicit Flat(const grpc::ByteBuffer& framed) : size(framed.Length()) {
    words.resize(size / 8 + 1);
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(framed.Dump(&slices).ok());
    char* at = data();
    for (const grpc::Slice& s : slices) {
      std::memcpy(at, s.begin(), s.size());
      at += s.size();
    }
  }
  char* data() { return reinterpret_cast<char*>(words.data()); }
  std::vector<uint64_t> words;
  size_t size;
};

TEST(FramedTest, PayloadStartsEightBytesAlignedAndProtobufReadsTheSameMessage) {
  for (size_t key : {0, 1, 5, 100, 112, 113, 120, 127, 128, 129, 200, 16400}) {
    for (size_t payload_size : {1, 4, 127, 128, 20000, 3 << 20}) {
      SCOPED_TRACE(absl::StrCat("key of ", key, " bytes, payload of ", payload_size));
      google::protobuf::BytesValue header;
      header.set_value(std::string(key, 'k'));
      std::string values(payload_size, '\0');
      for (size_t i = 0; i < payload_size; ++i) values[i] = static_cast<char>(i * 7);
      Flat flat(EncodeFramed(header, {grpc::Slice(values)}));
      // Padding is less than the alignment.
      EXPECT_LT(flat.size, header.ByteSizeLong() + payload_size + 2 + 3 + 4 + 8);

      grpc::Slice whole(flat.data(), flat.size, [](void*) {}, nullptr);
      google::protobuf::BytesValue decoded;
      PayloadReader payload;
      ASSERT_THAT(DecodeFramed(grpc::ByteBuffer(&whole, 1), &decoded, &payload), IsOk());
      EXPECT_EQ(decoded.SerializeAsString(), header.SerializeAsString());
      ASSERT_EQ(payload.remaining(), payload_size);
      payload.Visit(payload_size, [&](const char* p, size_t n) {
        EXPECT_EQ((p - flat.data()) % kFramedPayloadAlignment, 0u);
        EXPECT_EQ(std::string(p, n), values);
      });

      // The padded varints are protobuf's own: its parser reads the fields.
      google::protobuf::UnknownFieldSet fields;
      ASSERT_TRUE(fields.ParseFromArray(flat.data(), static_cast<int>(flat.size)));
      ASSERT_EQ(fields.field_count(), 2);
      EXPECT_EQ(fields.field(0).number(), 1);
      EXPECT_EQ(fields.field(0).length_delimited(), header.SerializeAsString());
      EXPECT_EQ(fields.field(1).number(), 2);
      EXPECT_EQ(fields.field(1).length_delimited(), values);
    }
  }
}

TEST(FramedTest, AMessageWithoutPayloadIsNotPadded) {
  google::protobuf::BytesValue header;
  header.set_value("key");
  Flat flat(EncodeFramed(header, {}));
  EXPECT_EQ(flat.size, 2 + header.ByteSizeLong() + 2);
}

TEST(ValidateAddressTest, AcceptsHostPortAndUnixSockets) {
  for (const char* good : {"127.0.0.1:7070", "localhost:1", "node-7.example_x.org:65535",
                           "[::1]:7070", "[fe80::1:2]:80", "unix:/run/deepnex/store.sock"}) {
    EXPECT_THAT(ValidateAddress("central address", good), IsOk()) << good;
  }
}

TEST(ValidateAddressTest, RefusesEachMalformedFormNamingItAndTheExpectedForm) {
  const std::string expected = "expected HOST:PORT (e.g. 127.0.0.1:7070)";
  const std::pair<const char*, std::string> cases[] = {
      {"http://127.0.0.1:7070", ""},
      {"127.0.0.1", "no port; "},
      {":70700", "no host; "},
      {"127.0.0.1:70700", "port 70700 is not in 1-65535; "},
      {"127.0.0.1:0", "port 0 is not in 1-65535; "},
      {"127.0.0.1:", "no port; "},
      {"127.0.0.1:80a", "port \"80a\" is not a number; "},
      {"127.0.0.1:123456", "port \"123456\" is not a number; "},
      {"::1:7070", "an IPv6 address goes in brackets, as in [::1]:7070; "},
      {"[::1]", "no port after the bracketed IPv6 address; "},
      {"[zz]:80", "\"zz\" is not an IPv6 address; "},
      {"my host:80", "host \"my host\" is not a name or an IP address; "},
      {"", "empty; "},
      {"unix:", "no socket path after unix:; "},
  };
  for (const auto& [address, why] : cases) {
    absl::Status s = ValidateAddress("central address", address);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_EQ(s.message(),
              absl::StrCat("central address \"", address, "\": ", why, expected));
  }
}

TEST(DialTest, MalformedAddressIsRefusedWithoutDialing) {
  auto start = Clock::now();
  EXPECT_THAT(Dial("store", "http://127.0.0.1:7070", grpc::InsecureChannelCredentials()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("store address \"http://127.0.0.1:7070\": expected HOST:PORT")));
  EXPECT_LT(Clock::now() - start, milliseconds(500));
}

TEST(DialTest, ClosedPortIsUnavailableSayingConnectionRefusedAfterTheConnectTimeout) {
  const std::string address = "127.0.0.1:" + std::to_string(ClosedPort());
  auto start = Clock::now();
  auto channel = Dial("store", address, grpc::InsecureChannelCredentials(), milliseconds(1000));
  auto took = Clock::now() - start;
  EXPECT_THAT(channel, StatusIs(absl::StatusCode::kUnavailable,
                                AllOf(StartsWith("store at " + address +
                                                 ": no connection within 1000 ms: "),
                                      HasSubstr("Connection refused"))));
  // It kept trying for the connect timeout, not for a call's deadline.
  EXPECT_GE(took, milliseconds(1000));
  EXPECT_LT(took, milliseconds(3000));
}

TEST(DialTest, DefaultConnectTimeoutFailsWithinAFewSeconds) {
  const std::string address = "127.0.0.1:" + std::to_string(ClosedPort());
  auto start = Clock::now();
  EXPECT_THAT(Dial("central", address, grpc::InsecureChannelCredentials()),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("central at " + address + ": no connection within 5000 ms")));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(8));
}

TEST(DialTest, ServerStartedShortlyAfterTheClientIsReached) {
  const int port = ClosedPort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  std::unique_ptr<TestServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(milliseconds(500));
    server = std::make_unique<TestServer>(address);
    EXPECT_EQ(server->port, port);
  });
  auto channel = Dial("store", address, grpc::InsecureChannelCredentials(), milliseconds(5000));
  starter.join();
  ASSERT_THAT(channel, IsOk());
  EXPECT_EQ((*channel)->GetState(false), GRPC_CHANNEL_READY);
}

// ---- ServerHost

// A service of one method, "/deepnex.test.Echo/Echo", that answers with the
// request's bytes. The ServerHost tests serve it: gRPC starts no server
// without a method to serve.
class EchoService final : public grpc::Service {
 public:
  static constexpr char kMethod[] = "/deepnex.test.Echo/Echo";
  EchoService() {
    AddMethod(new grpc::internal::RpcServiceMethod(
        kMethod, grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
    MarkMethodRawCallback(
        0, new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
               [](grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                  grpc::ByteBuffer* response) {
                 *response = *request;
                 auto* reactor = ctx->DefaultReactor();
                 reactor->Finish(grpc::Status::OK);
                 return reactor;
               }));
  }
};

// Calls Echo with `bytes` bytes on `channel`: its status.
grpc::Status Echo(const std::shared_ptr<grpc::Channel>& channel, size_t bytes) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(std::string(bytes, 'x'));
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, EchoService::kMethod, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

ServerHostOptions HostOptions(const std::string& address) {
  ServerHostOptions o;
  o.what = "test server";
  o.address = address;
  return o;
}

TEST(ServerHostTest, ListensOnThePortItPickedAndSaysSo) {
  EchoService service;
  ASSERT_OK_AND_ASSIGN(auto host, ServerHost::Start(HostOptions("127.0.0.1:0"), {&service}));
  ASSERT_GT(host->port(), 0);
  EXPECT_EQ(host->address(), "127.0.0.1:" + std::to_string(host->port()));
  EXPECT_THAT(Dial("test", host->address(), grpc::InsecureChannelCredentials()), IsOk());
}

TEST(ServerHostTest, ASecondHostOnATakenPortFailsNamingItAndTheAddress) {
  EchoService service, other;
  ASSERT_OK_AND_ASSIGN(auto first, ServerHost::Start(HostOptions("127.0.0.1:0"), {&service}));
  auto second = ServerHost::Start(HostOptions(first->address()), {&other});
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(second.status().message(),
            "test server: cannot listen on \"" + first->address() + "\": Address already in use");
}

// gRPC and getaddrinfo take a port number modulo 65536: asked for port
// 70000, a server served on 4464 and said so only in its address.
TEST(ServerHostTest, AListenPortThatIsNotOneIsRefusedNamingIt) {
  EchoService service;
  for (const auto& [address, port] : std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1:70000", "70000"},
           {"127.0.0.1:65536", "65536"},
           {"127.0.0.1:-5", "-5"},
           {"127.0.0.1:http", "http"},
           {"127.0.0.1:", ""},
           {"127.0.0.1", ""}}) {
    auto host = ServerHost::Start(HostOptions(address), {&service});
    EXPECT_THAT(host, StatusIs(absl::StatusCode::kInvalidArgument)) << address;
    EXPECT_EQ(host.status().message(),
              "test server: listen address \"" + address + "\": port \"" + port +
                  "\" is not a number in 0-65535 (0: the OS picks one)");
  }
  // The bounds themselves are ports: 65535 (free or taken, it is tried).
  auto top = ServerHost::Start(HostOptions("127.0.0.1:65535"), {&service});
  EXPECT_NE(top.status().code(), absl::StatusCode::kInvalidArgument) << top.status();
}

TEST(ServerHostTest, RequestsOverMaxReceiveBytesAreRefused) {
  EchoService service;
  ServerHostOptions o = HostOptions("127.0.0.1:0");
  o.max_receive_bytes = 64 << 10;
  ASSERT_OK_AND_ASSIGN(auto host, ServerHost::Start(o, {&service}));
  ASSERT_OK_AND_ASSIGN(auto channel,
                       Dial("test", host->address(), grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(Echo(channel, 60 << 10).ok());
  EXPECT_EQ(Echo(channel, 70 << 10).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

// "*" resolves to IPv4's and IPv6's wildcards, and IPv6's (dual-stack)
// takes IPv4 peers too: binding both failed with "Address already in use"
// against itself (probe of c282610).
TEST(ServerHostTest, AStarServesOnEveryAddress) {
  EchoService service;
  ASSERT_OK_AND_ASSIGN(auto host, ServerHost::Start(HostOptions("*:0"), {&service}));
  ASSERT_OK_AND_ASSIGN(auto channel, Dial("test", absl::StrCat("127.0.0.1:", host->port()),
                                          grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(Echo(channel, 16).ok());
}

// A unix: server is dialed by its path: it said "listening on unix:1"
// (gRPC's stand-in port joined to the host), an address nobody can dial.
TEST(ServerHostTest, AUnixSocketServerAdvertisesItsOwnPath) {
  EchoService service;
  const std::string path = testing::TempDir() + "/grpc_util_test." + std::to_string(getpid());
  unlink(path.c_str());
  const std::string address = "unix:" + path;
  ASSERT_OK_AND_ASSIGN(auto host, ServerHost::Start(HostOptions(address), {&service}));
  EXPECT_EQ(host->address(), address);
  EXPECT_EQ(host->port(), 0);
  ASSERT_OK_AND_ASSIGN(auto channel,
                       Dial("test", host->address(), grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(Echo(channel, 16).ok());
  host->Stop();
  unlink(path.c_str());
  // A path it needs: "unix:" alone bound a socket no client can name.
  auto bare = ServerHost::Start(HostOptions("unix:"), {&service});
  EXPECT_THAT(bare, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(bare.status().message(),
            "test server: listen address \"unix:\": no socket path after unix:");
  // No other host can dial a path: an advertised host is refused, not dropped.
  ServerHostOptions o = HostOptions(address);
  o.advertise = "node-7";
  auto refused = ServerHost::Start(o, {&service});
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(refused.status().message(),
            "test server: advertise \"node-7\" with listen address \"" + address +
                "\": a unix socket is dialed by its path, on its own host only");
}

TEST(ServerHostTest, TlsWithOnlyACertificateIsRefused) {
  EchoService service;
  ServerHostOptions o = HostOptions("127.0.0.1:0");
  o.tls_cert_file = "/nonexistent/cert.pem";
  auto host = ServerHost::Start(o, {&service});
  EXPECT_THAT(host, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(host.status().message(), "TLS needs both tls_cert_file and tls_key_file");
}

// A channel that keeps alive at the shortest interval stays connected
// through several idle pings: the server permits them (gRPC's default
// answers the third ping within 5 minutes with GOAWAY "too_many_pings",
// and the channel drops to IDLE). A span of time is what is tested, so it
// is waited out.
TEST(ServerHostTest, PermitsKeepalivePingsOfAChannelAtTheShortestInterval) {
  EchoService service;
  ASSERT_OK_AND_ASSIGN(auto host, ServerHost::Start(HostOptions("127.0.0.1:0"), {&service}));
  auto channel = MakeChannel(host->address(), grpc::InsecureChannelCredentials(), kMinKeepalive);
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + kConnectTimeout));
  std::this_thread::sleep_for(kMinKeepalive * 5);
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  EXPECT_TRUE(Echo(channel, 1).ok());
}

TEST(ServerHostTest, WaitReturnsOnceStopHasAndThePortIsClosed) {
  EchoService service;
  ASSERT_OK_AND_ASSIGN(auto host, ServerHost::Start(HostOptions("127.0.0.1:0"), {&service}));
  std::atomic<bool> waited{false};
  std::thread waiter([&] {
    host->Wait();
    waited = true;
  });
  EXPECT_FALSE(waited.load());
  host->Stop();
  waiter.join();
  EXPECT_TRUE(waited.load());
  host->Stop();  // idempotent
  host->Wait();  // returns at once after Stop
  EXPECT_THAT(Dial("test", host->address(), grpc::InsecureChannelCredentials(), milliseconds(300)),
              StatusIs(absl::StatusCode::kUnavailable));
}

// Runs `child` in a forked process (its exit code the result) and waits for
// it with a deadline; -1 if it did not finish in time.
int RunForked(const std::function<int()>& child) {
  pid_t pid = fork();
  if (pid == 0) _exit(child());
  auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

TEST(ForkTest, ChildOfAProcessUsingGrpcIsRefusedAtOnceAndTheParentGoesOn) {
  ASSERT_THAT(CheckForkSafe("test server"), IsOk());
  TestServer server("127.0.0.1:0");
  ASSERT_NE(server.port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(server.port);
  ASSERT_THAT(Dial("store", address, grpc::InsecureChannelCredentials()), IsOk());
  const pid_t parent = getpid();

  // 0: all refused with the message below; 1: a wrong status.
  int code = RunForked([&] {
    const std::string why = absl::StrCat(
        "this process (pid ", getpid(), ") was forked from pid ", parent,
        " after that process had started gRPC, which does not survive fork(); start the "
        "processes that use deepnex with multiprocessing.get_context(\"spawn\") or "
        "multiprocessing.set_start_method(\"spawn\"), or fork before creating any deepnex "
        "server or client");
    absl::Status check = CheckForkSafe("store client");
    EchoService service;
    auto host = ServerHost::Start(HostOptions("127.0.0.1:0"), {&service});
    auto dial = Dial("store", address, grpc::InsecureChannelCredentials());
    bool ok = check.code() == absl::StatusCode::kFailedPrecondition &&
              check.message() == "store client: " + why &&
              dial.status().code() == absl::StatusCode::kFailedPrecondition &&
              dial.status().message() == "dialing store at " + address + ": " + why &&
              host.status().code() == absl::StatusCode::kFailedPrecondition &&
              host.status().message() == "test server: " + why;
    return ok ? 0 : 1;
  });
  EXPECT_EQ(code, 0);
  // The child never touched the epoll set it shares with this process.
  EXPECT_THAT(CheckForkSafe("store client"), IsOk());
  EXPECT_THAT(Dial("store", address, grpc::InsecureChannelCredentials()), IsOk());
}

}  // namespace
}  // namespace deepnex
