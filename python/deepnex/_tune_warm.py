"""Warm trials for deepnex.tune: a trial's Python script started by fork
from a process that has imported what the script imports, instead of by a
fresh interpreter that imports torch again (seconds per trial).

    python3 _tune_warm.py serve SOCKET SCRIPT      the warm worker
    python3 _tune_warm.py run SOCKET ARGV...       a trial's process
    python3 _tune_warm.py slot CONTROL SOCKET      a slot's process


The search starts one warm worker ("serve") per search. It imports the
modules that SCRIPT imports anywhere (torch, numpy, its own sibling modules
and theirs), then forks one child per request. It has no threads and no
deepnex store or connection when it forks (it checks its threads: with more
than one a fork could copy a held lock, and it declines, so the trial runs
cold). Before that it makes the script's tune.warm(fn, ...) calls (data
loaded once for all the trials; see deepnex.tune.warm).

"run" takes the trial's place wherever the trial's command would run (as
a plain process, or as a job's worker): it hands its environment, working
directory and stdin/stdout/stderr to the warm worker, whose child runs
ARGV's script there as __main__; signals sent to it go to the child's
process group, and it exits with the child's code (or dies of its signal).
So each trial is still its own process, with its own environment, exit
code and logs. Without a warm worker (it failed to start, or declined) it
execs ARGV: the cold trial.

"slot" is the one process of a trial slot's job (see _tune_runners): the
slot keeps its job, and so its allocation, across trials. It takes each
trial from the runner over CONTROL ({"argv", "env"}, {"signal"}), runs it
as "run" does, with its own environment on top of the job's, and ends it
by sending its exit code over CONTROL at once, and by a line "<_END> CODE"
on its output, after all the trial's output: the runner closes the
trial's log there.
Without a warm worker the trial runs cold, as a child process.

Only the standard library at module level: "run" starts in ~30 ms.
"""

import array
import json
import os
import select
import signal
import socket
import sys

_MAX_MESSAGE = 1 << 20


def _send(sock, message, fds=()):
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _receive(sock, max_fds=0):
    """A message and the descriptors that came with it; (None, []) at EOF."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(max_fds * fds.itemsize)
                                         if max_fds else 0)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


# ---- the trial's side

def run(path, argv):
    """Runs argv through the warm worker at path (see the module's doc)."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _connect(sock, path)
        _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, fds=(0, 1, 2))
        reply, _ = _receive(sock)
    except OSError:
        reply = None
    if not reply or not ("pid" in reply or "exit" in reply):
        _cold(argv, reply)
    # The child may say its exit code before the worker says its pid.
    while "exit" not in reply:
        pid = reply["pid"]

        def forward(signum, frame):
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                    signal.SIGUSR2):
            signal.signal(sig, forward)
        while True:
            try:
                reply, _ = _receive(sock)
                break
            except InterruptedError:
                continue
            except OSError:   # the warm worker is gone, and the trial with it
                reply = None
                break
        if reply is None:
            reply = {"exit": -signal.SIGKILL}
    code = reply["exit"]
    if code < 0:
        # Die of the child's signal, as the cold trial's process would have.
        if -code != signal.SIGKILL:   # whose handler cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# The line a slot's process ends each trial's output with, and its code.
_END = "\x1edeepnex-slot-end"


def slot(control_path, path):
    """A trial slot's process (see the module's doc): trials one after
    the other until the runner closes CONTROL."""
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control.connect(control_path)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the runner stops the trials itself
    while True:
        request, _ = _receive(control)
        if request is None:
            return
        if "argv" not in request:   # a signal for a trial that has ended
            continue
        code = _slot_trial(control, path, request["argv"], {**os.environ, **request["env"]})
        # The end line after the trial's output (the job's log may deliver
        # it later); the code at once.
        os.write(1, f"{_END} {code}\n".encode())
        try:
            _send(control, {"exit": code})
        except OSError:   # the runner is gone
            return


