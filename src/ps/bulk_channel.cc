#include "ps/bulk_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/net.h"
#include "core/random.h"
#include "core/socket.h"

namespace deepnex::ps {
namespace {

constexpr size_t kTicketBytes = 32;  // hex of 16 random bytes
// How long a connection may take to show its ticket (a client sends it as
// it connects); it holds up no other connection.
constexpr std::chrono::seconds kTicketDeadline(3);
// Connections whose ticket is still coming, at most; more are closed.
constexpr int kMaxAdmitting = 16;
constexpr char kAdmitted = 'k';

absl::Status Gone(const std::string& peer, const char* what) {
  int e = errno;
  return absl::UnavailableError(absl::StrCat("bulk connection with ", peer, ": ", what,
                                             e != 0 ? absl::StrCat(": ", std::strerror(e)) : ""));
}

std::string PeerOf(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char host[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &addr.sin_addr, host, sizeof(host));
  return JoinHostPort(host, ntohs(addr.sin_port));
}

// The last number in the file at `path` (a sysctl's largest value); 0 if
// it cannot be read.
uint64_t SysctlMax(const char* path) {
  std::ifstream in(path);
  uint64_t v = 0, last = 0;
  while (in >> v) last = v;
  return last;
}

// A reader waiting for more of a body of at least this size is woken once
// this much of it (or the rest, if less) is there, not at each packet.
constexpr uint64_t kWakeBytes = 1 << 20;

}  // namespace

// 4 MiB, the client's default request_bytes: a stream's whole request or
// reply goes out from the thread that has it, instead of leaving the rest
// to the writer thread (a wake-up and a switch of CPU per message, which on
// 2 CPUs made 2-worker 4 MiB sync rounds 8% slower). 0 where the host caps
// SO_SNDBUF below that, or autotuning could grow past it: setting SO_SNDBUF
// turns autotuning off.
int BulkSendBufferBytes() {
  static const int bytes = [] {
    constexpr uint64_t kWant = 4 << 20;  // the kernel doubles it for its bookkeeping
    const uint64_t cap = SysctlMax("/proc/sys/net/core/wmem_max");
    const uint64_t autotuned = SysctlMax("/proc/sys/net/ipv4/tcp_wmem");
    return cap >= kWant && autotuned <= 2 * kWant ? static_cast<int>(kWant) : 0;
  }();
  return bytes;
}

// ---- BulkStream

BulkStream::BulkStream(int fd, std::string peer)
    : fd_(fd), peer_(std::move(peer)), pid_(getpid()) {
  TuneSocket(fd_);
  if (int bytes = BulkSendBufferBytes(); bytes > 0) {
    setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  }
}

BulkStream::~BulkStream() {
  Close();
  if (getpid() != pid_) {
    if (reader_.joinable()) reader_.detach();
    if (writer_.joinable()) writer_.detach();
  }
  // The last reference may be a thread's own, dropped as it ends.
  for (std::thread* t : {&reader_, &writer_}) {
    if (t->joinable() && t->get_id() == std::this_thread::get_id()) t->detach();
  }
  Join();
  close(fd_);
}

void BulkStream::Join() {
  for (std::thread* t : {&reader_, &writer_}) {
    if (t->joinable() && t->get_id() != std::this_thread::get_id()) t->join();
  }
}

void BulkStream::Start(std::function<absl::Status(const BulkFrame&)> on_frame,
                       std::function<void(const absl::Status&)> on_close, bool on_demand) {
  on_frame_ = std::move(on_frame);
  on_demand_ = on_demand;
  writer_ = std::thread([self = shared_from_this()] { self->Write(); });
  reader_ = std::thread([this, self = shared_from_this(), on_close = std::move(on_close)] {
    absl::Status s;
    while (s.ok()) {
      if (on_demand_) {
        std::unique_lock<std::mutex> lock(mu_);
        read_cv_.wait(lock, [this] { return ReaderTurn(); });
        if (closed_) {
          s = failure_.ok() ? Gone(peer_, "closed") : failure_;
          break;
        }
        reading_ = true;
      }
      s = ReadFrame();
      if (on_demand_) {
        std::lock_guard<std::mutex> lock(mu_);
        reading_ = false;
        if (s.ok()) --expected_;
      }
    }
    Close();
    on_frame_ = nullptr;
    on_close(s);
  });
}

absl::Status BulkStream::ReadFrame() {
  BulkFrame frame;
  DEEPNEX_RETURN_IF_ERROR(Read(&frame, sizeof(frame)));
  if (frame.magic != kBulkMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("bulk connection with ", peer_, ": a frame without the magic"));
  }
  return on_frame_(frame);
}

