// deepnex._C.collective: the rendezvous store and communicators. The Python
// layer (python/deepnex/collective.py) turns arrays and tensors into the
// (buffer, dtype override) pairs these take, allocates outputs and fills the
// bound option structs, whose defaults are C++'s.
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

  // The option structs, bound so that their defaults live only in C++:
  // deepnex/collective.py reads its keyword defaults from fresh ones.
  py::class_<StoreServerOptions>(m, "StoreServerOptions")
      .def(py::init<>())
      .def_readwrite("address", &StoreServerOptions::address)
      .def_readwrite("advertise", &StoreServerOptions::advertise)
      .def_readwrite("token", &StoreServerOptions::token)
      .def_readwrite("token_file", &StoreServerOptions::token_file)
      .def_readwrite("tls_cert_file", &StoreServerOptions::tls_cert_file)
      .def_readwrite("tls_key_file", &StoreServerOptions::tls_key_file)
      .def_readwrite("max_value_bytes", &StoreServerOptions::max_value_bytes)
      .def_readwrite("max_bytes", &StoreServerOptions::max_bytes);

  py::class_<StoreClientOptions> client_options(m, "StoreClientOptions");
  client_options.def(py::init<>())
      .def_readwrite("address", &StoreClientOptions::address)
      .def_readwrite("prefix", &StoreClientOptions::prefix)
      .def_readwrite("token", &StoreClientOptions::token)
      .def_readwrite("token_file", &StoreClientOptions::token_file)
      .def_readwrite("tls_ca_file", &StoreClientOptions::tls_ca_file);
  DefSeconds(client_options, "timeout", &StoreClientOptions::timeout, Millis);

  py::class_<CommunicatorOptions> comm_options(m, "CommunicatorOptions");
  comm_options.def(py::init<>())
      .def_readwrite("rank", &CommunicatorOptions::rank)
      .def_readwrite("world_size", &CommunicatorOptions::world_size)
      .def_readwrite("store", &CommunicatorOptions::store_address)
      .def_readwrite("prefix", &CommunicatorOptions::prefix)
      .def_readwrite("token", &CommunicatorOptions::token)
      .def_readwrite("token_file", &CommunicatorOptions::token_file)
      .def_property(
          "backend",
          [](const CommunicatorOptions& o) { return collective::BackendName(o.backend); },
          [](CommunicatorOptions& o, const std::string& name) {
            o.backend = Unwrap(collective::ParseBackend(name));
          })
      .def_property(
          "transport",
          [](const CommunicatorOptions& o) { return collective::TransportName(o.transport); },
          [](CommunicatorOptions& o, const std::string& name) {
            o.transport = Unwrap(collective::ParseTransport(name));
          })
      .def_readwrite("connections_per_peer", &CommunicatorOptions::connections_per_peer)
      .def_readwrite("shm_channels", &CommunicatorOptions::shm_channels)
      .def_readwrite("shm_buffer_bytes", &CommunicatorOptions::shm_buffer_bytes)
      .def_readwrite("host", &CommunicatorOptions::host)
      .def_readwrite("device", &CommunicatorOptions::device);
  DefSeconds(comm_options, "timeout", &CommunicatorOptions::timeout, Millis);

  py::class_<collective::BucketOptions>(m, "BucketOptions")
      .def(py::init<>())
      .def_readwrite("bucket_bytes", &collective::BucketOptions::bucket_bytes)
      .def_property(
          "op", [](const collective::BucketOptions& o) { return collective::ReduceOpName(o.op); },
          [](collective::BucketOptions& o, const std::string& name) {
            o.op = Unwrap(collective::ParseReduceOp(name));
          });

  py::class_<StoreServer>(m, "StoreServer")
      .def(py::init([](const StoreServerOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(StoreServer::Create(o));
           }),
           py::arg("options"))
      .def_property_readonly("address", &StoreServer::address)
      .def_property_readonly("port", &StoreServer::port)
      .def("__len__", &StoreServer::size)
      .def("stop", &StoreServer::Stop, py::call_guard<py::gil_scoped_release>());

  py::class_<StoreClient>(m, "StoreClient")
      .def(py::init([](const StoreClientOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(StoreClient::Create(o));
           }),
           py::arg("options"))
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
      .def(py::init([](const CommunicatorOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(Communicator::Create(o));
           }),
           py::arg("options"))
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
      // Takes this rank's part in a collective `kind` that deepnex/collective.py
      // could not issue (its arguments were refused here): as a tensor every
      // backend refuses (a negative dimension), so that the other ranks' call
      // fails with InvalidArgument too and every rank stays in step. It runs
      // on the queue unwaited.
      .def("refuse",
           [](Communicator& c, const std::string& kind) {
             const TensorView refused(nullptr, DType::kFloat32, {-1});
             if (kind == "allreduce") {
               c.AllReduceAsync(refused, collective::ReduceOp::kSum);
             } else if (kind == "broadcast") {
               c.BroadcastAsync(refused, 0);
             } else if (kind == "allgather") {
               c.AllGatherAsync(refused, refused);
             } else if (kind == "reduce_scatter") {
               c.ReduceScatterAsync(refused, refused, collective::ReduceOp::kSum);
             } else {
               ThrowStatus(absl::InvalidArgumentError("refuse: unknown collective " + kind));
             }
           },
           py::call_guard<py::gil_scoped_release>())
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
                       const collective::BucketOptions& options) {
             auto b = std::make_unique<PyBucketer>();
             b->comm = comm;
             std::vector<TensorView> views;
             for (size_t i = 0; i < tensors.size(); ++i) {
               std::string what = "bucketed tensor " + std::to_string(i);
               b->buffers.push_back(View(tensors[i].first, tensors[i].second, true, what.c_str()));
               views.push_back(b->buffers.back().view);
             }
             b->bucketer = Unwrap(collective::GradientBucketer::Create(
                 &comm.cast<Communicator&>(), std::move(views), options));
             return b;
           }),
           py::arg("comm"), py::arg("tensors"), py::arg("options"))
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
