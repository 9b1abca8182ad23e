// deepnex::agent::Agent: one per GPU server. It registers its node with
// deepnex-central, heartbeats, and runs the node's containers through a
// launch backend when central tells it to (the containers of allocations on
// this node). The model is kubelet's and Determined's agent.
//
// The agent dials central and keeps one stream open, which central's
// commands come down: an agent behind a NAT that can reach central works,
// and central needs no address of the node. When the stream breaks, the
// agent dials again (100 ms, doubling to 2 s); its containers run on.
//
//   AgentOptions o;
//   o.central = "10.77.0.1:7070"; o.node = "h2"; o.token_file = "/etc/deepnex/node-token";
//   DEEPNEX_ASSIGN_OR_RETURN(auto agent, Agent::Create(o));
//   agent->Wait();  // until Stop(), or central refuses it for good
#ifndef DEEPNEX_AGENT_AGENT_H_
#define DEEPNEX_AGENT_AGENT_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/launch/launcher.h"
#include "deepnex/status.h"

namespace deepnex::agent {

struct AgentOptions {
  // host:port of deepnex-central.
  std::string central;
  // The node's name (ValidName's rules); a node token must be this node's.
  std::string node;
  // A node token ("TOKEN NAME node" in central's token file), or a file
  // holding it alone. Both empty: central without tokens.
  std::string token;
  std::string token_file;
  std::string tls_ca_file;
  // The backend its containers run on, and where their records go.
  launch::LauncherOptions launcher;
  // The node's GPUs; unset: found through NVML (none without a driver).
  std::optional<std::vector<gpu::Gpu>> gpus;
  // CPU cores and host memory (bytes) to offer; 0: this machine's.
  int cpus = 0;
  uint64_t memory = 0;
  std::map<std::string, std::string> labels;
  // HOST:PORT to serve GET /healthz (200 while central has accepted the
  // agent, 503 otherwise) and GET /metrics (the node's and its containers'
  // usage) on, as kubelet's port; port 0 picks one. Empty: not served.
  std::string listen;
  // Tokens (TokenTable::FromFile's format, any role) that may read
  // /metrics, whose series name every user's containers. Empty: /metrics is
  // served to no one, or to anyone where the agent has no token (central
  // without tokens). /healthz is open either way.
  std::string metrics_token_file;
  // The host of this node that peers dial (a name or an address, no port),
  // sent to central in Register: a job's addresses on the node use it.
  // Empty: this host's address on the route to central (PrimaryAddress).
  std::string advertise;
};

// "NxSIZE": N GPUs of SIZE memory each ("2x16GiB"), for hosts without a
// driver and for tests; "0" is none. InvalidArgument naming `field` and the
// text otherwise.
absl::StatusOr<std::vector<gpu::Gpu>> ParseGpus(const std::string& text,
                                               const std::string& field = "gpus");

// Thread-safe.
class Agent {
 public:
  // Checks the options and starts the launcher and the connection loop
  // (Create does not wait for central: see WaitRegistered).
  static absl::StatusOr<std::unique_ptr<Agent>> Create(const AgentOptions& options);
  // Stops as Stop() does.
  virtual ~Agent() = default;

  // The node as registered (GPUs, cpus, memory, labels).
  virtual const gpu::Node& node() const = 0;
  // The host it advertises (AgentOptions::advertise or its default).
  virtual const std::string& address() const = 0;
  // HOST:PORT its /healthz and /metrics are served on; empty without
  // AgentOptions::listen.
  virtual std::string http_address() const = 0;
  // Waits until central has accepted the registration (again, after a
  // reconnect): OK, or DeadlineExceeded, or central's refusal.
  virtual absl::Status WaitRegistered(std::chrono::milliseconds timeout) = 0;
  // Stops talking to central and stops this agent's containers (grace 1 s).
  virtual void Stop() = 0;
  // Returns once Stop() was called or central refused the agent for good
  // (Unauthenticated, PermissionDenied, InvalidArgument, AlreadyExists):
  // then that status.
  virtual absl::Status Wait() = 0;
};

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_AGENT_H_