void BulkStream::Expect(bool claim) {
  std::lock_guard<std::mutex> lock(mu_);
  ++expected_;
  if (claim) {
    ++claims_;
  } else if (ReaderTurn()) {
    read_cv_.notify_one();
  }
}

void BulkStream::Unclaim() {
  std::lock_guard<std::mutex> lock(mu_);
  --claims_;
  if (ReaderTurn()) read_cv_.notify_one();
}

bool BulkStream::LeaderInFrame() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leader_in_frame_;
}

bool BulkStream::Lead(const std::function<bool()>& done, std::chrono::milliseconds poll_every) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --claims_;
    if (closed_ || leading_ || reading_) {
      if (ReaderTurn()) read_cv_.notify_one();
      return false;
    }
    leading_ = true;
  }
  absl::Status s;
  while (!done()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || expected_ == 0) break;  // nothing will come to read
    }
    // Between frames, a deadline or a cancel may end the wait without one.
    pollfd p{fd_, POLLIN, 0};
    int ready = poll(&p, 1, static_cast<int>(poll_every.count()));
    if (ready == 0 || (ready < 0 && errno == EINTR)) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      leader_in_frame_ = true;
    }
    s = ReadFrame();
    std::lock_guard<std::mutex> lock(mu_);
    leader_in_frame_ = false;
    if (!s.ok()) break;
    --expected_;
  }
  if (!s.ok()) Fail(s);
  std::lock_guard<std::mutex> lock(mu_);
  leading_ = false;
  if (ReaderTurn()) read_cv_.notify_one();
  return true;
}

void BulkStream::Fail(const absl::Status& s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok() && !closed_) failure_ = s;
  }
  Close();
}

absl::Status BulkStream::Read(void* dst, uint64_t n) {
  char* p = static_cast<char*>(dst);
  // A body of kWakeBytes or more is taken as it is there and, when nothing
  // is, waited for kWakeBytes at a time (SO_RCVLOWAT): a blocking recv woke
  // at every packet, tens of times per 4 MiB, each a switch of CPU on a
  // 2-CPU host. Anything smaller is waited for whole by one blocking recv,
  // which costs fewer calls.
  const bool chunked = n >= kWakeBytes;
  int lowat = 1;  // the socket's SO_RCVLOWAT
  absl::Status s;
  while (n > 0) {
    ssize_t r = recv(fd_, p, std::min<uint64_t>(n, 1ull << 30),
                     chunked ? MSG_DONTWAIT : MSG_WAITALL);
    if (r > 0) {
      p += r;
      n -= static_cast<uint64_t>(r);
      continue;
    }
    if (r == 0) {
      errno = 0;
      s = Gone(peer_, "closed");
      break;
    }
    if (errno == EINTR) continue;
    if (!chunked || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      s = Gone(peer_, "receive");
      break;
    }
    // Never more than is still to come, which all comes: it is all sent.
    int want = static_cast<int>(std::min<uint64_t>(n, kWakeBytes));
    if (want != lowat) setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want));
    lowat = want;
    pollfd pfd{fd_, POLLIN, 0};
    if (poll(&pfd, 1, -1) < 0 && errno != EINTR) {
      s = Gone(peer_, "receive");
      break;
    }
  }
  // Back to any byte, for the blocking reads of what comes next.
  if (lowat != 1) {
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
  }
  return s;
}

absl::Status BulkStream::Skip(uint64_t n) {
  char scratch[64 << 10];
  while (n > 0) {
    uint64_t take = std::min<uint64_t>(n, sizeof(scratch));
    DEEPNEX_RETURN_IF_ERROR(Read(scratch, take));
    n -= take;
  }
  return absl::OkStatus();
}

