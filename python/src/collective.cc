// deepnex._C.collective: the rendezvous store and communicators. The Python
// layer (python/deepnex/collective.py) turns arrays and tensors into the
// (buffer, dtype override) pairs these take and allocates outputs.
#include <chrono>
#include <memory>

#include "common.h"
#include "deepnex/collective/bucketing.h"
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

BufferView View(const py::buffer& b, const std::optional<DType>& as, bool writable,
                const char* what) {
  return ViewOf(b, writable, what, as);
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
// The dtype override deepnex._convert.to_buffer gives (bfloat16 tensors).
using As = std::optional<DType>;

// A view of device (or any) memory given as an address, for CUDA tensors,
// which have no buffer protocol. The Python layer keeps the tensor alive.
TensorView RawView(uintptr_t ptr, const std::string& dtype, int64_t count) {
  return TensorView(reinterpret_cast<void*>(ptr), Unwrap(ParseDType(dtype)), {count});
}

// A bucketer and the buffers it reads and writes, pinned for its lifetime.
struct PyBucketer {
  py::object comm;  // keeps the Communicator alive
  std::vector<BufferView> buffers;
  std::unique_ptr<collective::GradientBucketer> bucketer;
};

}  // namespace

void RegisterCollective(py::module_& parent) {
  py::module_ m = parent.def_submodule("collective", "rendezvous store and communicators");

  py::class_<StoreServer>(m, "StoreServer")
      .def(py::init([](const std::string& address, const std::string& token,
                       const std::string& token_file, uint64_t max_value_bytes,
                       const std::string& advertise) {
             StoreServerOptions o;
             o.address = address;
             o.advertise = advertise;
             o.token = token;
             o.token_file = token_file;
             o.max_value_bytes = max_value_bytes;
             py::gil_scoped_release release;
             return Unwrap(StoreServer::Create(o));
           }),
           py::arg("address"), py::arg("token"), py::arg("token_file"),
           py::arg("max_value_bytes"), py::arg("advertise") = "")
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
                       const std::string& token, const std::string& token_file, int device,
                       const std::string& host) {
             CommunicatorOptions o;
             o.host = host;
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
           py::arg("token_file"), py::arg("device"), py::arg("host") = "")
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
      .def("allreduce_raw_async",
           [](Communicator& c, uintptr_t ptr, const std::string& dtype, int64_t count,
              const std::string& op) {
             auto reduce = Unwrap(collective::ParseReduceOp(op));
             return std::make_unique<PyWork>(c.AllReduceAsync(RawView(ptr, dtype, count), reduce),
                                             std::vector<BufferView>{});
           })
      .def("broadcast_raw_async",
           [](Communicator& c, uintptr_t ptr, const std::string& dtype, int64_t count, int root) {
             return std::make_unique<PyWork>(c.BroadcastAsync(RawView(ptr, dtype, count), root),
                                             std::vector<BufferView>{});
           })
      .def("allgather_raw_async",
           [](Communicator& c, uintptr_t in, uintptr_t out, const std::string& dtype, int64_t count) {
             return std::make_unique<PyWork>(
                 c.AllGatherAsync(RawView(in, dtype, count),
                                  RawView(out, dtype, count * c.world_size())),
                 std::vector<BufferView>{});
           })
      .def("reduce_scatter_raw_async",
           [](Communicator& c, uintptr_t in, uintptr_t out, const std::string& dtype,
              int64_t count, const std::string& op) {
             auto reduce = Unwrap(collective::ParseReduceOp(op));
             return std::make_unique<PyWork>(
                 c.ReduceScatterAsync(RawView(in, dtype, count * c.world_size()),
                                      RawView(out, dtype, count), reduce),
                 std::vector<BufferView>{});
           })
      .def("abort", &Communicator::Abort, py::call_guard<py::gil_scoped_release>());

  py::class_<PyBucketer>(m, "GradientBucketer")
      .def(py::init([](py::object comm, const std::vector<std::pair<Buf, As>>& tensors,
                       uint64_t bucket_bytes, const std::string& op) {
             auto b = std::make_unique<PyBucketer>();
             b->comm = comm;
             std::vector<TensorView> views;
             for (size_t i = 0; i < tensors.size(); ++i) {
               std::string what = "bucketed tensor " + std::to_string(i);
               b->buffers.push_back(View(tensors[i].first, tensors[i].second, true, what.c_str()));
               views.push_back(b->buffers.back().view);
             }
             collective::BucketOptions o;
             o.bucket_bytes = bucket_bytes;
             o.op = Unwrap(collective::ParseReduceOp(op));
             b->bucketer = Unwrap(collective::GradientBucketer::Create(
                 &comm.cast<Communicator&>(), std::move(views), o));
             return b;
           }),
           py::arg("comm"), py::arg("tensors"), py::arg("bucket_bytes"), py::arg("op"))
      .def("mark_ready",
           [](PyBucketer& b, size_t i) { CheckStatus(b.bucketer->MarkReady(i)); })
      .def("mark_all_ready", [](PyBucketer& b) { CheckStatus(b.bucketer->MarkAllReady()); })
      .def("wait",
           [](PyBucketer& b) {
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = b.bucketer->Wait();
             }
             CheckStatus(s);
           })
      .def_property_readonly("num_buckets",
                             [](const PyBucketer& b) { return b.bucketer->num_buckets(); })
      .def_property_readonly("bucket_of",
                             [](const PyBucketer& b) { return b.bucketer->BucketOf(); });
}

}  // namespace deepnex::python
