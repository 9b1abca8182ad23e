// Conversions between deepnex::gpu values and their central.proto messages.
// Private to libdeepnex.
#ifndef DEEPNEX_GPU_CENTRAL_CONVERT_H_
#define DEEPNEX_GPU_CENTRAL_CONVERT_H_

#include "deepnex/central.pb.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/types.h"

namespace deepnex::gpu {

namespace pb = ::deepnex::gpu::proto;

inline void ToProto(const Gpu& g, pb::Gpu* p) {
  p->set_index(g.index);
  p->set_uuid(g.uuid);
  p->set_name(g.name);
  p->set_memory(g.memory);
  p->set_pci_bus_id(g.pci_bus_id);
  p->set_numa_node(g.numa_node);
  p->set_switch_id(g.switch_id);
}

inline Gpu FromProto(const pb::Gpu& p) {
  Gpu g;
  g.index = p.index();
  g.uuid = p.uuid();
  g.name = p.name();
  g.memory = p.memory();
  g.pci_bus_id = p.pci_bus_id();
  g.numa_node = p.numa_node();
  g.switch_id = p.switch_id();
  return g;
}

inline void ToProto(const Node& n, pb::Node* p) {
  p->set_name(n.name);
  for (const auto& g : n.gpus) ToProto(g, p->add_gpus());
  p->set_cpus(n.cpus);
  p->set_memory(n.memory);
  p->set_mode(ModeName(n.mode));
  for (const auto& [k, v] : n.labels) (*p->mutable_labels())[k] = v;
}

inline absl::StatusOr<Node> FromProto(const pb::Node& p) {
  Node n;
  n.name = p.name();
  for (const auto& g : p.gpus()) n.gpus.push_back(FromProto(g));
  n.cpus = p.cpus();
  n.memory = p.memory();
  DEEPNEX_ASSIGN_OR_RETURN(n.mode, ParseMode(p.mode(), "mode"));
  for (const auto& [k, v] : p.labels()) n.labels[k] = v;
  return n;
}

inline void ToProto(const NodeInfo& n, pb::NodeInfo* p) {
  ToProto(n.node, p->mutable_node());
  p->mutable_node()->set_mode(ModeName(n.mode));
  p->set_pending_mode(n.pending_mode ? ModeName(*n.pending_mode) : "");
  p->set_cordoned(n.cordoned);
  p->set_draining(n.draining);
  p->set_not_ready(!n.ready);
  p->set_last_heartbeat_ms(n.last_heartbeat_ms);
  p->set_cpus_busy(n.cpus_busy);
  p->set_memory_in_use(n.memory_in_use);
  p->set_address(n.address);
  for (uint64_t m : n.gpu_memory_used) p->add_gpu_memory_used(m);
  for (int c : n.gpu_allocations) p->add_gpu_allocations(c);
  p->set_cpus_used(n.cpus_used);
  p->set_memory_used(n.memory_used);
  for (const auto& id : n.allocation_ids) p->add_allocation_ids(id);
}

inline absl::StatusOr<NodeInfo> FromProto(const pb::NodeInfo& p) {
  NodeInfo n;
  DEEPNEX_ASSIGN_OR_RETURN(n.node, FromProto(p.node()));
  n.mode = n.node.mode;
  if (!p.pending_mode().empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(Mode m, ParseMode(p.pending_mode(), "pending_mode"));
    n.pending_mode = m;
  }
  n.cordoned = p.cordoned();
  n.draining = p.draining();
  n.ready = !p.not_ready();
  n.last_heartbeat_ms = p.last_heartbeat_ms();
  n.cpus_busy = p.cpus_busy();
  n.memory_in_use = p.memory_in_use();
  n.address = p.address();
  n.gpu_memory_used.assign(p.gpu_memory_used().begin(), p.gpu_memory_used().end());
  n.gpu_allocations.assign(p.gpu_allocations().begin(), p.gpu_allocations().end());
  n.cpus_used = p.cpus_used();
  n.memory_used = p.memory_used();
  n.allocation_ids.assign(p.allocation_ids().begin(), p.allocation_ids().end());
  return n;
}

inline void ToProto(const Allocation& a, pb::Allocation* p) {
  p->set_id(a.id);
  p->set_user(a.user);
  p->set_node(a.node);
  p->set_job(a.job);
  for (const auto& g : a.gpus) {
    pb::GrantedGpu* q = p->add_gpus();
    q->set_index(g.index);
    q->set_uuid(g.uuid);
    q->set_memory(g.memory);
    q->set_exclusive(g.exclusive);
  }
  p->set_cpus(a.cpus);
  p->set_memory(a.memory);
  p->set_priority(a.priority);
  p->set_gang(a.gang);
  p->set_replica(a.replica);
  p->set_lease_ms(a.lease_ms);
  p->set_expires_at_ms(a.expires_at_ms);
  for (const auto& [k, v] : a.env) (*p->mutable_env())[k] = v;
}

inline Allocation FromProto(const pb::Allocation& p) {
  Allocation a;
  a.id = p.id();
  a.user = p.user();
  a.node = p.node();
  a.job = p.job();
  for (const auto& q : p.gpus()) {
    GrantedGpu g;
    g.index = q.index();
    g.uuid = q.uuid();
    g.memory = q.memory();
    g.exclusive = q.exclusive();
    a.gpus.push_back(g);
  }
  a.cpus = p.cpus();
  a.memory = p.memory();
  a.priority = p.priority();
  a.gang = p.gang();
  a.replica = p.replica();
  a.lease_ms = p.lease_ms();
  a.expires_at_ms = p.expires_at_ms();
  for (const auto& [k, v] : p.env()) a.env[k] = v;
  return a;
}

inline void ToProto(const Request& r, const AllocateOptions& o, pb::Request* p) {
  p->set_user(r.user);
  p->set_job(r.job);
  p->set_gpus(r.gpus);
  p->set_mode(ModeName(r.mode));
  p->set_gpu_memory(r.gpu_memory);
  p->set_cpus(r.cpus);
  p->set_memory(r.memory);
  for (const auto& [k, v] : r.selector) (*p->mutable_selector())[k] = v;
  p->set_node(r.node);
  p->set_priority(r.priority);
  p->set_replicas(r.replicas);
  p->set_spread(r.spread);
  p->set_lease_ms(r.lease.count());
  p->set_wait(o.wait);
  p->set_timeout_ms(o.timeout.count());
}

inline absl::StatusOr<Request> FromProto(const pb::Request& p, AllocateOptions* o) {
  Request r;
  r.user = p.user();
  r.job = p.job();
  r.gpus = p.gpus();
  DEEPNEX_ASSIGN_OR_RETURN(r.mode, ParseMode(p.mode(), "mode"));
  r.gpu_memory = p.gpu_memory();
  r.cpus = p.cpus();
  r.memory = p.memory();
  for (const auto& [k, v] : p.selector()) r.selector[k] = v;
  r.node = p.node();
  r.priority = p.priority();
  r.replicas = p.replicas();
  r.spread = p.spread();
  r.lease = std::chrono::milliseconds(p.lease_ms());
  o->wait = p.wait();
  o->timeout = std::chrono::milliseconds(p.timeout_ms());
  return r;
}

inline void ToProto(const Quota& q, pb::Quota* p) {
  p->set_has_gpus(q.gpus.has_value());
  p->set_gpus(q.gpus.value_or(0));
  p->set_has_gpu_memory(q.gpu_memory.has_value());
  p->set_gpu_memory(q.gpu_memory.value_or(0));
  p->set_has_cpus(q.cpus.has_value());
  p->set_cpus(q.cpus.value_or(0));
  p->set_has_memory(q.memory.has_value());
  p->set_memory(q.memory.value_or(0));
  p->set_max_priority(q.max_priority);
}

inline Quota FromProto(const pb::Quota& p) {
  Quota q;
  if (p.has_gpus()) q.gpus = p.gpus();
  if (p.has_gpu_memory()) q.gpu_memory = p.gpu_memory();
  if (p.has_cpus()) q.cpus = p.cpus();
  if (p.has_memory()) q.memory = p.memory();
  q.max_priority = p.max_priority();
  return q;
}

inline void ToProto(const Usage& u, pb::Usage* p) {
  p->set_gpus(u.gpus);
  p->set_gpu_memory(u.gpu_memory);
  p->set_cpus(u.cpus);
  p->set_memory(u.memory);
}

inline Usage FromProto(const pb::Usage& p) {
  Usage u;
  u.gpus = p.gpus();
  u.gpu_memory = p.gpu_memory();
  u.cpus = p.cpus();
  u.memory = p.memory();
  return u;
}

inline void ToProto(const UserQuota& q, pb::UserQuota* p) {
  p->set_user(q.user);
  ToProto(q.quota, p->mutable_quota());
  p->set_own(q.own);
  ToProto(q.usage, p->mutable_usage());
}

inline UserQuota FromProto(const pb::UserQuota& p) {
  UserQuota q;
  q.user = p.user();
  q.quota = FromProto(p.quota());
  q.own = p.own();
  q.usage = FromProto(p.usage());
  return q;
}

inline void ToProto(const PendingRequest& r, pb::PendingRequest* p) {
  p->set_position(r.position);
  p->set_id(r.id);
  ToProto(r.request, AllocateOptions{}, p->mutable_request());
  p->mutable_request()->clear_wait();
  p->set_waited_ms(r.waited.count());
  p->set_reason(r.reason);
}

inline absl::StatusOr<PendingRequest> FromProto(const pb::PendingRequest& p) {
  PendingRequest r;
  r.position = p.position();
  r.id = p.id();
  AllocateOptions unused;
  DEEPNEX_ASSIGN_OR_RETURN(r.request, FromProto(p.request(), &unused));
  r.waited = std::chrono::milliseconds(p.waited_ms());
  r.reason = p.reason();
  return r;
}

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_CENTRAL_CONVERT_H_
