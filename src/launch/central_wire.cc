// The wire form of specs and states (central_wire.h): apart from central.cc,
// the Containers service, so that its clients (central_client.cc, and so
// deepnex-shell) link it without the server.
#include "launch/central_wire.h"

#include "absl/strings/str_cat.h"
#include "deepnex/status.h"

namespace deepnex::launch {

namespace pb = ::deepnex::gpu::proto;

// Shared with deepnex-agent, which gets the same specs.
absl::StatusOr<ContainerSpec> SpecFromProto(const pb::ContainerSpec& p) {
  ContainerSpec s;
  s.name = p.name();
  if (!p.image().empty()) s.image = p.image();
  s.command.assign(p.command().begin(), p.command().end());
  for (const auto& [k, v] : p.env()) s.env[k] = v;
  s.working_dir = p.working_dir();
  s.user = p.user();
  s.cpus = p.cpus();
  s.memory = p.memory();
  s.pids_limit = p.pids_limit();
  for (const auto& [k, v] : p.labels()) s.labels[k] = v;
  DEEPNEX_ASSIGN_OR_RETURN(s.restart,
                           RestartPolicy::Parse(p.restart().empty() ? "never" : p.restart()));
  if (p.backoff_ms() > 0) s.restart.backoff = std::chrono::milliseconds(p.backoff_ms());
  if (p.max_backoff_ms() > 0) s.restart.max_backoff = std::chrono::milliseconds(p.max_backoff_ms());
  s.network_none = p.network_none();
  s.host_network = p.host_network();
  for (const pb::Mount& m : p.mounts()) s.mounts.push_back({m.source(), m.target(), m.read_only()});
  return s;
}

void SpecToProto(const ContainerSpec& s, pb::ContainerSpec* p) {
  p->set_name(s.name);
  p->set_image(s.image);
  for (const auto& c : s.command) p->add_command(c);
  for (const auto& [k, v] : s.env) (*p->mutable_env())[k] = v;
  p->set_working_dir(s.working_dir);
  p->set_user(s.user);
  p->set_cpus(s.cpus);
  p->set_memory(s.memory);
  p->set_pids_limit(s.pids_limit);
  for (const auto& [k, v] : s.labels) (*p->mutable_labels())[k] = v;
  p->set_restart(s.restart.ToString());
  p->set_backoff_ms(s.restart.backoff.count());
  p->set_max_backoff_ms(s.restart.max_backoff.count());
  p->set_network_none(s.network_none);
  p->set_host_network(s.host_network);
  for (const Mount& m : s.mounts) {
    pb::Mount* pm = p->add_mounts();
    pm->set_source(m.source);
    pm->set_target(m.target);
    pm->set_read_only(m.read_only);
  }
}

absl::StatusOr<State> ParseState(const std::string& name) {
  for (State s : {State::kStarting, State::kRunning, State::kRestarting, State::kStopped,
                  State::kExited}) {
    if (name == StateName(s)) return s;
  }
  return absl::InternalError(absl::StrCat("deepnex-central sent the unknown state \"", name, "\""));
}

}  // namespace deepnex::launch
