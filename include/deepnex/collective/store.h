// The rendezvous store: a key-value service through which the ranks of a job
// find each other (addresses, NCCL ids, shared-memory segment names).
//
// A StoreServer runs inside any process (a parameter server, a training
// process, the daemon deepnex-store); StoreClients talk to it over gRPC. A
// read can wait for keys to appear; every wait has a deadline and fails with
// DeadlineExceeded naming the keys still missing.
#ifndef DEEPNEX_COLLECTIVE_STORE_H_
#define DEEPNEX_COLLECTIVE_STORE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::collective {

struct StoreServerOptions {
  // Where to listen; port 0 lets the OS pick (see StoreServer::address()).
  // Default: "127.0.0.1:0"
  std::string address = "127.0.0.1:0";
  // The host (a name or an address, no port) peers dial, advertised by
  // address(). Empty: the listen host, or for a wildcard listen host
  // (0.0.0.0, [::]) this host's primary address: the source of the route to
  // $DEEPNEX_STORE_ADDR or $DEEPNEX_CENTRAL, else the first non-loopback
  // address. Default: ""
  std::string advertise;
  // Bearer token every call must carry, or a token file (see auth.h). A
  // job-scoped token may only touch keys under "<job>/". Both empty: no auth.
  std::string token;
  std::string token_file;
  // TLS: PEM certificate chain and private key. Both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Largest value accepted. Default: 64 MiB
  uint64_t max_value_bytes = 64ull << 20;
  // Most bytes of keys and values held at once, every job's together: a
  // write past it is ResourceExhausted (deleting keys makes room). Keys are
  // at most kMaxKeyBytes. Default: 1 GiB
  uint64_t max_bytes = 1ull << 30;
  static constexpr size_t kMaxKeyBytes = 4096;
};

// A running store. Thread-safe; serves from gRPC's threads (waiting reads
// hold no thread) until Stop().
class StoreServer {
 public:
  static absl::StatusOr<std::unique_ptr<StoreServer>> Create(
      const StoreServerOptions& options);
  virtual ~StoreServer() = default;

  // "host:port" with the port actually bound.
  virtual std::string address() const = 0;
  virtual int port() const = 0;
  // Number of keys held (for tests and monitoring).
  virtual size_t size() const = 0;
  // Number of reads waiting for keys (for tests and monitoring).
  virtual size_t waiting() const = 0;
  // Stops serving; waiting reads end with an error. Idempotent.
  virtual void Stop() = 0;
  // Blocks until Stop().
  virtual void Wait() = 0;
};

struct StoreClientOptions {
  // host:port of the store.
  std::string address;
  // Prepended to every key as "<prefix>/" (e.g. the job id), so jobs sharing
  // a store do not collide. Default: "" (keys as given)
  std::string prefix;
  // Deadline of each call, and the default wait of Get/Wait. A call made
  // before the store is up waits for it within this deadline.
  // Default: 30 s
  std::chrono::milliseconds timeout{30000};
  // Bearer token, or a file holding it. Default: none
  std::string token;
  std::string token_file;
  // TLS: PEM root certificates to verify the store. Empty: plaintext.
  std::string tls_ca_file;
};

// A connection to a store. Thread-safe.
class StoreClient {
 public:
  static absl::StatusOr<std::unique_ptr<StoreClient>> Create(
      const StoreClientOptions& options);
  virtual ~StoreClient() = default;

  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` (default: options.timeout) for the key; then
  // DeadlineExceeded naming it.
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          std::chrono::milliseconds timeout) = 0;
  // The values of all `keys`, in order, waiting up to `timeout` for all of
  // them; DeadlineExceeded names the keys still missing.
  virtual absl::StatusOr<std::vector<std::string>> MultiGet(
      const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the integer at `key` (missing: 0) and returns the sum.
  // InvalidArgument if the value there is not a decimal integer;
  // OutOfRange, the value unchanged, if the sum would leave int64.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // Sets `key` to `desired` if its value is `expected` (or it is missing and
  // `expected` is empty); returns the value after the call either way.
  virtual absl::StatusOr<std::string> CompareSet(const std::string& key,
                                                 const std::string& expected,
                                                 const std::string& desired) = 0;
  // True if the key existed.
  virtual absl::StatusOr<bool> Delete(const std::string& key) = 0;
  // Waits up to `timeout` until every key is set; DeadlineExceeded names the
  // keys still missing.
  virtual absl::Status Wait(const std::vector<std::string>& keys,
                            std::chrono::milliseconds timeout) = 0;
  // Which of `keys` are set now (no waiting), in order; the store must
  // answer within `timeout` (default: options.timeout).
  virtual absl::StatusOr<std::vector<bool>> Check(
      const std::vector<std::string>& keys) = 0;
  virtual absl::StatusOr<std::vector<bool>> Check(const std::vector<std::string>& keys,
                                                  std::chrono::milliseconds timeout) = 0;

  virtual const std::string& address() const = 0;
  virtual const std::string& prefix() const = 0;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_STORE_H_
