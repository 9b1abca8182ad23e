// deepnex._C.data: the data sharder. python/deepnex/data.py wraps it with
// iteration and batching.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common.h"
#include "deepnex/data/sharder.h"

namespace deepnex::python {
namespace {

using data::ShardState;
using data::Sharder;
using data::SharderOptions;

// A uint64 vector as an int64 numpy array (numpy indexes with int64; sizes
// beyond 2^63 items do not occur).
py::array_t<int64_t> ToArray(const std::vector<uint64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  int64_t* p = out.mutable_data();
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<int64_t>(v[i]);
  return out;
}

// Python ints may be negative; the C++ fields are unsigned.
uint64_t NonNegative(int64_t value, const char* field) {
  if (value < 0) {
    ThrowStatus(absl::InvalidArgumentError(absl::StrCat(field, ": ", value, " is negative")));
  }
  return static_cast<uint64_t>(value);
}

}  // namespace

void RegisterData(py::module_& parent) {
  py::module_ m = parent.def_submodule("data", "data sharding");
  py::class_<Sharder>(m, "Sharder")
      .def(py::init([](int64_t size, int num_shards, int shard, bool shuffle, uint64_t seed,
                       const std::string& remainder) {
             SharderOptions o;
             o.size = NonNegative(size, "size");
             o.num_shards = num_shards;
             o.shard = shard;
             o.shuffle = shuffle;
             o.seed = seed;
             o.remainder = Unwrap(data::ParseRemainder(remainder));
             return Unwrap(Sharder::Create(o));
           }),
           py::arg("size"), py::arg("num_shards"), py::arg("shard"), py::arg("shuffle"),
           py::arg("seed"), py::arg("remainder"))
      .def_property_readonly("shard_size", &Sharder::shard_size)
      .def_property_readonly("epoch_length", &Sharder::epoch_length)
      .def_property_readonly("remaining", &Sharder::remaining)
      .def_property_readonly("num_shards", [](const Sharder& s) { return s.options().num_shards; })
      .def_property_readonly("shard", [](const Sharder& s) { return s.options().shard; })
      .def_property_readonly("epoch", &Sharder::epoch)
      .def_property_readonly("position", &Sharder::position)
      .def("permutation",
           [](const Sharder& s, int64_t epoch) {
             return ToArray(s.Permutation(NonNegative(epoch, "epoch")));
           })
      .def("indices",
           [](const Sharder& s, int64_t epoch) {
             return ToArray(s.Indices(NonNegative(epoch, "epoch")));
           })
      .def("seek",
           [](Sharder& s, int64_t epoch, int64_t position) {
             CheckStatus(s.Seek(NonNegative(epoch, "epoch"), NonNegative(position, "position")));
           })
      .def("state",
           [](const Sharder& s) {
             ShardState st = s.state();
             py::list ranges;
             for (const auto& [first, second] : st.ranges) {
               ranges.append(py::make_tuple(first, second));
             }
             py::dict out;
             out["epoch"] = st.epoch;
             out["position"] = st.position;
             out["num_shards"] = st.num_shards;
             out["ranges"] = ranges;
             return out;
           })
      .def("reshard",
           [](Sharder& s, int64_t epoch, int64_t position, int from_shards,
              const std::vector<std::pair<int64_t, int64_t>>& ranges, int num_shards, int shard) {
             ShardState from;
             from.epoch = NonNegative(epoch, "state.epoch");
             from.position = NonNegative(position, "state.position");
             from.num_shards = from_shards;
             for (const auto& [first, second] : ranges) {
               from.ranges.emplace_back(NonNegative(first, "state.ranges"),
                                        NonNegative(second, "state.ranges"));
             }
             CheckStatus(s.Reshard(from, num_shards, shard));
           },
           py::arg("epoch"), py::arg("position"), py::arg("from_shards"), py::arg("ranges"),
           py::arg("num_shards"), py::arg("shard"))
      .def("next", [](Sharder& s, int64_t max_count) {
        if (max_count < 1) {
          ThrowStatus(absl::InvalidArgumentError(
              absl::StrCat("batch_size: ", max_count, " must be at least 1")));
        }
        return ToArray(s.Next(static_cast<uint64_t>(max_count)));
      });
}

}  // namespace deepnex::python
