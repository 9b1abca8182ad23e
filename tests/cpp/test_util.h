// The shared test layer (after gloo's test/base_test.h): what many tests
// need and each used to write again.
//
// Waiting in tests. A test that depends on something another thread or
// process does waits for the very condition it asserts next, with a generous
// deadline; never on a sleep or on the order of output, which a loaded or a
// fast machine both upset:
//
//   ASSERT_TRUE(WaitFor([&] { return alloc->QueueLength() == 1; }, 60s,
//                       "bob's request in the queue"));
//
// TempDir: a fresh directory, removed with the object. RunRanks: ranks that
// wait for each other, one thread each. CentralFixture: a deepnex-central
// server in-process with an admin's and two users' tokens.
#ifndef DEEPNEX_TESTS_TEST_UTIL_H_
#define DEEPNEX_TESTS_TEST_UTIL_H_

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "deepnex/gpu/central.h"
#include "gtest/gtest.h"

namespace deepnex::test {

// Polls `done` every 10 ms until it holds. After `timeout`, a failure that
// says what was awaited and for how long.
inline ::testing::AssertionResult WaitFor(const std::function<bool()>& done,
                                          std::chrono::milliseconds timeout,
                                          const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return ::testing::AssertionFailure() << "waited " << timeout.count() << " ms for " << what;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ::testing::AssertionSuccess();
}

// A fresh directory under $TMPDIR (else /tmp), removed with everything in
// it when the object goes. path() is empty if it could not be made.
class TempDir {
 public:
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "deepnex-test-XXXXXX").string();
    if (mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A TCP socket bound to 127.0.0.1 on a port the kernel picks (*port), not
// yet listening: connections are refused until listen().
inline int BindLoopback(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

// One HTTP request read from connection `c`: its head and, after the blank
// line at *header_end (npos: the peer closed first), the Content-Length
// bytes of its body (as libcurl writes the header).
inline std::string ReadHttpRequest(int c, size_t* header_end) {
  std::string request;
  char buf[4096];
  while ((*header_end = request.find("\r\n\r\n")) == std::string::npos) {
    ssize_t n = recv(c, buf, sizeof(buf), 0);
    if (n <= 0) return request;
    request.append(buf, n);
  }
  const size_t length_at = request.find("Content-Length: ");
  if (length_at == std::string::npos) return request;
  const size_t want = *header_end + 4 + std::stoul(request.substr(length_at + 16));
  while (request.size() < want) {
    ssize_t n = recv(c, buf, sizeof(buf), 0);
    if (n <= 0) break;
    request.append(buf, n);
  }
  return request;
}

// Runs body(rank) for ranks 0..n-1 at once, each on its own thread (the
// ranks of a collective block on each other), and joins them all.
inline void RunRanks(int n, const std::function<void(int rank)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

// A deepnex-central in-process: SetUp of a subclass creates server_ from
// ServerOptions() (adding to them what it needs) and its clients with
// Client(token). Tokens: admintok (root, admin), alicetok (alice), bobtok
// (bob), and what `more_tokens` adds.
class CentralFixture : public ::testing::Test {
 protected:
  // Options with a token file in dir_ (and nothing else set).
  gpu::CentralServerOptions ServerOptions(const std::string& more_tokens = "") {
    gpu::CentralServerOptions o;
    o.token_file = dir_.path() + "/tokens";
    std::ofstream(o.token_file) << "admintok root admin\nalicetok alice user\nbobtok bob user\n"
                                << more_tokens;
    return o;
  }

  gpu::CentralClientOptions ClientOptions(const std::string& token) {
    gpu::CentralClientOptions o;
    o.address = server_->address();
    o.token = token;
    o.timeout = std::chrono::seconds(10);
    return o;
  }

  // A client of server_ with `token`: gpu::CentralClient or, with
  // launch::CentralClient, one for containers.
  template <typename C = gpu::CentralClient>
  std::unique_ptr<C> Client(const std::string& token) {
    auto c = C::Create(ClientOptions(token));
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(c).value();
  }

  TempDir dir_;
  std::unique_ptr<gpu::CentralServer> server_;
};

// A test on a disk that fills: a 64 KiB tmpfs at mnt_ (root only; skipped
// otherwise), Fill() to use all of it, Free() to have room again.
class FullDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "mounting a tmpfs needs root";
    mnt_ = dir_.path();
    ASSERT_FALSE(mnt_.empty());
    if (mount("tmpfs", mnt_.c_str(), "tmpfs", 0, "size=64k") != 0) {
      GTEST_SKIP() << "mount -t tmpfs -o size=64k " << mnt_ << ": " << std::strerror(errno);
    }
    mounted_ = true;
  }
  void TearDown() override {
    if (mounted_) EXPECT_EQ(umount2(mnt_.c_str(), MNT_DETACH), 0) << std::strerror(errno);
  }
  // Writes a file until the disk is full.
  void Fill() {
    int fd = open((mnt_ + "/filler").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ASSERT_GE(fd, 0);
    const std::string block(4096, 'x');
    for (int i = 0; i < 1000 && write(fd, block.data(), block.size()) > 0; ++i) {
    }
    while (write(fd, "x", 1) > 0) {
    }
    EXPECT_EQ(errno, ENOSPC);
    close(fd);
  }
  void Free() { ASSERT_TRUE(std::filesystem::remove(mnt_ + "/filler")); }

  TempDir dir_;  // the mount point; removed after the unmount
  std::string mnt_;
  bool mounted_ = false;
};

}  // namespace deepnex::test

#endif  // DEEPNEX_TESTS_TEST_UTIL_H_
