#include "common.h"
namespace deepnex::python {
void RegisterPs(pybind11::module_& m) {}
}
