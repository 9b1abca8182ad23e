// deepnex._C.collective: the rendezvous store and communicators. The Python
// layer (python/deepnex/collective.py) turns arrays and tensors into the
// (buffer, dtype override) pairs these take and allocates outputs.
#include <chrono>
#include <memory>

#include "common.h"
#include "deepnex/collective/communicator.h"
#include "deepnex/collective/store.h"

namespace deepnex::python {
namespace {

using collective::Communicator;
using collective::CommunicatorOptions;
using collective::StoreClient;
using collective::StoreClientOptions;
using collective::StoreServer;
using collective::StoreServerOptions;
using collective::Work;

std::chrono::milliseconds Millis(double seconds, const char* field) {
  if (!(seconds > 0)) {
    ThrowStatus(absl::InvalidArgumentError(std::string(field) + "=" + std::to_string(seconds) +
                                           ": must be positive seconds"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

BufferView View(const py::buffer& b, const std::optional<std::string>& as, bool writable,
                const char* what) {
  std::optional<DType> dtype;
  if (as) dtype = Unwrap(ParseDType(*as));
  return ViewOf(b, writable, what, dtype);
}

// A collective in flight and the buffers it uses, pinned until it is done
// (dropping the handle early waits for the collective).
class PyWork {
 public:
  PyWork(std::shared_ptr<Work> work, std::vector<BufferView> buffers)
      : work_(std::move(work)), buffers_(std::move(buffers)) {}
  ~PyWork() {
    if (work_ && !work_->Done()) {
      py::gil_scoped_release release;
      work_->Wait().IgnoreError();
    }
  }
  void Wait(std::optional<double> timeout) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = timeout ? work_->Wait(Millis(*timeout, "timeout")) : work_->Wait();
    }
    CheckStatus(s);
  }
  bool Done() const { return work_->Done(); }

 private:
  std::shared_ptr<Work> work_;
  std::vector<BufferView> buffers_;
};

using Buf = py::buffer;
using As = std::optional<std::string>;

}  // namespace

void RegisterCollective(py::module_& parent) {
  py::module_ m = parent.def_submodule("collective", "rendezvous store and communicators");

  py::class_<StoreServer>(m, "StoreServer")
      .def(py::init([](const std::string& address, const std::string& token,
                       const std::string& token_file, uint64_t max_value_bytes) {
             StoreServerOptions o;
             o.address = address;
             o.token = token;
             o.token_file = token_file;
             o.max_value_bytes = max_value_bytes;
             py::gil_scoped_release release;
             return Unwrap(StoreServer::Create(o));
           }),
           py::arg("address"), py::arg("token"), py::arg("token_file"),
           py::arg("max_value_bytes"))
      .def_property_readonly("address", &StoreServer::address)
      .def_property_readonly("port", &StoreServer::port)
      .def("__len__", &StoreServer::size)
      .def("stop", &StoreServer::Stop, py::call_guard<py::gil_scoped_release>());

  py::class_<StoreClient>(m, "StoreClient")
      .def(py::init([](const std::string& address, const std::string& prefix, double timeout,
                       const std::string& token, const std::string& token_file) {
             StoreClientOptions o;
             o.address = address;
             o.prefix = prefix;
             o.timeout = Millis(timeout, "timeout");
             o.token = token;
             o.token_file = token_file;
             py::gil_scoped_release release;
             return Unwrap(StoreClient::Create(o));
           }),
           py::arg("address"), py::arg("prefix"), py::arg("timeout"), py::arg("token"),
           py::arg("token_file"))
      .def("set",
           [](StoreClient& c, const std::string& key, const py::bytes& value) {
             std::string v = value;
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Set(key, v);
             }
             CheckStatus(s);
           })
      .def("get",
           [](StoreClient& c, const std::vector<std::string>& keys, double timeout) {
             absl::StatusOr<std::vector<std::string>> values;
             {
               py::gil_scoped_release release;
               values = c.MultiGet(keys, Millis(timeout, "timeout"));
             }
             py::list out;
             for (const std::string& v : Unwrap(std::move(values))) out.append(py::bytes(v));
             return out;
           })
      .def("add",
           [](StoreClient& c, const std::string& key, int64_t delta) {
             py::gil_scoped_release release;
             return Unwrap(c.Add(key, delta));
           })
      .def("compare_set",
           [](StoreClient& c, const std::string& key, const py::bytes& expected,
              const py::bytes& desired) {
             std::string e = expected, d = desired;
             absl::StatusOr<std::string> v;
             {
               py::gil_scoped_release release;
               v = c.CompareSet(key, e, d);
             }
             return py::bytes(Unwrap(std::move(v)));
           })
      .def("delete",
           [](StoreClient& c, const std::string& key) {
             py::gil_scoped_release release;
             return Unwrap(c.Delete(key));
           })
      .def("wait",
           [](StoreClient& c, const std::vector<std::string>& keys, double timeout) {
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Wait(keys, Millis(timeout, "timeout"));
             }
             CheckStatus(s);
           })
      .def("check",
           [](StoreClient& c, const std::vector<std::string>& keys) {
             py::gil_scoped_release release;
             return Unwrap(c.Check(keys));
           })
      .def_property_readonly("address", &StoreClient::address)
      .def_property_readonly("prefix", &StoreClient::prefix);

