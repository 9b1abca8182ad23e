// deepnex._C: the compiled part of the deepnex package. Each part of deepnex
// adds its bindings through Register<Part> (see common.h).
#include <string_view>

#include "common.h"

#ifndef DEEPNEX_VERSION
#error "DEEPNEX_VERSION must be defined by the build"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepnex's C++ core; use the deepnex package rather than _C.";
  m.attr("__version__") = DEEPNEX_VERSION;
  deepnex::python::RegisterCore(m);
  deepnex::python::RegisterPs(m);
  deepnex::python::RegisterCollective(m);
  deepnex::python::RegisterGpu(m);
  deepnex::python::RegisterData(m);
  deepnex::python::RegisterLaunch(m);
  deepnex::python::RegisterJob(m);
  deepnex::python::RegisterJobs(m);
  // A child forked (os.fork, multiprocessing's default) keeps every deepnex
  // object it inherited alive for good. Their threads were not forked: a
  // destructor there would wait for ever on a condition variable those
  // threads were waiting on, or join a thread that is not there (a probe's
  // child hung in `del client` and crashed at exit). The child's calls on
  // them fail (CheckForkSafe), its exit leaves them, the parent goes on.
  namespace py = pybind11;
  m.def("_keep_inherited", [] {
    for (const auto& [ptr, instance] : py::detail::get_internals().registered_instances) {
      auto* o = reinterpret_cast<PyObject*>(instance);
      if (std::string_view(Py_TYPE(o)->tp_name).substr(0, 11) == "deepnex._C.") Py_INCREF(o);
    }
  });
  py::module_::import("os").attr("register_at_fork")(
      py::arg("after_in_child") = m.attr("_keep_inherited"));
}
