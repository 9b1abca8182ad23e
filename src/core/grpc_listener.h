// The listening end of a gRPC server (ServerHost): deepnex's own accept
// loop, handing each connection to gRPC through the server's external
// connection acceptor, the path gRPC's own listener takes after its accept.
// gRPC 1.51's listener stops for good after one accept fails with EMFILE: a
// flood of idle connections from anyone who can reach the port locked every
// later client out, even after the flood closed. This one sheds new
// connections while descriptors run out (AcceptOrShed) and takes them again
// once some are free. Private to libdeepnex.
#ifndef DEEPNEX_CORE_GRPC_LISTENER_H_
#define DEEPNEX_CORE_GRPC_LISTENER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/status.h"

namespace deepnex {

class GrpcListener {
 public:
  // Binds and listens on every address "HOST:PORT" resolves to (a wildcard
  // host: all of this host's, IPv6 and IPv4); port 0 picks one free port for
  // all of them. Unavailable naming `what` and the reason when one cannot be
  // bound, e.g. "Address already in use".
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Bind(const std::string& what,
                                                            const std::string& address);
  // Stops accepting and closes the listening sockets; connections already
  // handed to gRPC are the server's.
  ~GrpcListener();

  int port() const { return port_; }
  // Starts handing connections to `acceptor`, whose server must stay up
  // until this listener is destroyed.
  void Serve(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor);

 private:
  GrpcListener(std::string what, std::vector<int> fds, int port);
  void Accept();

  const std::string what_;
  const std::vector<int> fds_;
  const int port_;
  int wake_[2] = {-1, -1};  // a byte written to [1] ends the accept loop
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
};

}  // namespace deepnex

#endif  // DEEPNEX_CORE_GRPC_LISTENER_H_
