// deepnex._C: the compiled part of the deepnex package. Each part of deepnex
// adds its bindings through Register<Part> (see common.h).
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
}