void BulkStream::Send(BulkFrame frame, std::string text, grpc::ByteBuffer body,
                      std::function<void(bool)> sent) {
  frame.magic = kBulkMagic;
  frame.text = static_cast<uint32_t>(text.size());
  frame.body = body.Length();
  Outgoing out{frame, std::move(text), std::move(body), std::move(sent)};
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) {
      lock.unlock();
      if (out.sent) out.sent(false);
      return;
    }
    if (writing_ || !queue_.empty()) {
      queue_.push_back(std::move(out));
      cv_.notify_all();
      return;
    }
    writing_ = true;
  }
  // The socket is idle: write here what it takes without blocking, and
  // leave only the rest to the writer thread. Waking that thread for every
  // frame cost a context switch each way on a 2-CPU host, where the peer
  // needs the other CPU; a small frame usually goes out whole.
  absl::StatusOr<bool> done = WriteOne(out, MSG_DONTWAIT);
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (done.ok() && !*done && !closed_) {
      queue_.push_front(std::move(out));
      cv_.notify_all();
      return;
    }
    if (!queue_.empty()) cv_.notify_all();
  }
  if (!done.ok()) Close();
  if (out.sent) out.sent(done.ok() && *done);
}

void BulkStream::Write() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return closed_ || (!queue_.empty() && !writing_); });
    if (closed_) break;
    Outgoing out = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();
    // Blocking: anything short of all of it (a send timeout) ends the stream.
    absl::StatusOr<bool> done = WriteOne(out, 0);
    const bool ok = done.ok() && *done;
    if (!ok) Close();
    if (out.sent) out.sent(ok);
    out = Outgoing();  // the body's slices go before the lock is taken
    lock.lock();
    writing_ = false;
  }
  std::deque<Outgoing> left = std::move(queue_);
  lock.unlock();
  for (Outgoing& out : left) {
    if (out.sent) out.sent(false);
  }
}

absl::StatusOr<bool> BulkStream::WriteOne(Outgoing& out, int flags) {
  std::vector<grpc::Slice> slices;
  if (out.body.Length() > 0 && !out.body.Dump(&slices).ok()) {
    return absl::InternalError("bulk: unreadable body");
  }
  std::vector<iovec> iov;
  iov.push_back({&out.frame, sizeof(out.frame)});
  if (!out.text.empty()) iov.push_back({out.text.data(), out.text.size()});
  for (const grpc::Slice& s : slices) {
    if (s.size() > 0) iov.push_back({const_cast<uint8_t*>(s.begin()), s.size()});
  }
  size_t first = 0;
  // Skips what an earlier call wrote.
  for (size_t n = out.written; n > 0;) {
    const size_t k = std::min(n, iov[first].iov_len);
    iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + k;
    iov[first].iov_len -= k;
    n -= k;
    if (iov[first].iov_len == 0) ++first;
  }
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    ssize_t w = sendmsg(fd_, &msg, MSG_NOSIGNAL | flags);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      return Gone(peer_, "send");
    }
    size_t n = static_cast<size_t>(w);
    out.written += n;
    while (first < iov.size() && n >= iov[first].iov_len) n -= iov[first++].iov_len;
    if (n > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
    }
  }
  return true;
}

void BulkStream::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  // Wakes the reader's recv and the writer's send.
  if (getpid() == pid_) shutdown(fd_, SHUT_RDWR);
  cv_.notify_all();
  read_cv_.notify_all();
}

// ---- BulkListener

BulkListener::BulkListener(int listen_fd, int port, OnConnection on_connection)
    : listen_fd_(listen_fd), port_(port), on_connection_(std::move(on_connection)) {
  thread_ = std::thread([this] { Accept(); });
}

absl::StatusOr<std::unique_ptr<BulkListener>> BulkListener::Start(const std::string& host,
                                                                  OnConnection on_connection) {
  int port = 0;
  DEEPNEX_ASSIGN_OR_RETURN(int fd, ListenTcp(IsWildcardHost(host) ? "0.0.0.0" : host, &port));
  return std::unique_ptr<BulkListener>(new BulkListener(fd, port, std::move(on_connection)));
}

BulkListener::~BulkListener() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  // Wakes accept() (Linux returns EINVAL once a listener is shut down).
  shutdown(listen_fd_, SHUT_RDWR);
  thread_.join();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return admitting_ == 0; });
  close(listen_fd_);
}

