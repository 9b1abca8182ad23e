// Bindings of deepnex's core: errors, byte sizes, dtypes, the job context.
#include <Python.h>

#include <map>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common.h"
#include "deepnex/env.h"
#include "deepnex/tensor.h"
#include "deepnex/units.h"

namespace deepnex::python {
namespace {

// Sets the Python error for `status`: deepnex.errors.error_for_code(code)
// with the message. Falls back to RuntimeError if deepnex.errors cannot be
// imported (e.g. _C loaded outside its package).
void SetPythonError(const absl::Status& status) {
  std::string code = absl::StatusCodeToString(status.code());
  // Bytes that are not UTF-8 (a path named in the error) as \xNN: a strict
  // decode failed, and the caller got a UnicodeDecodeError instead.
  const absl::string_view text = status.message();
  PyObject* decoded = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()),
                                           "backslashreplace");
  if (decoded == nullptr) return;  // out of memory: that error is set
  py::str message = py::reinterpret_steal<py::str>(decoded);
  try {
    py::object cls =
        py::module_::import("deepnex.errors").attr("error_for_code")(code);
    py::object error = cls(message);
    PyErr_SetObject(cls.ptr(), error.ptr());
  } catch (py::error_already_set&) {
    PyErr_SetObject(PyExc_RuntimeError, py::str(py::str("{}: {}").format(code, message)).ptr());
  }
}

std::string Repr(const Context& c) {
  py::list ps_addrs;
  for (const std::string& a : c.ps_addrs) ps_addrs.append(a);
  return absl::StrCat(
      "Context(job_id=", py::repr(py::str(c.job_id)).cast<std::string>(),
      ", role='", RoleName(c.role), "', rank=", c.rank,
      ", world_size=", c.world_size, ", local_rank=", c.local_rank,
      ", ps_addrs=", py::repr(ps_addrs).cast<std::string>(),
      ", store_addr=", py::repr(py::str(c.store_addr)).cast<std::string>(),
      ", token=", c.token.empty() ? "''" : "'<set>'", ", cuda_visible_devices=",
      py::repr(py::str(c.cuda_visible_devices)).cast<std::string>(),
      ", nvidia_visible_devices=",
      py::repr(py::str(c.nvidia_visible_devices)).cast<std::string>(),
      ", gpu_memory_limit=",
      c.gpu_memory_limit ? absl::StrCat(*c.gpu_memory_limit) : "None", ")");
}

uint64_t ByteCount(const py::int_& bytes) {
  unsigned long long value = PyLong_AsUnsignedLongLong(bytes.ptr());
  if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    ThrowStatus(absl::InvalidArgumentError(
        absl::StrCat("bytes=", py::repr(bytes).cast<std::string>(),
                     " is not a byte count (0 .. 2**64 - 1)")));
  }
  return value;
}

}  // namespace

void RegisterCore(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      SetPythonError(e.status());
    }
  });

  m.def(
      "parse_byte_size",
      [](const std::string& text, const std::string& field) {
        return Unwrap(ParseByteSize(text, field));
      },
      py::arg("text"), py::arg("field") = "size",
      "Bytes in a size such as '8GiB', '512M', '1.5G' or '4096'. Raises "
      "InvalidArgumentError naming `field` and the text.");
  m.def(
      "format_byte_size",
      [](const py::int_& bytes) { return FormatByteSize(ByteCount(bytes)); },
      py::arg("bytes"),
      "Shortest exact form in binary units: 8589934592 -> '8GiB'.");

  py::enum_<DType>(m, "DType", "Element types of deepnex tensors.")
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("uint8", DType::kUInt8);
  m.def(
      "parse_dtype",
      [](const std::string& name) { return Unwrap(ParseDType(name)); },
      py::arg("name"), "The DType called `name` ('float32', ...).");
  m.def(
      "dtype_size", [](DType dtype) { return DTypeSize(dtype); },
      py::arg("dtype"), "Bytes per element.");
  py::list names;
  for (int v = 1; IsValidDType(v); ++v) {
    names.append(DTypeName(static_cast<DType>(v)));
  }
  m.attr("DTYPE_NAMES") = py::tuple(names);

  py::class_<Context>(m, "Context",
                      "What this process is within its job (read-only). "
                      "Build it with Context.from_env().")
      .def_property_readonly("job_id",
                             [](const Context& c) { return c.job_id; })
      .def_property_readonly(
          "role",
          [](const Context& c) { return std::string(RoleName(c.role)); },
          "'worker', 'ps' or 'chief'")
      .def_property_readonly("rank", [](const Context& c) { return c.rank; })
      .def_property_readonly("world_size",
                             [](const Context& c) { return c.world_size; })
      .def_property_readonly("local_rank",
                             [](const Context& c) { return c.local_rank; })
      .def_property_readonly(
          "ps_addrs", [](const Context& c) { return c.ps_addrs; },
          "host:port of each parameter server")
      .def_property_readonly("store_addr",
                             [](const Context& c) { return c.store_addr; })
      .def_property_readonly("token", [](const Context& c) { return c.token; })
      .def_property_readonly(
          "cuda_visible_devices",
          [](const Context& c) { return c.cuda_visible_devices; })
      .def_property_readonly(
          "nvidia_visible_devices",
          [](const Context& c) { return c.nvidia_visible_devices; })
      .def_property_readonly(
          "gpu_memory_limit",
          [](const Context& c) { return c.gpu_memory_limit; },
          "bytes per GPU (shared mode), or None")
      .def_static(
          "from_env",
          [](const std::optional<py::object>& environ) {
            if (!environ.has_value() || environ->is_none()) {
              return Unwrap(Context::FromEnv());
            }
            py::object mapping = *environ;
            return Unwrap(Context::FromLookup(
                [&mapping](
                    const std::string& name) -> std::optional<std::string> {
                  py::str key(name);
                  if (!mapping.contains(key)) return std::nullopt;
                  return py::str(mapping[key]).cast<std::string>();
                }));
          },
          py::arg("environ") = py::none(),
          "Reads the job environment from os.environ, or from the mapping "
          "`environ`. Raises InvalidArgumentError naming a missing or "
          "malformed variable.")
      .def("to_env", &Context::ToEnv,
           "The variables that reproduce this context, with torchrun's. "
           "Holds the token.")
      .def("__repr__", &Repr);

  // Test hooks, not API.
  m.def(
      "_view_info",
      [](const py::buffer& buffer, bool writable, std::optional<DType> dtype) {
        BufferView v = ViewOf(buffer, writable, "array", dtype);
        return py::make_tuple(
            DTypeName(v.view.dtype), py::tuple(py::cast(v.view.shape)),
            reinterpret_cast<uintptr_t>(v.view.data), v.view.NumBytes());
      },
      py::arg("array"), py::arg("writable") = false,
      py::arg("dtype") = py::none(),
      "(dtype name, shape, data address, bytes) of ViewOf(array).");
  m.def(
      "_raise_status",
      [](int code, const std::string& message) {
        if (code == 0) return;
        ThrowStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
      },
      py::arg("code"), py::arg("message"),
      "Raises the exception for absl status code `code`.");
}

}  // namespace deepnex::python