def _slot_trial(control, path, argv, env):
    """Runs one trial of a slot; its exit code (-signal when killed)."""
    import subprocess
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _connect(sock, path)
        _send(sock, {"argv": argv, "env": env, "cwd": os.getcwd()}, fds=(0, 1, 2))
        reply, _ = _receive(sock)
    except OSError:
        reply = None
    cold = None
    if not reply or not ("pid" in reply or "exit" in reply):
        if reply and reply.get("cold"):
            print(f"deepnex tune: running cold: {reply['cold']}", file=sys.stderr, flush=True)
        cold = subprocess.Popen(argv, env=env, start_new_session=True)
        reply = {"pid": cold.pid}
    while "exit" not in reply:
        readable, _, _ = select.select([control] + ([] if cold else [sock]), [], [],
                                       None if cold is None else 0.05)
        if control in readable:
            message, _ = _receive(control)
            if message is None:   # the runner is gone: so is the trial
                message = {"signal": signal.SIGKILL}
            if "signal" in message:
                _kill_group(reply["pid"], message["signal"])
        if cold is not None:
            if cold.poll() is not None:
                reply = {"exit": cold.returncode}
        elif sock in readable:
            try:
                reply, _ = _receive(sock)
            except OSError:
                reply = None
            if reply is None:   # the warm worker is gone, and the trial with it
                reply = {"exit": -signal.SIGKILL}
    if cold is None:
        sock.close()
    return reply["exit"]


# How long a trial waits for the warm worker's socket (it binds it as it
# starts, before importing) before it runs cold.
_BIND_WAIT = 10.0


