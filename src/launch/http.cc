#include "launch/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace deepnex::launch {
namespace {

using Clock = std::chrono::steady_clock;

std::string OpenSslError() {
  unsigned long e = ERR_get_error();
  std::string message = e ? ERR_error_string(e, nullptr) : "unknown TLS error";
  ERR_clear_error();
  return message;
}

// Why SSL_read/SSL_write/SSL_connect returned `ret`: OpenSSL's queue, else
// the socket's errno (a server that refuses the handshake often just closes).
std::string TlsError(SSL* ssl, int ret) {
  const int saved_errno = errno;
  if (ERR_peek_error() != 0) return OpenSslError();
  if (SSL_get_error(ssl, ret) == SSL_ERROR_SYSCALL && saved_errno != 0) {
    return strerror(saved_errno);
  }
  return "the server closed the TLS connection";
}

absl::StatusCode CodeForHttpStatus(int status) {
  switch (status) {
    case 400:
    case 422:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
    case 410:
      return absl::StatusCode::kNotFound;
    case 409:
      return absl::StatusCode::kAlreadyExists;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 501:
      return absl::StatusCode::kUnimplemented;
    case 502:
    case 503:
      return absl::StatusCode::kUnavailable;
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    default:
      return status >= 500 ? absl::StatusCode::kInternal : absl::StatusCode::kUnknown;
  }
}

// Loads every certificate of a PEM text into `store`.
absl::Status AddPemCertificates(X509_STORE* store, const std::string& pem,
                                const std::string& what) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  int added = 0;
  while (X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    X509_STORE_add_cert(store, cert);
    X509_free(cert);
    ++added;
  }
  BIO_free(bio);
  ERR_clear_error();  // the end of the text reads as an error
  if (added == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": no PEM certificate in it"));
  return absl::OkStatus();
}

absl::Status UseClientPem(SSL_CTX* ctx, const std::string& cert_pem, const std::string& key_pem) {
  BIO* bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  bool ok = cert != nullptr && SSL_CTX_use_certificate(ctx, cert) == 1;
  X509_free(cert);
  // The rest of the text is the chain up to the CA.
  while (ok) {
    X509* extra = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
    if (extra == nullptr) break;
    SSL_CTX_add_extra_chain_cert(ctx, extra);  // takes ownership
  }
  BIO_free(bio);
  ERR_clear_error();
  if (!ok) return absl::InvalidArgumentError("client certificate data: not a PEM certificate");
  bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  ok = key != nullptr && SSL_CTX_use_PrivateKey(ctx, key) == 1;
  EVP_PKEY_free(key);
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("client key data: not a PEM private key: ", OpenSslError()));
  }
  return absl::OkStatus();
}

absl::StatusOr<SSL_CTX*> MakeSslContext(const HttpClientOptions& o) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslError()));
  auto fail = [ctx](absl::Status status) {
    SSL_CTX_free(ctx);
    return status;
  };
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_mode(ctx, SSL_MODE_AUTO_RETRY);
  if (!o.insecure_skip_verify) SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (!o.ca_file.empty() && SSL_CTX_load_verify_locations(ctx, o.ca_file.c_str(), nullptr) != 1) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "CA file \"", o.ca_file, "\" does not load: ", OpenSslError())));
  }
  if (!o.ca_pem.empty()) {
    absl::Status s = AddPemCertificates(SSL_CTX_get_cert_store(ctx), o.ca_pem, "CA data");
    if (!s.ok()) return fail(s);
  }
  if (o.ca_file.empty() && o.ca_pem.empty()) SSL_CTX_set_default_verify_paths(ctx);
  if (!o.client_cert_file.empty() || !o.client_key_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, o.client_cert_file.c_str()) != 1) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "client certificate \"", o.client_cert_file, "\" does not load: ", OpenSslError())));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, o.client_key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "client key \"", o.client_key_file, "\" does not load: ", OpenSslError())));
    }
  } else if (!o.client_cert_pem.empty() || !o.client_key_pem.empty()) {
    absl::Status s = UseClientPem(ctx, o.client_cert_pem, o.client_key_pem);
    if (!s.ok()) return fail(s);
  }
  if ((!o.client_cert_file.empty() || !o.client_cert_pem.empty()) &&
      SSL_CTX_check_private_key(ctx) != 1) {
    return fail(absl::InvalidArgumentError("the client key does not match the client certificate"));
  }
  return ctx;
}

}  // namespace