  py::class_<PyWork>(m, "Work")
      .def("wait", &PyWork::Wait, py::arg("timeout") = py::none())
      .def("done", &PyWork::Done);

  py::class_<Communicator>(m, "Communicator")
      .def(py::init([](int rank, int world_size, const std::string& store,
                       const std::string& prefix, const std::string& backend, double timeout,
                       const std::string& transport, int connections_per_peer, int shm_channels,
                       const std::string& token, const std::string& token_file, int device) {
             CommunicatorOptions o;
             o.rank = rank;
             o.world_size = world_size;
             o.store_address = store;
             o.prefix = prefix;
             o.backend = Unwrap(collective::ParseBackend(backend));
             o.timeout = Millis(timeout, "timeout");
             o.transport = Unwrap(collective::ParseTransport(transport));
             o.connections_per_peer = connections_per_peer;
             o.shm_channels = shm_channels;
             o.token = token;
             o.token_file = token_file;
             o.device = device;
             py::gil_scoped_release release;
             return Unwrap(Communicator::Create(o));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("store"), py::arg("prefix"),
           py::arg("backend"), py::arg("timeout"), py::arg("transport"),
           py::arg("connections_per_peer"), py::arg("shm_channels"), py::arg("token"),
           py::arg("token_file"), py::arg("device"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("backend",
                             [](const Communicator& c) { return collective::BackendName(c.backend()); })
      .def_property_readonly("transport", &Communicator::transport)
      .def("allreduce_async",
           [](Communicator& c, const Buf& x, const As& as, const std::string& op) {
             auto reduce = Unwrap(collective::ParseReduceOp(op));
             std::vector<BufferView> keep;
             keep.push_back(View(x, as, true, "allreduce"));
             auto work = c.AllReduceAsync(keep[0].view, reduce);
             return std::make_unique<PyWork>(std::move(work), std::move(keep));
           })
      .def("broadcast_async",
           [](Communicator& c, const Buf& x, const As& as, int root) {
             std::vector<BufferView> keep;
             keep.push_back(View(x, as, true, "broadcast"));
             auto work = c.BroadcastAsync(keep[0].view, root);
             return std::make_unique<PyWork>(std::move(work), std::move(keep));
           })
      .def("allgather_async",
           [](Communicator& c, const Buf& in, const Buf& out, const As& as) {
             std::vector<BufferView> keep;
             keep.push_back(View(in, as, false, "allgather input"));
             keep.push_back(View(out, as, true, "allgather output"));
             auto work = c.AllGatherAsync(keep[0].view, keep[1].view);
             return std::make_unique<PyWork>(std::move(work), std::move(keep));
           })
      .def("reduce_scatter_async",
           [](Communicator& c, const Buf& in, const Buf& out, const As& as, const std::string& op) {
             auto reduce = Unwrap(collective::ParseReduceOp(op));
             std::vector<BufferView> keep;
             keep.push_back(View(in, as, false, "reduce_scatter input"));
             keep.push_back(View(out, as, true, "reduce_scatter output"));
             auto work = c.ReduceScatterAsync(keep[0].view, keep[1].view, reduce);
             return std::make_unique<PyWork>(std::move(work), std::move(keep));
           })
      .def("barrier_async",
           [](Communicator& c) { return std::make_unique<PyWork>(c.BarrierAsync(), std::vector<BufferView>{}); })
      .def("abort", &Communicator::Abort, py::call_guard<py::gil_scoped_release>());
}

}  // namespace deepnex::python
