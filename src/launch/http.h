// A small blocking HTTP/1.1 client for the engines' REST APIs: the Docker
// Engine API over a unix socket and the Kubernetes API server over TCP with
// TLS, on libcurl. One connection per request (Connection: close), so one
// client may be shared by any number of threads. Private to src/launch.
#ifndef DEEPNEX_LAUNCH_HTTP_H_
#define DEEPNEX_LAUNCH_HTTP_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <sys/socket.h>

#include "deepnex/status.h"

namespace deepnex::launch {

struct HttpClientOptions {
  // "unix:/path/to.sock", "http://host:port[/prefix]" or
  // "https://host:port[/prefix]".
  std::string endpoint;
  // https: the CAs to trust, as a PEM file and/or PEM text; both empty: the
  // system's default CAs.
  std::string ca_file;
  std::string ca_pem;
  // https: skip verifying the server's certificate (kubeconfig's
  // insecure-skip-tls-verify).
  bool insecure_skip_verify = false;
  // https: a client certificate and its key, as files or PEM text.
  std::string client_cert_file;
  std::string client_key_file;
  std::string client_cert_pem;
  std::string client_key_pem;
  // Sent as "Authorization: Bearer <token>" when not empty.
  std::string bearer_token;
  // TCP: called with each address a connection is about to be made to,
  // after name resolution (so a name that resolves anew, as in DNS
  // rebinding, cannot slip past it). An error refuses that address; a call
  // left with no address fails with the error. Set, calls go direct, never
  // through a proxy named by the environment (http_proxy and the like).
  // Unset: any address.
  std::function<absl::Status(const sockaddr*)> allow_address;
  std::chrono::milliseconds connect_timeout{5000};
  // The longest wait for the next bytes of a response.
  std::chrono::milliseconds read_timeout{30000};
  // The longest one request may take, from its start to the end of its
  // response: read_timeout alone lets a server that sends a byte now and
  // then hold a call for ever. Zero: no limit.
  std::chrono::milliseconds total_timeout{0};
  // Send and Call keep at most this many bytes of a response's body and
  // end the transfer there, so that an answer that does not end cannot
  // fill the memory. Zero: the whole body.
  uint64_t max_body_bytes = 0;
  // Send and Call try a request again when it failed on the way (no
  // connection, no or a cut answer, read_timeout) or was answered 429, 500,
  // 502, 503 or 504: after retry_backoff, doubling up to retry_max_backoff,
  // or after the server's Retry-After (seconds), as long as that leaves the
  // call within retry_for of its start; then the last error or answer is
  // the call's. A busy or restarting API server answers so for a while, and
  // one such answer used to fail a start or a restart for good. A request
  // retried may have been done already (its answer lost): callers of a
  // non-idempotent one (POST) must recognise their own work (409). Zero:
  // one try. Stream never retries.
  std::chrono::milliseconds retry_for{0};
  std::chrono::milliseconds retry_backoff{100};
  std::chrono::milliseconds retry_max_backoff{5000};
};

struct HttpResponse {
  int status = 0;
  // Header names lowercased.
  std::map<std::string, std::string> headers;
  std::string body;
};

// Lets another thread abort a call that blocks in Stream (a Docker wait, a
// log follow). Thread-safe.
class HttpCancel {
 public:
  HttpCancel();
  ~HttpCancel();
  HttpCancel(const HttpCancel&) = delete;
  HttpCancel& operator=(const HttpCancel&) = delete;
  // Every call blocked on this token, and every later one, ends with
  // Cancelled.
  void Cancel();
  int fd() const { return fd_; }

 private:
  int fd_;
};

// Thread-safe.
class HttpClient {
 public:
  // InvalidArgument for a malformed endpoint; InvalidArgument naming the file
  // for a CA or client certificate that does not read or holds no PEM. (A
  // PEM that OpenSSL refuses, or a key that is not the certificate's, shows
  // at the first call, as InvalidArgument too.)
  static absl::StatusOr<std::unique_ptr<HttpClient>> Create(const HttpClientOptions& options);