HttpCancel::HttpCancel() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

HttpCancel::~HttpCancel() {
  if (fd_ >= 0) close(fd_);
}

void HttpCancel::Cancel() {
  uint64_t one = 1;
  // An eventfd stays readable once written, which is what every poller sees.
  if (write(fd_, &one, sizeof(one)) < 0) return;
}

// One TCP or unix-socket connection, TLS on top where asked, with a read
// buffer. Non-blocking socket; every wait goes through poll() so that
// timeouts and cancellation apply to TLS too.
class HttpClient::Connection {
 public:
  Connection(int fd, std::string what, HttpCancel* cancel)
      : fd_(fd), what_(std::move(what)), cancel_(cancel) {}
  ~Connection() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    close(fd_);
  }

  absl::Status Handshake(SSL_CTX* ctx, const std::string& host, std::chrono::milliseconds timeout) {
    ssl_ = SSL_new(ctx);
    if (ssl_ == nullptr) return absl::InternalError(absl::StrCat("SSL_new: ", OpenSslError()));
    SSL_set_fd(ssl_, fd_);
    in6_addr addr;
    if (inet_pton(AF_INET, host.c_str(), &addr) == 1 || inet_pton(AF_INET6, host.c_str(), &addr) == 1) {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), host.c_str());
    } else {
      SSL_set_tlsext_host_name(ssl_, host.c_str());
      SSL_set1_host(ssl_, host.c_str());
    }
    const auto deadline = Clock::now() + timeout;
    while (true) {
      int r = SSL_connect(ssl_);
      if (r == 1) return absl::OkStatus();
      int err = SSL_get_error(ssl_, r);
      if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        DEEPNEX_RETURN_IF_ERROR(WaitFor(err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT,
                                        Remaining(deadline), "TLS handshake"));
        continue;
      }
      long verify = SSL_get_verify_result(ssl_);
      if (verify != X509_V_OK) {
        ERR_clear_error();
        return absl::UnavailableError(absl::StrCat(
            "TLS handshake with ", what_, ": server certificate rejected: ",
            X509_verify_cert_error_string(verify)));
      }
      return absl::UnavailableError(
          absl::StrCat("TLS handshake with ", what_, ": ", TlsError(ssl_, r)));
    }
  }

  void set_read_timeout(std::chrono::milliseconds timeout) { read_timeout_ = timeout; }

  absl::Status WriteAll(const std::string& data) {
    size_t done = 0;
    while (done < data.size()) {
      ssize_t n;
      int want = POLLOUT;
      if (ssl_ != nullptr) {
        int r = SSL_write(ssl_, data.data() + done, static_cast<int>(data.size() - done));
        if (r > 0) {
          n = r;
        } else {
          int err = SSL_get_error(ssl_, r);
          if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
            return absl::UnavailableError(absl::StrCat("sending to ", what_, ": ", TlsError(ssl_, r)));
          }
          want = err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
          n = -1;
          errno = EAGAIN;
        }
      } else {
        n = send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      }
      if (n > 0) {
        done += n;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return absl::UnavailableError(absl::StrCat("sending to ", what_, ": ", strerror(errno)));
      }
      DEEPNEX_RETURN_IF_ERROR(WaitFor(want, read_timeout_, "sending"));
    }
    return absl::OkStatus();
  }

  // Appends what arrives next to buffer_; false at the end of the stream.
  absl::StatusOr<bool> Fill() {
    char chunk[16384];
    while (true) {
      ssize_t n;
      int want = POLLIN;
      if (ssl_ != nullptr) {
        int r = SSL_read(ssl_, chunk, sizeof(chunk));
        if (r > 0) {
          n = r;
        } else {
          int err = SSL_get_error(ssl_, r);
          if (err == SSL_ERROR_ZERO_RETURN) return false;
          // A server that closes without close_notify ends the body too.
          if (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) return false;
          if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
            return absl::UnavailableError(
                absl::StrCat("reading from ", what_, ": ", TlsError(ssl_, r)));
          }
          want = err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
          n = -1;
          errno = EAGAIN;
        }
      } else {
        n = recv(fd_, chunk, sizeof(chunk), 0);
      }
      if (n > 0) {
        buffer_.append(chunk, n);
        return true;
      }
      if (n == 0) return false;
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return absl::UnavailableError(absl::StrCat("reading from ", what_, ": ", strerror(errno)));
      }
      DEEPNEX_RETURN_IF_ERROR(WaitFor(want, read_timeout_, "waiting for the response"));
    }
  }

  // A line without its CRLF.
  absl::StatusOr<std::string> ReadLine() {
    while (true) {
      size_t eol = buffer_.find("\r\n", pos_);
      if (eol != std::string::npos) {
        std::string line = buffer_.substr(pos_, eol - pos_);
        pos_ = eol + 2;
        return line;
      }
      DEEPNEX_ASSIGN_OR_RETURN(bool more, Fill());
      if (!more) return absl::UnavailableError(absl::StrCat(what_, " closed the connection mid-response"));
    }
  }

  // Up to `max` bytes that are buffered or arrive next; empty at the end.
  absl::StatusOr<std::string> ReadSome(size_t max) {
    if (pos_ == buffer_.size()) {
      buffer_.clear();
      pos_ = 0;
      DEEPNEX_ASSIGN_OR_RETURN(bool more, Fill());
      if (!more) return std::string();
    }
    size_t n = std::min(max, buffer_.size() - pos_);
    std::string out = buffer_.substr(pos_, n);
    pos_ += n;
    return out;
  }

 private:
  static std::chrono::milliseconds Remaining(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

  // Zero `timeout`: no limit.
  absl::Status WaitFor(int events, std::chrono::milliseconds timeout, const char* doing) {
    pollfd fds[2] = {{fd_, static_cast<short>(events), 0}, {-1, POLLIN, 0}};
    if (cancel_ != nullptr) fds[1].fd = cancel_->fd();
    const int ms = timeout.count() > 0 ? static_cast<int>(timeout.count()) : -1;
    while (true) {
      int r = poll(fds, 2, ms);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return absl::InternalError(absl::StrCat("poll: ", strerror(errno)));
      if (r == 0) {
        return absl::DeadlineExceededError(absl::StrCat(
            what_, ": no answer within ", timeout.count(), " ms while ", doing));
      }
      if (fds[1].revents != 0) return absl::CancelledError(absl::StrCat(what_, ": cancelled"));
      return absl::OkStatus();
    }
  }

  const int fd_;
  const std::string what_;
  HttpCancel* const cancel_;
  SSL* ssl_ = nullptr;
  std::chrono::milliseconds read_timeout_{30000};
  std::string buffer_;
  size_t pos_ = 0;
};