def _connect(sock, path):
    import time
    deadline = time.monotonic() + _BIND_WAIT
    while True:
        try:
            return sock.connect(path)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _cold(argv, reply):
    if reply and reply.get("cold"):
        print(f"deepnex tune: running cold: {reply['cold']}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


# ---- the warm worker

def _imports(script):
    """The modules the script imports anywhere, in order."""
    import ast
    with open(script) as f:
        tree = ast.parse(f.read(), script)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return list(dict.fromkeys(names))


def _make_warm_calls(script):
    """Makes the script's tune.warm(fn, literal arguments) calls (see
    deepnex.tune.warm), fn found among the script's imports, so that the
    trials forked after find their results made."""
    import ast
    import time
    with open(script) as f:
        tree = ast.parse(f.read(), script)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and _is_warm(node.func) and node.args]
    if not calls:
        return
    from deepnex import _tune_report
    # The names the script imports, as it binds them.
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            try:
                exec(compile(ast.Module([node], []), script, "exec"), names)
            except Exception:  # noqa: BLE001 - serve() has said why the import failed
                pass
    for call in calls:
        what = f"tune.warm({ast.unparse(call.args[0])}) at line {call.lineno}"
        try:
            if not _is_dotted(call.args[0]):
                raise ValueError("not a function's name")
            fn = eval(compile(ast.Expression(call.args[0]), script, "eval"), names)
            args = [ast.literal_eval(a) for a in call.args[1:]]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
            if len(kwargs) != len(call.keywords) or _tune_report._warm_key(fn, (), {}) is None:
                raise ValueError("not an imported function")
        except (NameError, AttributeError, ValueError, TypeError, SyntaxError) as e:
            print(f"warm: {what}: each trial makes it (the function is not one the script "
                  f"imports, or an argument is not a literal: {e})", flush=True)
            continue
        start = time.monotonic()
        try:
            _tune_report.warm(fn, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - each trial will make it, and say it
            print(f"warm: {what}: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"warm: {what} made in {time.monotonic() - start:.2f} s", flush=True)


def _is_warm(func):
    """Whether a call's function reads as tune.warm (or a bare warm)."""
    import ast
    if isinstance(func, ast.Name):
        return func.id == "warm"
    return (isinstance(func, ast.Attribute) and func.attr == "warm"
            and _is_dotted(func.value) and ast.unparse(func.value).split(".")[-1] == "tune")


def _is_dotted(node):
    """Whether node is a name or a dotted name (a.b.c)."""
    import ast
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _threads():
    return len(os.listdir("/proc/self/task"))


def serve(path, script):
    """Imports the script's modules, then forks a child per request until
    stdin closes (the search is gone); the children go with it."""
    import ctypes
    import importlib
    global _libc
    _libc = ctypes.CDLL(None, use_errno=True)
    # Listening before the imports: the first trials' connections wait in
    # the backlog until it accepts them, ready (or see it gone, and go cold).
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the search stops its trials itself
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(128)
    here = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, here)
    # The script's imports, and those of its own modules beside it (which
    # may import torch or sklearn only inside a function).
    names, scanned = _imports(script), {script}
    while names:
        name = names.pop(0)
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the trial will say it, cold or warm
            print(f"warm: import {name}: {type(e).__name__}: {e}", flush=True)
            continue
        path = getattr(module, "__file__", None) or ""
        if os.path.dirname(os.path.abspath(path)) == here and path not in scanned:
            scanned.add(path)
            names += [n for n in _imports(path) if n not in sys.modules]
    _make_warm_calls(script)
    threads = _threads()
    unsafe = (f"the warm worker has {threads} threads after importing what {script} "
              "imports; forking it could copy a lock held by another thread"
              if threads > 1 else None)
    print(f"warm: ready ({len(sys.modules)} modules, {threads} thread"
          f"{'' if threads == 1 else 's'})", flush=True)
    children = {}    # pid -> its client's connection
    peers = {}       # connection -> child pid
    try:
        _serve(listener, children, peers, unsafe)
    finally:
        # However the worker ends, no trial outlives it.
        for pid in children:
            _kill_group(pid, signal.SIGKILL)


def _serve(listener, children, peers, unsafe):
    while True:
        readable, _, _ = select.select([sys.stdin, listener] + list(peers), [], [], 0.02)
        for r in readable:
            if r is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif r is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn, max_fds=3)
                except OSError:   # a stand-in stopped as it asked
                    request, fds = None, []
                if request is None or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                if unsafe:
                    try:
                        _send(conn, {"cold": unsafe})
                    except OSError:
                        pass
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, conn, [listener] + list(peers))
                for fd in fds:
                    os.close(fd)
                children[pid], peers[conn] = conn, pid
                try:
                    _send(conn, {"pid": pid})
                except OSError:
                    # The stand-in died (stopped) before it learnt its pid:
                    # its hang-up, seen next round, ends the child.
                    pass
            else:
                # A client that went away (killed) takes its trial with it.
                pid = peers.pop(r)
                _kill_group(pid, signal.SIGKILL)
                r.close()
                children[pid] = None
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                peers.pop(conn, None)
                try:
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()


_libc = None
_PR_SET_PDEATHSIG = 1


def _kill_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _child(request, fds, conn, sockets):
    """In the forked child: becomes the trial's process and runs its script;
    tells the stand-in (conn) its exit code before it exits, since tearing
    down a large process's memory takes longer than many a trial."""
    code = 1
    try:
        # Killed with the worker, should it be (it kills its children
        # otherwise, but SIGKILL leaves it no time to).
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setpgid(0, 0)
        for s in sockets:
            s.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # As a fresh interpreter has them.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = request["argv"]
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        # A fresh process seeds these from the OS: forked ones would share a stream.
        import random
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import runpy
        try:
            runpy.run_path(argv[1], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:   # noqa: BLE001 - reported as the interpreter would
            import traceback
            traceback.print_exc()
            code = 1
        import atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            _send(conn, {"exit": code & 0xFF})
        finally:
            os._exit(code & 0xFF)


if __name__ == "__main__":
    # Run as a file, this module's directory (the deepnex package) comes
    # first on sys.path, where its torch.py would shadow torch.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    if len(sys.argv) >= 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "slot":
        slot(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: _tune_warm.py serve SOCKET SCRIPT | run SOCKET ARGV... | "
                 "slot CONTROL SOCKET")
