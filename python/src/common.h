// Shared helpers for deepnex's pybind11 bindings (module deepnex._C): status
// to exception translation and zero-copy buffer views. Every binding file
// includes this header; each part registers itself through Register<Part>.
#ifndef DEEPNEX_PYTHON_COMMON_H_
#define DEEPNEX_PYTHON_COMMON_H_

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "deepnex/status.h"
#include "deepnex/tensor.h"

namespace deepnex::launch {
struct LauncherOptions;
}  // namespace deepnex::launch

namespace deepnex::python {

namespace py = pybind11;

// Adds the bindings of one part to the module; called by module.cc, core
// first.
void RegisterCore(py::module_& m);
void RegisterPs(py::module_& m);
void RegisterCollective(py::module_& m);
void RegisterGpu(py::module_& m);
void RegisterData(py::module_& m);
void RegisterLaunch(py::module_& m);
void RegisterSession(py::module_& m);  // into deepnex._C.launch
void RegisterJob(py::module_& m);
void RegisterJobs(py::module_& m);

// The holder of a bound object whose destructor blocks on threads that may
// call into Python (a launcher's supervisors, a job's log pumps): the GIL is
// released while it runs, or those threads could never finish.
template <class T>
struct ReleaseGilDeleter {
  void operator()(T* p) const {
    py::gil_scoped_release release;
    delete p;
  }
};
template <class T>
using GilFreeHolder = std::unique_ptr<T, ReleaseGilDeleter<T>>;
template <class T>
GilFreeHolder<T> GilFree(std::unique_ptr<T> p) {
  return GilFreeHolder<T>(p.release());
}

// Launcher options from Python keywords (backend, state_dir, runc,
// docker_socket, ...; see python/deepnex/launch.py); shared by launch and job.
launch::LauncherOptions LauncherOptionsFromPython(const py::dict& kw);

// A duration given in seconds, as SecondsToMillis (deepnex/units.h) takes
// it; what it refuses is raised as InvalidArgumentError naming `field`.
// Millis wants more than 0, MillisOrZero 0 or more.
std::chrono::milliseconds Millis(double seconds, const char* field);
std::chrono::milliseconds MillisOrZero(double seconds, const char* field);

// Binds a std::chrono::milliseconds field of an options struct as the
// property `name` in seconds (a float), the unit of every duration in the
// Python API; `to_millis(seconds, name)` checks and converts a value set.
template <class Options, class... Extra>
void DefSeconds(py::class_<Options, Extra...>& c, const char* name,
                std::chrono::milliseconds Options::*field,
                std::chrono::milliseconds (*to_millis)(double, const char*)) {
  c.def_property(
      name, [field](const Options& o) { return (o.*field).count() / 1000.0; },
      [field, name, to_millis](Options& o, double seconds) {
        o.*field = to_millis(seconds, name);
      });
}

// A C++ exception carrying a non-OK status. RegisterCore installs a
// translator that raises it in Python as the deepnex.errors class for its
// code (e.g. InvalidArgumentError, also a ValueError), message as the text,
// `.code` the code's name ("INVALID_ARGUMENT"). It holds no Python object, so
// it may be thrown with the GIL released; translation happens when pybind11
// returns to Python.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status);
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

// REQUIRES: !status.ok().
[[noreturn]] void ThrowStatus(const absl::Status& status);

// Raises (see StatusError) when `status` is not OK.
inline void CheckStatus(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

// The value, or raises the error (see StatusError).
template <class T>
T Unwrap(absl::StatusOr<T> status_or) {
  if (!status_or.ok()) ThrowStatus(status_or.status());
  return std::move(status_or).value();
}

// A zero-copy view of a Python buffer (numpy array, or a torch CPU tensor
// after `t.numpy()`): `view` points into the object's own memory.
//
// Lifetime: `info` holds the Py_buffer, which keeps the exporting object
// alive and its memory pinned (a numpy array cannot be resized while the
// buffer is held), so `view.data` stays valid for as long as this struct
// lives, even if the caller drops its reference. Move-only. Destroy it with
// the GIL held: create it before a py::gil_scoped_release block and let it go
// out of scope after that block ends:
//
//   BufferView grads = ViewOf(array, /*writable=*/false, "grads");
//   {
//     py::gil_scoped_release release;
//     CheckStatus(client.Push(grads.view));  // may throw: StatusError holds
//   }                                        // no Python object
//   // `grads` is destroyed here, with the GIL held again.
//
// Python code may still write the memory while C++ reads it; bindings that
// need a stable snapshot must say so in their contract.
struct BufferView {
  py::buffer_info info;
  TensorView view;
};

// Checks `buffer` and returns a view of its memory, never a copy.
// InvalidArgumentError (a ValueError), naming `what`, when:
//   - the format is not one of float32 'f', float64 'd', float16 'e',
//     int32 'i' (or 'l' of 4 bytes), int64 'q' / 'l' of 8 bytes, uint8 'B'
//     (native byte order; '@', '=' and '<' prefixes accepted);
//   - the strides are not C-contiguous (size-1 and empty dimensions excepted);
//   - `writable` and the buffer is read-only;
//   - `as` is given and the buffer's dtype differs from it.
// bfloat16: no Python type exports bfloat16 through the buffer protocol, so a
// uint16 ('H') or int16 ('h') buffer is accepted only with as ==
// DType::kBFloat16 and its bits are taken as bfloat16 values.
// `supported` ends the message for a dtype deepnex does not take: what the
// caller takes (default: every dtype above).
BufferView ViewOf(const py::buffer& buffer, bool writable,
                  const std::string& what,
                  std::optional<DType> as = std::nullopt,
                  const char* supported = nullptr);

}  // namespace deepnex::python

#endif  // DEEPNEX_PYTHON_COMMON_H_