absl::StatusOr<std::unique_ptr<HttpClient>> HttpClient::Create(const HttpClientOptions& options) {
  Target target;
  const std::string& e = options.endpoint;
  std::string rest;
  if (absl::StartsWith(e, "unix:")) {
    target.unix_socket = true;
    target.host = e.substr(5);
    if (target.host.empty() || target.host[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("endpoint \"", e, "\": a unix socket path must be absolute"));
    }
  } else if (absl::StartsWith(e, "http://") || absl::StartsWith(e, "https://")) {
    target.tls = absl::StartsWith(e, "https://");
    rest = e.substr(target.tls ? 8 : 7);
    size_t slash = rest.find('/');
    std::string authority = rest.substr(0, slash);
    if (slash != std::string::npos) target.prefix = rest.substr(slash);
    while (!target.prefix.empty() && target.prefix.back() == '/') target.prefix.pop_back();
    target.port = target.tls ? 443 : 80;
    std::string port_text;
    if (!authority.empty() && authority[0] == '[') {  // [v6]:port
      size_t close = authority.find(']');
      if (close == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("endpoint \"", e, "\": unclosed '['"));
      }
      target.host = authority.substr(1, close - 1);
      if (close + 1 < authority.size() && authority[close + 1] == ':') port_text = authority.substr(close + 2);
    } else {
      size_t colon = authority.rfind(':');
      target.host = authority.substr(0, colon);
      if (colon != std::string::npos) port_text = authority.substr(colon + 1);
    }
    if (!port_text.empty() && (!absl::SimpleAtoi(port_text, &target.port) || target.port <= 0 ||
                               target.port > 65535)) {
      return absl::InvalidArgumentError(
          absl::StrCat("endpoint \"", e, "\": bad port \"", port_text, "\""));
    }
    if (target.host.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("endpoint \"", e, "\": no host"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "endpoint \"", e, "\": expected unix:/path, http://host:port or https://host:port"));
  }
  SSL_CTX* ctx = nullptr;
  if (target.tls) {
    DEEPNEX_ASSIGN_OR_RETURN(ctx, MakeSslContext(options));
  }
  return std::unique_ptr<HttpClient>(new HttpClient(options, std::move(target), ctx));
}