  const std::string& endpoint() const { return options_.endpoint; }
  // The endpoint's host (a name or an address), or its socket's path.
  const std::string& host() const { return target_.host; }

  // Sends `method` to `path` (with its query; the endpoint's prefix is put
  // before it) with `body` as application/json when not empty, and returns
  // the whole response whatever its status. Unavailable when the server
  // cannot be reached, DeadlineExceeded when it stops answering. `headers`
  // ("Name: value") are sent besides the client's; `cancel`, if given,
  // aborts the call with Cancelled.
  absl::StatusOr<HttpResponse> Send(const std::string& method, const std::string& path,
                                    const std::string& body = "",
                                    const std::vector<std::string>& headers = {},
                                    HttpCancel* cancel = nullptr);
  // Send, then the body of a 2xx response; any other status is an error
  // whose code follows the HTTP status (404 NotFound, 401 Unauthenticated,
  // 409 AlreadyExists, ...) and whose message names the method, the URL,
  // the status and the server's message.
  absl::StatusOr<std::string> Call(const std::string& method, const std::string& path,
                                   const std::string& body = "");
  // Like Call, but hands the body to `sink` piece by piece as it arrives
  // (chunked or not) until it ends or `sink` returns false. `read_timeout`
  // replaces the client's (zero: wait forever); `cancel`, if given, aborts
  // the call with Cancelled.
  absl::Status Stream(const std::string& method, const std::string& path,
                      const std::string& body,
                      const std::function<bool(const std::string&)>& sink,
                      std::chrono::milliseconds read_timeout, HttpCancel* cancel = nullptr);

  // The error Call returns for a non-2xx `response`.
  absl::Status ErrorFor(const std::string& method, const std::string& path,
                        const HttpResponse& response) const;

 private:
  struct Target {
    bool unix_socket = false;
    bool tls = false;
    std::string host;  // or the socket path
    int port = 0;
  };
  // https: the PEM texts handed to libcurl, read from the files at Create.
  struct Pems {
    std::string ca;  // empty: the system's CAs
    std::string client_cert;
    std::string client_key;
  };

  HttpClient(HttpClientOptions options, Target target, Pems pems)
      : options_(std::move(options)), target_(std::move(target)), pems_(std::move(pems)) {}
  // Runs one request: the final response's status and headers into `head`,
  // its body piece by piece into `body` (which returns false to stop
  // reading, not an error). Errors name the method and the URL. `transient`,
  // if given, says whether a failure was on the way (no connection, no or a
  // cut answer), which a retry may not meet.
  absl::Status Perform(const std::string& method, const std::string& path,
                       const std::string& body, std::chrono::milliseconds read_timeout,
                       HttpCancel* cancel, HttpResponse* head,
                       const std::function<bool(const std::string&)>& body_sink,
                       const std::vector<std::string>& headers = {},
                       bool* transient = nullptr) const;
  std::string Url(const std::string& path) const;

  const HttpClientOptions options_;
  const Target target_;
  const Pems pems_;
};

// `text` percent-encoded for a URL's path segment or query value.
std::string UrlEncode(const std::string& text);

// Reading JSON replies without exceptions: `j[key]` when `j` is an object
// that has it, else null. The reference lives as long as `j`: never pass a
// temporary.
const nlohmann::json& JsonField(const nlohmann::json& j, const std::string& key);
// `j[key]` as a T (bool, a number or std::string) when it has that type,
// else `fallback`.
template <typename T>
T JsonValue(const nlohmann::json& j, const std::string& key, T fallback) {
  const nlohmann::json& v = JsonField(j, key);
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean() ? v.get<bool>() : fallback;
  } else if constexpr (std::is_arithmetic_v<T>) {
    return v.is_number() ? v.get<T>() : fallback;
  } else {
    return v.is_string() ? v.get<std::string>() : fallback;
  }
}

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_HTTP_H_
