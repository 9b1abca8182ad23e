// ServeSession (#16), the container's end of a session, with a scripted peer:
// a port-forward reaches a listener on this host's loopback only for a
// container on this host's network.
#include "launch/session_serve.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;
using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using namespace std::chrono_literals;

// Sends `inputs`, then waits until closed; collects what is written.
class ScriptedPeer final : public SessionPeer {
 public:
  explicit ScriptedPeer(std::deque<pb::SessionInput> inputs) : inputs_(std::move(inputs)) {}
  bool Read(pb::SessionInput* in) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !inputs_.empty() || closed_; });
    if (inputs_.empty()) return false;
    *in = inputs_.front();
    inputs_.pop_front();
    return true;
  }
  bool Write(const pb::SessionOutput& out) override {
    std::lock_guard<std::mutex> lock(mu_);
    data_ += out.stdout();
    exited_ = exited_ || out.exited();
    return true;
  }
  // Scripted: it never goes away while a session runs.
  void OnGone(std::function<void()>) override {}
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  std::string data() {
    std::lock_guard<std::mutex> lock(mu_);
    return data_;
  }
  bool exited() {
    std::lock_guard<std::mutex> lock(mu_);
    return exited_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<pb::SessionInput> inputs_;
  bool closed_ = false;
  std::string data_;
  bool exited_ = false;
};

pb::SessionInput Stdin(const std::string& data) {
  pb::SessionInput in;
  in.set_stdin(data);
  return in;
}

TEST(ServeSession, PortForwardOnlyOnThisHostsNetwork) {
  auto launcher = Launcher::Create({});
  ASSERT_THAT(launcher, IsOk());
  ContainerSpec spec;
  spec.name = "box";
  spec.command = {"sleep", "60"};
  auto h = (*launcher)->Start(spec);
  ASSERT_THAT(h, IsOk());

  // An echo server on this host's loopback, on a port the OS picks.
  int server = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(server, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(server, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(server, reinterpret_cast<sockaddr*>(&a), &len);
  std::thread echo([server] {
    int c = accept(server, nullptr, nullptr);
    char buf[64];
    ssize_t n = read(c, buf, sizeof(buf));
    if (n > 0) (void)!write(c, buf, static_cast<size_t>(n));
    close(c);
  });
  pb::SessionStart start;
  start.set_container("box");
  start.set_port(ntohs(a.sin_port));

  // An oci container without host_network has a loopback of its own.
  ScriptedPeer refused({});
  EXPECT_THAT(ServeSession(**h, "oci", start, refused, [&] { refused.Close(); }),
              StatusIs(absl::StatusCode::kFailedPrecondition));

  ScriptedPeer peer({Stdin("ping")});
  EXPECT_THAT(ServeSession(**h, "process", start, peer, [&] { peer.Close(); }), IsOk());
  EXPECT_EQ(peer.data(), "ping");
  EXPECT_TRUE(peer.exited());
  echo.join();
  close(server);

  // Nothing listens there any more.
  ScriptedPeer nobody({});
  EXPECT_THAT(ServeSession(**h, "process", start, nobody, [&] { nobody.Close(); }),
              StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace deepnex::launch