HttpClient::~HttpClient() {
  if (ssl_ctx_ != nullptr) SSL_CTX_free(ssl_ctx_);
}

std::string HttpClient::Url(const std::string& path) const {
  if (target_.unix_socket) return absl::StrCat(options_.endpoint, ":", path);
  std::string base = options_.endpoint;
  while (!base.empty() && base.back() == '/') base.pop_back();
  return base + path;
}

absl::StatusOr<std::unique_ptr<HttpClient::Connection>> HttpClient::Connect(
    HttpCancel* cancel) const {
  const auto timeout = options_.connect_timeout;
  const std::string what = target_.unix_socket
                               ? absl::StrCat("unix:", target_.host)
                               : absl::StrCat(target_.host, ":", target_.port);
  auto try_connect = [&](int family, const sockaddr* addr,
                         socklen_t len) -> absl::StatusOr<std::unique_ptr<Connection>> {
    int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
    auto conn = std::make_unique<Connection>(fd, what, cancel);
    if (connect(fd, addr, len) != 0) {
      if (errno != EINPROGRESS && errno != EAGAIN) {
        return absl::UnavailableError(absl::StrCat("cannot connect to ", what, ": ", strerror(errno)));
      }
      pollfd p = {fd, POLLOUT, 0};
      int r;
      do {
        r = poll(&p, 1, static_cast<int>(timeout.count()));
      } while (r < 0 && errno == EINTR);
      if (r == 0) {
        return absl::DeadlineExceededError(
            absl::StrCat("cannot connect to ", what, " within ", timeout.count(), " ms"));
      }
      int err = 0;
      socklen_t err_len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len);
      if (err != 0) {
        return absl::UnavailableError(absl::StrCat("cannot connect to ", what, ": ", strerror(err)));
      }
    }
    return conn;
  };

  if (target_.unix_socket) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (target_.host.size() >= sizeof(addr.sun_path)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unix socket path \"", target_.host, "\" is too long"));
    }
    std::strcpy(addr.sun_path, target_.host.c_str());
    return try_connect(AF_UNIX, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(target_.port);
  int rc = getaddrinfo(target_.host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve \"", target_.host, "\": ", gai_strerror(rc)));
  }
  absl::StatusOr<std::unique_ptr<Connection>> conn =
      absl::UnavailableError(absl::StrCat("no address for ", what));
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    conn = try_connect(a->ai_family, a->ai_addr, a->ai_addrlen);
    if (conn.ok()) break;
  }
  freeaddrinfo(found);
  if (conn.ok() && target_.tls) {
    DEEPNEX_RETURN_IF_ERROR((*conn)->Handshake(ssl_ctx_, target_.host, timeout));
  }
  return conn;
}

