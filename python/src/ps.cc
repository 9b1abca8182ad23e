// deepnex._C.ps: the parameter-server classes. The Python layer
// (python/deepnex/ps.py) turns dicts of arrays into the (key, buffer, dtype)
// lists these take.
#include <algorithm>
#include <chrono>
#include <memory>

#include "common.h"
#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"

namespace deepnex::python {
namespace {

using ps::Client;
using ps::ClientOptions;
using ps::NamedTensor;
using ps::OptimizerConfig;
using ps::PendingOp;
using ps::Server;
using ps::ServerOptions;

// (key, buffer, dtype override or None), as ps.py builds them.
using TensorArgs = std::vector<std::tuple<std::string, py::buffer, std::optional<std::string>>>;

struct Views {
  std::vector<BufferView> buffers;
  std::vector<NamedTensor> tensors;
};

Views ViewsOf(const TensorArgs& args, bool writable, const char* op) {
  Views v;
  v.buffers.reserve(args.size());
  for (const auto& [key, buffer, as] : args) {
    std::optional<DType> dtype;
    if (as) dtype = Unwrap(ParseDType(*as));
    v.buffers.push_back(ViewOf(buffer, writable, std::string(op) + " of \"" + key + "\"", dtype));
    v.tensors.push_back({key, v.buffers.back().view});
  }
  return v;
}

std::chrono::milliseconds Millis(double seconds, const char* field) {
  if (!(seconds > 0)) {
    ThrowStatus(absl::InvalidArgumentError(
        std::string(field) + "=" + std::to_string(seconds) + ": must be positive seconds"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// An operation in flight and the buffers it reads or writes, pinned until it
// is done (dropping the handle early waits for the operation).
class PyPendingOp {
 public:
  PyPendingOp(std::shared_ptr<PendingOp> op, std::vector<Views> views)
      : op_(std::move(op)), views_(std::move(views)) {}
  ~PyPendingOp() {
    if (op_ && !op_->Done()) {
      py::gil_scoped_release release;
      op_->Wait().IgnoreError();
    }
  }
  void Wait(std::optional<double> timeout) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = timeout ? op_->Wait(Millis(*timeout, "timeout")) : op_->Wait();
    }
    CheckStatus(s);
  }
  bool Done() const { return op_->Done(); }

 private:
  std::shared_ptr<PendingOp> op_;
  std::vector<Views> views_;
};

}  // namespace

void RegisterPs(py::module_& parent) {
  py::module_ m = parent.def_submodule("ps", "parameter server (C++ core)");

  py::class_<OptimizerConfig>(m, "OptimizerConfig")
      .def(py::init([](const std::string& kind, double lr, double momentum, bool nesterov,
                       double weight_decay, double beta1, double beta2, double eps,
                       double initial_accumulator) {
             OptimizerConfig c;
             c.kind = Unwrap(ps::ParseOptimizerKind(kind));
             c.lr = lr;
             c.momentum = momentum;
             c.nesterov = nesterov;
             c.weight_decay = weight_decay;
             c.beta1 = beta1;
             c.beta2 = beta2;
             c.eps = eps;
             c.initial_accumulator = initial_accumulator;
             CheckStatus(c.Validate());
             return c;
           }),
           py::arg("kind") = "sgd", py::arg("lr") = 0.01, py::arg("momentum") = 0.0,
           py::arg("nesterov") = false, py::arg("weight_decay") = 0.0,
           py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
           py::arg("initial_accumulator") = 0.0)
      .def_property_readonly("kind", [](const OptimizerConfig& c) {
        return ps::OptimizerKindName(c.kind);
      })
      .def_readonly("lr", &OptimizerConfig::lr)
      .def("__repr__", &OptimizerConfig::ToString);

  py::class_<Server>(m, "Server")
      .def(py::init([](const std::string& address, const std::string& mode, int num_workers,
                       int staleness, const std::string& reduction,
                       const OptimizerConfig& optimizer, bool reject_nonfinite,
                       uint64_t max_message_bytes, uint64_t max_pull_reply_bytes,
                       uint64_t max_pending_reply_bytes, uint64_t max_deferred_push_bytes,
                       const std::string& token,
                       const std::string& token_file, const std::string& job_id,
                       const std::string& tls_cert_file, const std::string& tls_key_file,
                       double lease_timeout, double heartbeat_interval,
                       const std::string& lease_policy,
                       bool keep_dead_contributions, const std::string& name,
                       const std::string& checkpoint_dir, uint64_t checkpoint_every_rounds,
                       double checkpoint_interval, const std::string& restore_dir,
                       const std::string& metrics_address,
                       int drop_push_replies_for_testing, const std::string& advertise) {
             ServerOptions o;
             o.address = address;
             o.advertise = advertise;
             o.mode = Unwrap(ps::ParseMode(mode));
             o.num_workers = num_workers;
             o.staleness = staleness;
             o.lease_timeout = Millis(lease_timeout, "lease_timeout");
             o.heartbeat_interval = std::chrono::milliseconds(
                 static_cast<int64_t>(std::max(0.0, heartbeat_interval) * 1000));
             o.lease_policy = Unwrap(ps::ParseLeasePolicy(lease_policy));
             o.keep_dead_contributions = keep_dead_contributions;
             o.name = name;
             o.checkpoint_dir = checkpoint_dir;
             o.checkpoint_every_rounds = checkpoint_every_rounds;
             o.checkpoint_interval = std::chrono::milliseconds(
                 static_cast<int64_t>(std::max(0.0, checkpoint_interval) * 1000));
             o.restore_dir = restore_dir;
             o.metrics_address = metrics_address;
             o.drop_push_replies_for_testing = drop_push_replies_for_testing;
             o.reduction = Unwrap(ps::ParseReduction(reduction));
             o.optimizer = optimizer;
             o.reject_nonfinite = reject_nonfinite;
             o.max_message_bytes = max_message_bytes;
             o.max_pull_reply_bytes = max_pull_reply_bytes;
             o.max_pending_reply_bytes = max_pending_reply_bytes;
             o.max_deferred_push_bytes = max_deferred_push_bytes;
             o.token = token;
             o.token_file = token_file;
             o.job_id = job_id;
             o.tls_cert_file = tls_cert_file;
             o.tls_key_file = tls_key_file;
             py::gil_scoped_release release;
             return Unwrap(Server::Create(o));
           }),
           py::arg("address"), py::arg("mode"), py::arg("num_workers"), py::arg("staleness"),
           py::arg("reduction"), py::arg("optimizer"), py::arg("reject_nonfinite"),
           py::arg("max_message_bytes"), py::arg("max_pull_reply_bytes"),
           py::arg("max_pending_reply_bytes"), py::arg("max_deferred_push_bytes"),
           py::arg("token"), py::arg("token_file"),
           py::arg("job_id"), py::arg("tls_cert_file"), py::arg("tls_key_file"),
           py::arg("lease_timeout"), py::arg("heartbeat_interval"), py::arg("lease_policy"),
           py::arg("keep_dead_contributions"), py::arg("name"), py::arg("checkpoint_dir"),
           py::arg("checkpoint_every_rounds"), py::arg("checkpoint_interval"),
           py::arg("restore_dir"), py::arg("metrics_address"),
           py::arg("drop_push_replies_for_testing"), py::arg("advertise") = "")
      .def_property_readonly("address", &Server::address)
      .def_property_readonly("port", &Server::port)
      .def_property_readonly("metrics_port", &Server::metrics_port)
      .def("metrics_text", &Server::MetricsText)
      .def("checkpoint",
           [](Server& s, const std::string& dir, double timeout) {
             absl::StatusOr<uint64_t> round;
             {
               py::gil_scoped_release release;
               round = s.Checkpoint(dir, Millis(timeout, "timeout"));
             }
             return Unwrap(std::move(round));
           },
           py::arg("dir"), py::arg("timeout") = 60.0)
      .def("stop", &Server::Stop, py::call_guard<py::gil_scoped_release>())
      .def("wait", &Server::Wait, py::call_guard<py::gil_scoped_release>());

  py::class_<PyPendingOp>(m, "PendingOp")
      .def("wait", &PyPendingOp::Wait, py::arg("timeout") = py::none())
      .def("done", &PyPendingOp::Done);

  py::class_<Client>(m, "Client")
      .def(py::init([](const std::vector<std::string>& servers, int worker_id,
                       uint64_t partition_bytes, uint64_t request_bytes, double timeout,
                       int connections_per_server, const std::string& token,
                       const std::string& token_file, const std::string& tls_ca_file,
                       bool heartbeat, double retry_backoff) {
             ClientOptions o;
             o.heartbeat = heartbeat;
             o.retry_backoff = Millis(retry_backoff, "retry_backoff");
             o.servers = servers;
             o.worker_id = worker_id;
             o.partition_bytes = partition_bytes;
             o.request_bytes = request_bytes;
             o.timeout = Millis(timeout, "timeout");
             o.connections_per_server = connections_per_server;
             o.token = token;
             o.token_file = token_file;
             o.tls_ca_file = tls_ca_file;
             py::gil_scoped_release release;
             return Unwrap(Client::Create(o));
           }),
           py::arg("servers"), py::arg("worker_id"), py::arg("partition_bytes"),
           py::arg("request_bytes"), py::arg("timeout"), py::arg("connections_per_server"),
           py::arg("token"), py::arg("token_file"), py::arg("tls_ca_file"),
           py::arg("heartbeat"), py::arg("retry_backoff"))
      .def("init",
           [](Client& c, const TensorArgs& tensors) {
             Views v = ViewsOf(tensors, false, "init");
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Init(v.tensors);
             }
             CheckStatus(s);
           })
      .def("push",
           [](Client& c, const TensorArgs& grads) {
             Views v = ViewsOf(grads, false, "push");
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Push(v.tensors);
             }
             CheckStatus(s);
           })
      .def("pull_into",
           [](Client& c, const TensorArgs& out) {
             Views v = ViewsOf(out, true, "pull");
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Pull(v.tensors);
             }
             CheckStatus(s);
           })
      .def("push_pull_into",
           [](Client& c, const TensorArgs& grads, const TensorArgs& out) {
             Views g = ViewsOf(grads, false, "push");
             Views o = ViewsOf(out, true, "pull");
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.PushPull(g.tensors, o.tensors);
             }
             CheckStatus(s);
           })
      .def("push_async",
           [](Client& c, const TensorArgs& grads) {
             Views g = ViewsOf(grads, false, "push");
             auto op = c.PushAsync(g.tensors);
             std::vector<Views> keep;
             keep.push_back(std::move(g));
             return std::make_unique<PyPendingOp>(std::move(op), std::move(keep));
           })
      .def("pull_into_async",
           [](Client& c, const TensorArgs& out) {
             Views o = ViewsOf(out, true, "pull");
             auto op = c.PullAsync(o.tensors);
             std::vector<Views> keep;
             keep.push_back(std::move(o));
             return std::make_unique<PyPendingOp>(std::move(op), std::move(keep));
           })
      .def("push_pull_into_async",
           [](Client& c, const TensorArgs& grads, const TensorArgs& out) {
             Views g = ViewsOf(grads, false, "push");
             Views o = ViewsOf(out, true, "pull");
             auto op = c.PushPullAsync(g.tensors, o.tensors);
             std::vector<Views> keep;
             keep.push_back(std::move(g));
             keep.push_back(std::move(o));
             return std::make_unique<PyPendingOp>(std::move(op), std::move(keep));
           })
      .def("describe",
           [](Client& c, const std::vector<std::string>& keys) {
             absl::StatusOr<std::vector<ps::TensorInfo>> infos;
             {
               py::gil_scoped_release release;
               infos = c.Describe(keys);
             }
             std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, uint64_t>> out;
             for (const auto& i : Unwrap(std::move(infos))) {
               out.emplace_back(i.key, DTypeName(i.dtype), i.shape, i.version);
             }
             return out;
           })
      .def("stats",
           [](Client& c) {
             absl::StatusOr<std::vector<ps::ServerStats>> stats;
             {
               py::gil_scoped_release release;
               stats = c.Stats();
             }
             py::list out;
             for (const auto& s : Unwrap(std::move(stats))) {
               py::dict d;
               d["address"] = s.address;
               d["mode"] = s.mode;
               d["staleness"] = s.staleness;
               d["num_workers"] = s.num_workers;
               d["live_workers"] = s.live_workers;
               d["pushes"] = s.pushes;
               d["pulls"] = s.pulls;
               d["bytes_in"] = s.bytes_in;
               d["bytes_out"] = s.bytes_out;
               d["rounds"] = s.rounds;
               d["round_latency_p50"] = s.round_latency_p50;
               d["round_latency_p99"] = s.round_latency_p99;
               d["lease_expiries"] = s.lease_expiries;
               d["checkpoints"] = s.checkpoints;
               d["checkpoint_round"] = s.checkpoint_round;
               d["min_version"] = s.min_version;
               d["max_version"] = s.max_version;
               py::list workers;
               for (const auto& w : s.workers) {
                 py::dict wd;
                 wd["worker"] = w.worker;
                 wd["state"] = w.state;
                 wd["pushes"] = w.pushes;
                 wd["max_lead"] = w.max_lead;
                 wd["late_pushes"] = w.late_pushes;
                 workers.append(wd);
               }
               d["workers"] = workers;
               d["prometheus"] = s.prometheus;
               out.append(d);
             }
             return out;
           })
      .def("checkpoint",
           [](Client& c, const std::string& name) {
             absl::StatusOr<std::vector<uint64_t>> rounds;
             {
               py::gil_scoped_release release;
               rounds = c.Checkpoint(name);
             }
             return Unwrap(std::move(rounds));
           },
           py::arg("name"))
      .def_property_readonly("worker_id", &Client::worker_id)
      .def("close", [](Client& c) { CheckStatus(c.Close()); });
}

}  // namespace deepnex::python