std::string BulkListener::Offer(int worker, uint64_t incarnation) {
  std::string ticket = RandomHex(kTicketBytes / 2);
  std::shared_ptr<BulkStream> earlier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_[worker];
    earlier = e.stream.lock();
    e = Entry{incarnation, ticket, {}};
  }
  if (earlier) earlier->Close();
  return ticket;
}

void BulkListener::Drop(int worker, uint64_t incarnation) {
  std::shared_ptr<BulkStream> stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(worker);
    if (it == entries_.end() || (incarnation != 0 && it->second.incarnation != incarnation)) {
      return;
    }
    stream = it->second.stream.lock();
    entries_.erase(it);
  }
  if (stream) stream->Close();
}

void BulkListener::Accept() {
  while (true) {
    int fd = AcceptOrShed(listen_fd_, 0);
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) {
      if (fd >= 0) close(fd);
      return;
    }
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) continue;
      return;
    }
    // Bounds the threads a flood of silent peers can hold. A client sends
    // its ticket as it connects, so the oldest waiting is a silent one: it
    // goes (its Admit sees the shutdown), not the newcomer, or peers that
    // reconnect every few seconds would keep every worker out.
    if (waiting_.size() >= kMaxAdmitting) {
      shutdown(waiting_.front(), SHUT_RDWR);
      waiting_.pop_front();
    }
    waiting_.push_back(fd);
    ++admitting_;
    lock.unlock();
    std::thread([this, fd] { Admit(fd, PeerOf(fd)); }).detach();
  }
}

void BulkListener::Admit(int fd, std::string peer) {
  std::string ticket(kTicketBytes, '\0');
  absl::Status s = ReadFully(fd, ticket.data(), ticket.size(),
                             SteadyClock::now() + kTicketDeadline, peer);
  std::shared_ptr<BulkStream> stream;
  int worker = -1;
  uint64_t incarnation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Out of the list before it can be closed below: Accept shuts down
    // only descriptors that are open and still this connection's.
    auto it = std::find(waiting_.begin(), waiting_.end(), fd);
    if (it != waiting_.end()) waiting_.erase(it);
    for (auto& [w, e] : entries_) {
      if (s.ok() && !stopping_ && !e.ticket.empty() && e.ticket == ticket) {
        e.ticket.clear();  // one use
        stream = std::make_shared<BulkStream>(fd, peer);
        e.stream = stream;
        worker = w;
        incarnation = e.incarnation;
        break;
      }
    }
  }
  if (stream) {
    // Served before it is told so: its first request finds the connection
    // counted. The client sends nothing until this byte, so the writer
    // thread is idle, and the empty send buffer takes the byte at once.
    on_connection_(stream, worker, incarnation);
    send(fd, &kAdmitted, 1, MSG_NOSIGNAL);
  } else {
    close(fd);
  }
  std::lock_guard<std::mutex> lock(mu_);
  --admitting_;
  cv_.notify_all();
}

// ---- the client's end

absl::StatusOr<std::shared_ptr<BulkStream>> DialBulk(const std::string& server, int port,
                                                     const std::string& ticket,
                                                     std::chrono::milliseconds timeout) {
  if (port <= 0 || port > 65535 || ticket.size() != kTicketBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("bulk connection to ", server, ": offer of port ", port, " and a ticket of ",
                     ticket.size(), " bytes is malformed"));
  }
  const SteadyClock::time_point deadline = SteadyClock::now() + timeout;
  const std::string host = HostOf(server);
  const std::string peer = JoinHostPort(host, port);
  DEEPNEX_ASSIGN_OR_RETURN(int fd, ConnectTcp(host, port, deadline));
  char admitted = 0;
  absl::Status s = WriteFully(fd, ticket.data(), ticket.size(), deadline, peer);
  if (s.ok()) s = ReadFully(fd, &admitted, 1, deadline, peer);
  if (s.ok() && admitted != kAdmitted) {
    s = absl::UnavailableError(absl::StrCat("bulk connection to ", peer, ": not admitted"));
  }
  if (!s.ok()) {
    close(fd);
    return s;
  }
  return std::make_shared<BulkStream>(fd, peer);
}

}  // namespace deepnex::ps