absl::StatusOr<std::unique_ptr<HttpClient::Connection>> HttpClient::Begin(
    const std::string& method, const std::string& path, const std::string& body,
    std::chrono::milliseconds read_timeout, HttpCancel* cancel, HttpResponse* head) {
  auto with_url = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(method, " ", Url(path), ": ", s.message()));
  };
  auto conn = Connect(cancel);
  if (!conn.ok()) return with_url(conn.status());
  (*conn)->set_read_timeout(read_timeout);
  std::string request = absl::StrCat(
      method, " ", target_.prefix, path, " HTTP/1.1\r\n",
      "Host: ", target_.unix_socket ? "localhost" : target_.host, "\r\n",
      "User-Agent: deepnex\r\nAccept: application/json, */*\r\nConnection: close\r\n");
  if (!options_.bearer_token.empty()) {
    absl::StrAppend(&request, "Authorization: Bearer ", options_.bearer_token, "\r\n");
  }
  if (!body.empty()) absl::StrAppend(&request, "Content-Type: application/json\r\n");
  if (!body.empty() || (method != "GET" && method != "HEAD")) {
    absl::StrAppend(&request, "Content-Length: ", body.size(), "\r\n");
  }
  absl::StrAppend(&request, "\r\n", body);
  absl::Status sent = (*conn)->WriteAll(request);
  if (!sent.ok()) return with_url(sent);

  // Interim 1xx responses carry no body; the final one follows.
  do {
    auto status_line = (*conn)->ReadLine();
    if (!status_line.ok()) return with_url(status_line.status());
    std::vector<std::string> parts = absl::StrSplit(*status_line, absl::MaxSplits(' ', 2));
    if (parts.size() < 2 || !absl::StartsWith(parts[0], "HTTP/1.") ||
        !absl::SimpleAtoi(parts[1], &head->status)) {
      return with_url(absl::UnavailableError(
          absl::StrCat("not an HTTP response: \"", status_line->substr(0, 80), "\"")));
    }
    head->headers.clear();
    while (true) {
      auto line = (*conn)->ReadLine();
      if (!line.ok()) return with_url(line.status());
      if (line->empty()) break;
      size_t colon = line->find(':');
      if (colon == std::string::npos) continue;
      std::string name = absl::AsciiStrToLower(line->substr(0, colon));
      std::string value(absl::StripAsciiWhitespace(line->substr(colon + 1)));
      auto [it, fresh] = head->headers.emplace(name, value);
      if (!fresh) absl::StrAppend(&it->second, ", ", value);
    }
  } while (head->status >= 100 && head->status < 200);
  return conn;
}

namespace {

// Hands the body on `conn` to `sink` as it arrives.
template <typename Conn>
absl::Status ReadBody(Conn& conn, const std::string& method, const HttpResponse& head,
                      const std::function<bool(const std::string&)>& sink) {
  if (method == "HEAD" || head.status == 204 || head.status == 304) return absl::OkStatus();
  auto te = head.headers.find("transfer-encoding");
  if (te != head.headers.end() && absl::StrContains(absl::AsciiStrToLower(te->second), "chunked")) {
    while (true) {
      DEEPNEX_ASSIGN_OR_RETURN(std::string size_line, conn.ReadLine());
      size_line = size_line.substr(0, size_line.find(';'));
      uint64_t size = 0;
      if (!absl::SimpleHexAtoi(absl::StripAsciiWhitespace(size_line), &size)) {
        return absl::UnavailableError(absl::StrCat("bad chunk size \"", size_line, "\""));
      }
      if (size == 0) {
        // Trailers, then the empty line.
        while (true) {
          DEEPNEX_ASSIGN_OR_RETURN(std::string trailer, conn.ReadLine());
          if (trailer.empty()) return absl::OkStatus();
        }
      }
      while (size > 0) {
        DEEPNEX_ASSIGN_OR_RETURN(std::string piece, conn.ReadSome(size));
        if (piece.empty()) return absl::UnavailableError("the connection closed mid-chunk");
        size -= piece.size();
        if (!sink(piece)) return absl::OkStatus();
      }
      DEEPNEX_ASSIGN_OR_RETURN(std::string crlf, conn.ReadLine());
      if (!crlf.empty()) return absl::UnavailableError("a chunk does not end with CRLF");
    }
  }
  auto cl = head.headers.find("content-length");
  if (cl != head.headers.end()) {
    uint64_t left = 0;
    if (!absl::SimpleAtoi(cl->second, &left)) {
      return absl::UnavailableError(absl::StrCat("bad Content-Length \"", cl->second, "\""));
    }
    while (left > 0) {
      DEEPNEX_ASSIGN_OR_RETURN(std::string piece, conn.ReadSome(left));
      if (piece.empty()) return absl::UnavailableError("the connection closed mid-body");
      left -= piece.size();
      if (!sink(piece)) return absl::OkStatus();
    }
    return absl::OkStatus();
  }
  // Neither: the body runs to the end of the connection.
  while (true) {
    DEEPNEX_ASSIGN_OR_RETURN(std::string piece, conn.ReadSome(1 << 20));
    if (piece.empty() || !sink(piece)) return absl::OkStatus();
  }
}

}  // namespace

