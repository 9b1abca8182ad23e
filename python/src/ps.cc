// deepnex._C.ps: the parameter-server classes and their option structs. The
// Python layer (python/deepnex/ps.py) turns dicts of arrays into the (key,
// buffer, dtype) lists these take.
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

// (key, buffer, dtype override or None), as ps.py builds them with
// deepnex._convert.to_buffer (the override: bfloat16 tensors).
using TensorArgs = std::vector<std::tuple<std::string, py::buffer, std::optional<DType>>>;

struct Views {
  std::vector<BufferView> buffers;
  std::vector<NamedTensor> tensors;
};

Views ViewsOf(const TensorArgs& args, bool writable, const char* op) {
  // Not ViewOf's every dtype: a probe told to use int32 was refused next.
  static constexpr char kParameters[] =
      "parameters are float32, float64, float16 or bfloat16 (bfloat16 as uint16 bits with an "
      "explicit bfloat16 dtype)";
  Views v;
  v.buffers.reserve(args.size());
  for (const auto& [key, buffer, as] : args) {
    v.buffers.push_back(
        ViewOf(buffer, writable, std::string(op) + " of \"" + key + "\"", as, kParameters));
    v.tensors.push_back({key, v.buffers.back().view});
  }
  return v;
}

// For the intervals where 0 means off (or "the server's choice"): 0 or less
// is 0, as ps.Server has always taken them.
std::chrono::milliseconds MillisOrOff(double seconds, const char* field) {
  if (!(seconds > 0)) return std::chrono::milliseconds(0);
  return Millis(seconds, field);
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

  // The option structs, bound so that their defaults live only in C++:
  // deepnex/ps.py reads its keyword defaults from fresh ones.
  py::class_<ServerOptions> server_options(m, "ServerOptions");
  server_options.def(py::init<>())
      .def_readwrite("address", &ServerOptions::address)
      .def_readwrite("advertise", &ServerOptions::advertise)
      .def_property(
          "mode", [](const ServerOptions& o) { return ps::ModeName(o.mode); },
          [](ServerOptions& o, const std::string& name) { o.mode = Unwrap(ps::ParseMode(name)); })
      .def_readwrite("num_workers", &ServerOptions::num_workers)
      .def_readwrite("staleness", &ServerOptions::staleness)
      .def_property(
          "reduction", [](const ServerOptions& o) { return ps::ReductionName(o.reduction); },
          [](ServerOptions& o, const std::string& name) {
            o.reduction = Unwrap(ps::ParseReduction(name));
          })
      .def_readwrite("optimizer", &ServerOptions::optimizer)
      .def_property(
          "lease_policy",
          [](const ServerOptions& o) { return ps::LeasePolicyName(o.lease_policy); },
          [](ServerOptions& o, const std::string& name) {
            o.lease_policy = Unwrap(ps::ParseLeasePolicy(name));
          })
      .def_readwrite("keep_dead_contributions", &ServerOptions::keep_dead_contributions)
      .def_readwrite("reject_nonfinite", &ServerOptions::reject_nonfinite)
      .def_readwrite("max_message_bytes", &ServerOptions::max_message_bytes)
      .def_readwrite("max_pull_reply_bytes", &ServerOptions::max_pull_reply_bytes)
      .def_readwrite("max_pending_reply_bytes", &ServerOptions::max_pending_reply_bytes)
      .def_readwrite("max_deferred_push_bytes", &ServerOptions::max_deferred_push_bytes)
      .def_readwrite("bulk_tcp", &ServerOptions::bulk_tcp)
      .def_readwrite("token", &ServerOptions::token)
      .def_readwrite("token_file", &ServerOptions::token_file)
      .def_readwrite("job_id", &ServerOptions::job_id)
      .def_readwrite("tls_cert_file", &ServerOptions::tls_cert_file)
      .def_readwrite("tls_key_file", &ServerOptions::tls_key_file)
      .def_readwrite("name", &ServerOptions::name)
      .def_readwrite("checkpoint_dir", &ServerOptions::checkpoint_dir)
      .def_readwrite("checkpoint_every_rounds", &ServerOptions::checkpoint_every_rounds)
      .def_readwrite("restore_dir", &ServerOptions::restore_dir)
      .def_readwrite("metrics_address", &ServerOptions::metrics_address)
      .def_readwrite("drop_push_replies_for_testing",
                     &ServerOptions::drop_push_replies_for_testing);
  DefSeconds(server_options, "lease_timeout", &ServerOptions::lease_timeout, Millis);
  DefSeconds(server_options, "heartbeat_interval", &ServerOptions::heartbeat_interval,
             MillisOrOff);
  DefSeconds(server_options, "checkpoint_interval", &ServerOptions::checkpoint_interval,
             MillisOrOff);

  py::class_<ClientOptions> client_options(m, "ClientOptions");
  client_options.def(py::init<>())
      .def_readwrite("servers", &ClientOptions::servers)
      .def_readwrite("worker_id", &ClientOptions::worker_id)
      .def_readwrite("partition_bytes", &ClientOptions::partition_bytes)
      .def_readwrite("request_bytes", &ClientOptions::request_bytes)
      .def_readwrite("connections_per_server", &ClientOptions::connections_per_server)
      .def_readwrite("token", &ClientOptions::token)
      .def_readwrite("token_file", &ClientOptions::token_file)
      .def_readwrite("tls_ca_file", &ClientOptions::tls_ca_file)
      .def_readwrite("heartbeat", &ClientOptions::heartbeat)
      .def_property(
          "transport", [](const ClientOptions& o) { return ps::TransportName(o.transport); },
          [](ClientOptions& o, const std::string& name) {
            o.transport = Unwrap(ps::ParseTransport(name));
          })
      .def_readwrite("shm_bytes", &ClientOptions::shm_bytes);
  DefSeconds(client_options, "timeout", &ClientOptions::timeout, Millis);
  DefSeconds(client_options, "retry_backoff", &ClientOptions::retry_backoff, Millis);

  py::class_<Server>(m, "Server")
      .def(py::init([](const ServerOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(Server::Create(o));
           }),
           py::arg("options"))
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
      .def(py::init([](const ClientOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(Client::Create(o));
           }),
           py::arg("options"))
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
      .def("close", [](Client& c) { CheckStatus(c.Close()); })
      .def("leave", [](Client& c) { CheckStatus(c.Leave()); });
}

}  // namespace deepnex::python
