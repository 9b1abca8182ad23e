"""Sessions with containers on deepnex-central: exec, an interactive terminal
(shell, exec -it) and port forwarding, over deepnex._C.launch.Session (a
bidirectional stream through deepnex-central, and through the node's
deepnex-agent when the container runs there).

deepnex.gpu.CentralClient.exec and .port_forward call into here.
"""

import os
import select
import signal
import socket
import sys
import threading
from typing import Callable, NamedTuple, Optional, Sequence

from deepnex import _C
from deepnex.errors import InvalidArgumentError, UnavailableError

_CHUNK = 32 << 10


class ExecResult(NamedTuple):
    """How an exec ended: its exit code (128 + N for signal N) and, unless an
    on_output callback took them, its stdout and stderr."""
    exit_code: int
    stdout: bytes
    stderr: bytes


def open_session(c, name, command=(), tty=False, rows=0, cols=0, port=0, user=None):
    """A deepnex._C.launch.Session on `c` (a _C.launch.CentralClient)."""
    return _C.launch.open_session(c, name, list(command), tty, rows, cols, port, user or "")


def exec_(c, name: str, command: Sequence[str], input: Optional[bytes] = None,
          on_output: Optional[Callable[[str, bytes], None]] = None, user=None) -> ExecResult:
    """Runs `command` in container `name`; `input` is its stdin, then EOF."""
    if isinstance(command, str) or not command:
        raise InvalidArgumentError(f"command: {command!r} is not a non-empty list of arguments")
    if isinstance(input, str):
        input = input.encode()
    s = open_session(c, name, command, user=user)
    # Fed beside the reads: a process may write before it reads its input.
    feeder = threading.Thread(target=_send_stdin, args=(s, input), daemon=True)
    feeder.start()
    out, err = [], []
    try:
        while True:
            kind, data, code = s.read()
            if kind == "exit":
                return ExecResult(code, b"".join(out), b"".join(err))
            if on_output is not None:
                on_output(kind, data)
            else:
                (out if kind == "stdout" else err).append(data)
    finally:
        s.cancel()  # a feeder still writing ends now
        feeder.join()


def _send_stdin(s, data):
    """`data` to session `s`'s stdin in pieces (a message has a size limit),
    then EOF. A session that already ended (e.g. NotFound, sent at once, or
    a process that exited without reading it all) refuses them: its read()
    says why it ended."""
    try:
        for i in range(0, len(data or b""), _CHUNK):
            s.write(data[i:i + _CHUNK])
        s.close_stdin()
    except UnavailableError:
        pass


def _window(fd):
    try:
        size = os.get_terminal_size(fd)
        return size.lines, size.columns
    except OSError:
        return 0, 0


def attach(c, name: str, command: Sequence[str], tty: bool, interactive: bool,
           user=None, stdin_fd: int = 0, stdout_fd: int = 1, stderr_fd: int = 2) -> int:
    """Runs `command` in container `name` with this process's terminal: with
    `tty`, a pseudo-terminal there, this terminal in raw mode (Ctrl-C goes to
    the container), its size and every change of it (SIGWINCH) passed on;
    with `interactive`, stdin forwarded until EOF (on pipes, even with `tty`,
    where stdin is not a terminal). Returns the exit code."""
    import termios
    import tty as tty_module
    # Input that is not a terminal goes on pipes, as kubectl exec -it's
    # does: a pty's EOF is a ^D that a process may not have set its
    # terminal up to take yet, and `echo ls | deepnex exec box -it -- bash`
    # hung forever (probe). Pipes carry the EOF.
    tty = tty and (not interactive or os.isatty(stdin_fd))
    is_terminal = tty and os.isatty(stdin_fd)
    rows, cols = _window(stdin_fd) if is_terminal else (0, 0)
    s = open_session(c, name, command, tty=tty, rows=rows, cols=cols, user=user)
    saved = None
    old_winch = None
    stop_r, stop_w = os.pipe()

    def on_winch(signum, frame):
        r, c_ = _window(stdin_fd)
        try:
            s.resize(r, c_)
        except Exception:  # the session ended meanwhile
            pass

    def forward_stdin():
        try:
            while True:
                ready, _, _ = select.select([stdin_fd, stop_r], [], [])
                if stop_r in ready:
                    return
                data = os.read(stdin_fd, _CHUNK)
                if not data:
                    s.close_stdin()
                    return
                s.write(data)
        except Exception:  # the session ended: nobody reads the rest
            return

    reader = None
    try:
        if is_terminal:
            saved = termios.tcgetattr(stdin_fd)
            # TCSADRAIN, not setraw's default TCSAFLUSH: that discarded what
            # was typed while the client started.
            tty_module.setraw(stdin_fd, termios.TCSADRAIN)
            if threading.current_thread() is threading.main_thread():
                old_winch = signal.signal(signal.SIGWINCH, on_winch)
        if interactive:
            reader = threading.Thread(target=forward_stdin, daemon=True)
            reader.start()
        else:
            _send_stdin(s, None)
        while True:
            kind, data, code = s.read()
            if kind == "exit":
                return code
            _write_all(stdout_fd if kind == "stdout" else stderr_fd, data)
    finally:
        os.write(stop_w, b"x")
        if reader is not None:
            reader.join(timeout=1)
        os.close(stop_r)
        os.close(stop_w)
        if saved is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class PortForward:
    """A local TCP listener whose connections reach a port in a container,
    each through a session of its own. `port` is the local one; close()
    stops listening and ends the open connections."""

    def __init__(self, c, name: str, remote: int, local: int = 0, host: str = "127.0.0.1",
                 user=None):
        if not isinstance(remote, int) or not 1 <= remote <= 65535:
            raise InvalidArgumentError(f"remote port: {remote!r} is not a TCP port (1 to 65535)")
        if not isinstance(local, int) or not 0 <= local <= 65535:
            raise InvalidArgumentError(f"local port: {local!r} is not a TCP port (0 to 65535)")
        self._c, self._name, self._remote, self._user = c, name, remote, user
        self._listener = socket.create_server((host, local))
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open = set()
        self._threads = []
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn):
        try:
            s = open_session(self._c, self._name, port=self._remote, user=self._user)
        except Exception as e:
            print(f"deepnex: port-forward to {self._name}:{self._remote}: {e}", file=sys.stderr)
            conn.close()
            return
        with self._lock:
            if self._closed:
                s.cancel()
                conn.close()
                return
            self._open.add(s)

        def upstream():
            try:
                while True:
                    data = conn.recv(_CHUNK)
                    if not data:
                        s.close_stdin()
                        return
                    s.write(data)
            except Exception:
                return
        up = threading.Thread(target=upstream, daemon=True)
        up.start()
        try:
            while True:
                kind, data, _ = s.read()
                if kind == "exit":
                    break
                conn.sendall(data)
        except Exception as e:
            if not self._closed:
                print(f"deepnex: port-forward to {self._name}:{self._remote}: {e}",
                      file=sys.stderr)
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
            s.cancel()
            # The session goes with this thread, not at the interpreter's
            # exit (gRPC cannot end a stream then).
            up.join(timeout=5)
            with self._lock:
                self._open.discard(s)

    def close(self):
        with self._lock:
            self._closed = True
            sessions = list(self._open)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        for s in sessions:
            s.cancel()
        self._accepter.join(timeout=5)
        # Sessions must not outlive the interpreter's exit.
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
