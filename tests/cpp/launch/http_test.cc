// The launch backends' HTTP client against a scripted server in the test
// (127.0.0.1 on a port the kernel picks, and a unix socket): body framings,
// errors, timeouts, cancellation. TLS is tested from Python
// (tests/python/test_launch_kubernetes.py) with a certificate made there.
#include "launch/http.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/net.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// Answers each connection from a table of raw responses keyed by request
// path; "/echo" sends the request back as the body; "/hang" sends headers
// and then nothing until the test ends.
class ScriptedServer {
 public:
  explicit ScriptedServer(std::map<std::string, std::string> responses, bool unix_socket = false)
      : responses_(std::move(responses)) {
    if (unix_socket) {
      path_ = ::testing::TempDir() + "/http_test." + std::to_string(getpid()) + ".sock";
      unlink(path_.c_str());
      fd_ = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
      EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    } else {
      fd_ = test::BindLoopback(&port_);
    }
    EXPECT_EQ(listen(fd_, 16), 0);
    thread_ = std::thread([this] { Serve(); });
  }

  ~ScriptedServer() {
    stopping_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    if (!path_.empty()) unlink(path_.c_str());
  }

  std::string endpoint() const {
    return path_.empty() ? "http://127.0.0.1:" + std::to_string(port_) : "unix:" + path_;
  }

 private:
  void Serve() {
    std::vector<std::thread> handlers;
    while (!stopping_) {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) break;
      handlers.emplace_back([this, c] { Handle(c); });
    }
    for (auto& h : handlers) h.join();
  }

  void Handle(int c) {
    size_t header_end;
    const std::string request = test::ReadHttpRequest(c, &header_end);
    const std::string path = request.substr(request.find(' ') + 1,
                                            request.find(" HTTP/") - request.find(' ') - 1);
    std::string reply;
    if (path == "/echo") {
      reply = "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(request.size()) +
              "\r\n\r\n" + request;
    } else if (path == "/hang") {
      reply = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    } else if (path == "/flaky") {
      // 503, then 429 with Retry-After: 1, then 200.
      const int n = flaky_calls_++;
      reply = n == 0   ? "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
              : n == 1 ? "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\n"
                         "Content-Length: 0\r\n\r\n"
                       : "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    } else {
      auto it = responses_.find(path);
      reply = it != responses_.end() ? it->second
                                     : "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
    }
    send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
    if (path == "/hang") {
      while (!stopping_) std::this_thread::sleep_for(10ms);
    }
    close(c);
  }

  const std::map<std::string, std::string> responses_;
  int fd_ = -1;
  int port_ = 0;
  std::string path_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;

 public:
  std::atomic<int> flaky_calls_{0};
};