absl::StatusOr<HttpResponse> HttpClient::Send(const std::string& method, const std::string& path,
                                              const std::string& body) {
  HttpResponse response;
  DEEPNEX_ASSIGN_OR_RETURN(auto conn, Begin(method, path, body, options_.read_timeout, nullptr,
                                            &response));
  absl::Status read = ReadBody(*conn, method, response, [&](const std::string& piece) {
    response.body += piece;
    return true;
  });
  if (!read.ok()) return absl::Status(read.code(), absl::StrCat(method, " ", Url(path), ": ", read.message()));
  return response;
}

absl::StatusOr<std::string> HttpClient::Call(const std::string& method, const std::string& path,
                                             const std::string& body) {
  DEEPNEX_ASSIGN_OR_RETURN(HttpResponse response, Send(method, path, body));
  if (response.status < 200 || response.status >= 300) return ErrorFor(method, path, response);
  return std::move(response.body);
}

absl::Status HttpClient::Stream(const std::string& method, const std::string& path,
                                const std::string& body,
                                const std::function<bool(const std::string&)>& sink,
                                std::chrono::milliseconds read_timeout, HttpCancel* cancel) {
  HttpResponse head;
  DEEPNEX_ASSIGN_OR_RETURN(auto conn, Begin(method, path, body, read_timeout, cancel, &head));
  const bool ok = head.status >= 200 && head.status < 300;
  absl::Status read = ReadBody(*conn, method, head, [&](const std::string& piece) {
    if (ok) return sink(piece);
    head.body += piece;
    return head.body.size() < 64 * 1024;
  });
  if (!read.ok()) return absl::Status(read.code(), absl::StrCat(method, " ", Url(path), ": ", read.message()));
  return ok ? absl::OkStatus() : ErrorFor(method, path, head);
}

absl::Status HttpClient::ErrorFor(const std::string& method, const std::string& path,
                                  const HttpResponse& response) const {
  // Docker and Kubernetes both put the reason in a JSON "message".
  nlohmann::json json = nlohmann::json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  std::string message = JsonValue<std::string>(json, "message", "");
  if (message.empty()) message = std::string(absl::StripAsciiWhitespace(response.body.substr(0, 300)));
  return absl::Status(CodeForHttpStatus(response.status),
                      absl::StrCat(method, " ", Url(path), ": HTTP ", response.status,
                                   message.empty() ? "" : ": ", message));
}

const nlohmann::json& JsonField(const nlohmann::json& j, const std::string& key) {
  static const nlohmann::json* const kNull = new nlohmann::json();
  if (!j.is_object()) return *kNull;
  auto it = j.find(key);
  return it == j.end() ? *kNull : *it;
}

std::string UrlEncode(const std::string& text) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

}  // namespace deepnex::launch
