// deepnex._C.launch.Session: the client's end of a session with a container
// on deepnex-central (exec, shell, port-forward); the Python layer
// (deepnex/_session.py) moves a terminal's or a socket's bytes through it.
#include "common.h"
#include "deepnex/launch/central.h"
#include "deepnex/launch/session.h"

namespace deepnex::python {

void RegisterSession(py::module_& m) {
  py::class_<launch::Session>(m, "Session")
      .def(
          "write",
          [](launch::Session& s, py::bytes data) {
            std::string d = data;
            py::gil_scoped_release release;
            CheckStatus(s.Write(d));
          },
          py::arg("data"))
      .def(
          "close_stdin", [](launch::Session& s) { CheckStatus(s.CloseStdin()); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "resize", [](launch::Session& s, int rows, int cols) { CheckStatus(s.Resize(rows, cols)); },
          py::arg("rows"), py::arg("cols"), py::call_guard<py::gil_scoped_release>())
      // ("stdout" | "stderr", bytes, 0) or ("exit", b"", code); raises the
      // session's error.
      .def("read",
           [](launch::Session& s) {
             launch::SessionEvent e;
             {
               py::gil_scoped_release release;
               e = Unwrap(s.Read());
             }
             const char* kind = e.kind == launch::SessionEvent::Kind::kStdout   ? "stdout"
                                : e.kind == launch::SessionEvent::Kind::kStderr ? "stderr"
                                                                                : "exit";
             return py::make_tuple(kind, py::bytes(e.data), e.exit_code);
           })
      .def("cancel", &launch::Session::Cancel, py::call_guard<py::gil_scoped_release>());

  m.def(
      "open_session",
      [](launch::CentralClient& c, const std::string& container,
         const std::vector<std::string>& command, bool tty, int rows, int cols, int port,
         const std::string& user) {
        launch::SessionOptions o;
        o.container = container;
        o.command = command;
        o.tty = tty;
        o.rows = rows;
        o.cols = cols;
        o.port = port;
        o.user = user;
        py::gil_scoped_release release;
        return Unwrap(c.OpenSession(o));
      },
      py::arg("client"), py::arg("container"), py::arg("command"), py::arg("tty") = false,
      py::arg("rows") = 0, py::arg("cols") = 0, py::arg("port") = 0, py::arg("user") = "");
}

}  // namespace deepnex::python