const std::map<std::string, std::string> kResponses = {
    {"/length", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Thing: a\r\nx-thing: b\r\n\r\nhello"},
    {"/chunked",
     "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
     "5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n"},
    {"/to-close", "HTTP/1.1 200 OK\r\n\r\nuntil the end"},
    {"/continue", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"},
    {"/missing",
     "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n"
     "{\"message\":\"no such thing\"}\r\n"},
    {"/denied", "HTTP/1.1 401 Unauthorized\r\nContent-Length: 12\r\n\r\nUnauthorized"},
    {"/conflict", "HTTP/1.1 409 Conflict\r\nContent-Length: 0\r\n\r\n"},
    {"/garbage", "SSH-2.0-OpenSSH\r\n\r\n"},
    {"/short", "HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nonly this"},
};

// retry_for > 0: a client that retries, 50 ms apart at first.
std::unique_ptr<HttpClient> Client(const std::string& endpoint,
                                   std::chrono::milliseconds read_timeout = 5s,
                                   std::chrono::milliseconds retry_for = 0ms) {
  HttpClientOptions options;
  options.endpoint = endpoint;
  options.bearer_token = "s3cret";
  options.read_timeout = read_timeout;
  options.retry_for = retry_for;
  options.retry_backoff = 50ms;
  auto client = HttpClient::Create(options);
  EXPECT_THAT(client, IsOk());
  return client.ok() ? std::move(*client) : nullptr;
}

TEST(HttpClientTest, BodyFramings) {
  ScriptedServer server(kResponses);
  auto client = Client(server.endpoint());
  auto r = client->Send("GET", "/length");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "hello");
  EXPECT_EQ(r->headers["x-thing"], "a, b");
  EXPECT_THAT(client->Call("GET", "/chunked"), IsOk());
  EXPECT_EQ(*client->Call("GET", "/chunked"), "hello, world");
  EXPECT_EQ(*client->Call("GET", "/to-close"), "until the end");
  auto created = client->Send("POST", "/continue", "{}");
  ASSERT_THAT(created, IsOk());
  EXPECT_EQ(created->status, 201);
  EXPECT_EQ(created->body, "ok");
}

TEST(HttpClientTest, SendsTokenJsonBodyAndLength) {
  ScriptedServer server(kResponses);
  auto client = Client(server.endpoint());
  auto echoed = client->Call("POST", "/echo", R"({"a":1})");
  ASSERT_THAT(echoed, IsOk());
  EXPECT_THAT(*echoed, HasSubstr("POST /echo HTTP/1.1\r\n"));
  EXPECT_THAT(*echoed, HasSubstr("Authorization: Bearer s3cret\r\n"));
  EXPECT_THAT(*echoed, HasSubstr("Content-Type: application/json\r\n"));
  EXPECT_THAT(*echoed, HasSubstr("Content-Length: 7\r\n"));
  EXPECT_THAT(*echoed, HasSubstr("\r\n\r\n{\"a\":1}"));
  // A body-less POST still says its length (Docker's start wants it).
  EXPECT_THAT(*client->Call("POST", "/echo"), HasSubstr("Content-Length: 0\r\n"));
}

TEST(HttpClientTest, PrefixOfTheEndpointIsKept) {
  ScriptedServer server(std::map<std::string, std::string>{
      {"/k8s/clusters/c1/api", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nv1"}});
  auto client = Client(server.endpoint() + "/k8s/clusters/c1/");
  EXPECT_EQ(*client->Call("GET", "/api"), "v1");
}

TEST(HttpClientTest, ErrorsNameMethodUrlStatusAndMessage) {
  ScriptedServer server(kResponses);
  auto client = Client(server.endpoint());
  const std::string url = server.endpoint();
  EXPECT_THAT(client->Call("DELETE", "/missing"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("DELETE " + url + "/missing: HTTP 404: no such thing")));
  EXPECT_THAT(client->Call("GET", "/denied"),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("HTTP 401: Unauthorized")));
  EXPECT_THAT(client->Call("POST", "/conflict"), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(client->Call("GET", "/garbage"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("not an HTTP response")));
  EXPECT_THAT(client->Call("GET", "/short"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("GET " + url + "/short")));
  // Send hands back any status as it is.
  auto r = client->Send("GET", "/missing");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 404);
}

TEST(HttpClientTest, RefusedConnectionIsUnavailable) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);  // nothing listens there now
  auto client = Client("http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port)));
  EXPECT_THAT(client->Call("GET", "/"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Connection refused")));
}

// The check sees the address the connection goes to, after resolution: a
// name ("localhost") gets no pass a literal would not.
TEST(HttpClientTest, AllowAddressRefusesBeforeConnectingAndNamesWhy) {
  ScriptedServer server(kResponses);
  const std::string port = server.endpoint().substr(server.endpoint().rfind(':') + 1);
  std::atomic<int> asked{0};
  HttpClientOptions options;
  options.endpoint = "http://localhost:" + port;
  options.allow_address = [&asked](const sockaddr* a) {
    ++asked;
    return absl::PermissionDeniedError(absl::StrCat(AddressText(a), " is ", NonPublicAddress(a)));
  };
  auto refusing = HttpClient::Create(options);
  ASSERT_THAT(refusing, IsOk());
  EXPECT_THAT((*refusing)->Send("POST", "/echo", "{}"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr("POST http://localhost:" + port + "/echo: "),
                             HasSubstr(" is a loopback address"))));
  EXPECT_GE(asked.load(), 1);
  options.allow_address = [&asked](const sockaddr*) {
    ++asked;
    return absl::OkStatus();
  };
  options.endpoint = server.endpoint();
  asked = 0;
  auto allowing = HttpClient::Create(options);
  ASSERT_THAT(allowing, IsOk());
  EXPECT_EQ(*(*allowing)->Call("GET", "/length"), "hello");
  EXPECT_EQ(asked.load(), 1);
}

// A proxy in the environment would hide where a checked call goes (the check
// would see the proxy's address, and the proxy would connect anywhere): a
// call with allow_address goes direct.
TEST(HttpClientTest, AllowAddressBypassesTheEnvironmentsProxy) {
  ScriptedServer server(kResponses), proxy(kResponses);
  const auto port_of = [](const std::string& endpoint) {
    return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  };
  std::vector<int> asked;
  HttpClientOptions options;
  options.endpoint = server.endpoint();
  options.allow_address = [&asked](const sockaddr* a) {
    asked.push_back(ntohs(reinterpret_cast<const sockaddr_in*>(a)->sin_port));
    return absl::OkStatus();
  };
  auto client = HttpClient::Create(options);
  ASSERT_THAT(client, IsOk());
  for (const char* name : {"http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"}) {
    ASSERT_EQ(setenv(name, proxy.endpoint().c_str(), 1), 0);
  }
  for (const char* name : {"no_proxy", "NO_PROXY"}) unsetenv(name);
  absl::StatusOr<std::string> body = (*client)->Call("GET", "/length");
  for (const char* name : {"http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"}) unsetenv(name);
  ASSERT_THAT(body, IsOk());
  EXPECT_EQ(*body, "hello");
  EXPECT_THAT(asked, ElementsAre(port_of(server.endpoint())));
}

// A busy API server's 503 and 429 used to fail the call at once.
TEST(HttpClientTest, RetriesBusyAnswersHonouringRetryAfter) {
  ScriptedServer server(kResponses);
  // Without retry_for: one try, the answer as it came.
  auto once = Client(server.endpoint());
  auto r = once->Send("GET", "/flaky");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 503);

  server.flaky_calls_ = 0;
  auto client = Client(server.endpoint(), 5s, 10s);
  const auto began = std::chrono::steady_clock::now();
  auto body = client->Call("GET", "/flaky");
  ASSERT_THAT(body, IsOk());
  EXPECT_EQ(*body, "ok");
  EXPECT_EQ(server.flaky_calls_, 3);
  EXPECT_GE(std::chrono::steady_clock::now() - began, 1s);  // Retry-After: 1

  // A Retry-After past the call's deadline: the answer at once, not a wait.
  server.flaky_calls_ = 1;
  auto short_client = Client(server.endpoint(), 5s, 500ms);
  r = short_client->Send("GET", "/flaky");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 429);
  EXPECT_EQ(server.flaky_calls_, 2);

  // Not what another try cannot change.
  EXPECT_THAT(client->Call("GET", "/missing"), StatusIs(absl::StatusCode::kNotFound));
}

// A refused connection is tried again until the call's deadline.
TEST(HttpClientTest, RetriesARefusedConnectionUntilTheDeadline) {
  int port = 0;
  const int fd = test::BindLoopback(&port);  // bound, never listening
  auto client = Client("http://127.0.0.1:" + std::to_string(port), 5s, 600ms);
  const auto began = std::chrono::steady_clock::now();
  EXPECT_THAT(client->Call("GET", "/x"), StatusIs(absl::StatusCode::kUnavailable));
  const auto took = std::chrono::steady_clock::now() - began;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
  close(fd);
}

TEST(HttpClientTest, SilentServerIsDeadlineExceeded) {
  ScriptedServer server(kResponses);
  auto client = Client(server.endpoint(), 200ms);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THAT(client->Call("GET", "/hang"), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

TEST(HttpClientTest, StreamDeliversPiecesStopsOnRequestAndCancels) {
  ScriptedServer server(kResponses);
  auto client = Client(server.endpoint());
  std::string got;
  ASSERT_THAT(client->Stream("GET", "/chunked", "",
                             [&](const std::string& piece) {
                               got += piece;
                               return true;
                             },
                             30s),
              IsOk());
  EXPECT_EQ(got, "hello, world");
  int pieces = 0;
  ASSERT_THAT(client->Stream("GET", "/chunked", "",
                             [&](const std::string&) { return ++pieces < 1; }, 30s),
              IsOk());
  EXPECT_EQ(pieces, 1);
  EXPECT_THAT(client->Stream("GET", "/missing", "", [](const std::string&) { return true; }, 30s),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no such thing")));

  // No read timeout: only the cancel ends it.
  HttpCancel cancel;
  std::thread canceller([&] {
    std::this_thread::sleep_for(200ms);
    cancel.Cancel();
  });
  EXPECT_THAT(client->Stream("POST", "/hang", "", [](const std::string&) { return true; },
                             std::chrono::milliseconds(0), &cancel),
              StatusIs(absl::StatusCode::kCancelled));
  canceller.join();
  // A cancelled token ends every later call too, one that would succeed
  // included.
  EXPECT_THAT(client->Stream("GET", "/chunked", "", [](const std::string&) { return true; }, 30s,
                             &cancel),
              StatusIs(absl::StatusCode::kCancelled));
}

TEST(HttpClientTest, UnixSocket) {
  ScriptedServer server(kResponses, /*unix_socket=*/true);
  auto client = Client(server.endpoint());
  EXPECT_EQ(*client->Call("GET", "/chunked"), "hello, world");
  EXPECT_THAT(client->Call("GET", "/missing"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("GET " + server.endpoint() + ":/missing")));
}

TEST(HttpClientTest, BadEndpointsAndCertificates) {
  HttpClientOptions options;
  // A socket path that does not fit a sockaddr_un fails here, not at the
  // first call.
  const std::string too_long = "unix:/" + std::string(120, 's') + ".sock";
  for (const std::string bad :
       {"ftp://x", "unix:relative.sock", "http://h:99999", "http://:80", "x", too_long.c_str()}) {
    options.endpoint = bad;
    EXPECT_THAT(HttpClient::Create(options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(bad)));
  }
  EXPECT_THAT(HttpClient::Create(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                                    HasSubstr("must be under 108 bytes")));
  options.endpoint = "https://127.0.0.1:1";
  options.ca_file = "/nonexistent/ca.crt";
  EXPECT_THAT(HttpClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/nonexistent/ca.crt")));
  const std::string not_pem = ::testing::TempDir() + "/http_test_not_pem." + std::to_string(getpid());
  {
    std::ofstream(not_pem) << "not a certificate\n";
  }
  options.ca_file = not_pem;
  EXPECT_THAT(HttpClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CA file \"" + not_pem + "\": no PEM certificate in it")));
  options.ca_file.clear();
  options.ca_pem = "not a certificate";
  EXPECT_THAT(HttpClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CA data: no PEM certificate in it")));
  options.ca_pem.clear();
  // Client certificates: files win over PEM text, and each names itself.
  options.client_cert_pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  options.client_key_pem = "a key";
  EXPECT_THAT(HttpClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("client key data: no PEM private key in it")));
  options.client_cert_file = not_pem;
  EXPECT_THAT(HttpClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("client certificate file \"" + not_pem + "\": no PEM")));
  {
    std::ofstream(not_pem) << options.client_cert_pem;
  }
  options.client_key_file = "/nonexistent/client.key";
  EXPECT_THAT(HttpClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("client key file \"/nonexistent/client.key\" cannot be read")));
  unlink(not_pem.c_str());
  // None of it matters without TLS.
  options.endpoint = "http://127.0.0.1:1";
  EXPECT_THAT(HttpClient::Create(options), IsOk());
}

TEST(UrlEncodeTest, ReservedCharacters) {
  EXPECT_EQ(UrlEncode("deepnex.launcher=a b,!job-name"),
            "deepnex.launcher%3Da%20b%2C%21job-name");
  EXPECT_EQ(UrlEncode("{\"label\":[\"x\"]}"), "%7B%22label%22%3A%5B%22x%22%5D%7D");
}

}  // namespace
}  // namespace deepnex::launch
