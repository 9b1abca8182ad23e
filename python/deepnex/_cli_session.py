"""``deepnex exec``, ``deepnex shell``, ``deepnex notebook`` and
``deepnex port-forward``: sessions
with containers on deepnex-central (deepnex/_session.py), through the node's
deepnex-agent where the container runs there.

    deepnex exec NAME [-i] [-t] -- CMD ...   exit code: the command's
    deepnex shell [--alloc ID | --gpus N --gpu-mode M --gpu-memory X --cpus C --memory M]
                  [--image NAME] [--keep]
    deepnex notebook [--alloc ID | ...as shell] [--image NAME] [--keep] [--port LOCAL]
    deepnex port-forward NAME [LOCAL:]REMOTE

shell allocates when no --alloc is given, starts a container there that
waits, and runs a login shell in it on a pseudo-terminal attached to this
terminal (raw mode: Ctrl-C goes to the container; the window's size and its
changes go with it). When the shell exits, its exit code is deepnex's, the
container stops and the allocation deepnex made is released, unless --keep
(then both stay, and `deepnex exec NAME -it -- bash` enters it again).
The C++ client deepnex-shell (the package's bin/, the build tree's) does
all this: `deepnex shell` execs it before argparse loads
(__main__._exec_shell), or once argparse has read the flags.

notebook does the same with Jupyter (jupyter notebook, with a random token)
in the container instead of a shell: it forwards a local port to it through
deepnex-central, prints the URL once Jupyter answers, and forwards until
Ctrl-C (or SIGTERM).
"""

import argparse
import math
import os
import re
import signal
import sys
import threading
import time

from deepnex._cli_common import add_central_args, client, guard, native_shell


def _command(args, what):
    """The command after --; -i, -t and -it may stand between NAME and --."""
    command = list(args.cmd)
    flags = {"-i": ("stdin",), "--stdin": ("stdin",), "-t": ("tty",), "--tty": ("tty",),
             "-it": ("stdin", "tty"), "-ti": ("stdin", "tty")}
    while command and command[0] in flags:
        for f in flags[command.pop(0)]:
            setattr(args, f, True)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit(f"deepnex {what}: no command (give it after --)")
    return command


def _exec(args):
    from deepnex._session import attach
    command = _command(args, "exec")
    c = client(args)
    return attach(c._c, args.name, command, tty=args.tty,
                  interactive=args.stdin, user=args.user)


def _allocation(c, args):
    """(--alloc, None), or a new allocation of the resource flags: (its id, it)."""
    from deepnex import gpu
    if args.alloc is not None:
        return args.alloc, None
    made = c.allocate(gpu.Request(user="", gpus=args.gpus, mode=args.gpu_mode,
                                  gpu_memory=args.gpu_memory, cpus=args.cpus,
                                  memory=args.memory))
    return made.id, made


def _end(c, args, name, alloc, made, started, again):
    """Stops the container and releases the allocation deepnex made, unless
    --keep (then says how to come back: `again`)."""
    from deepnex import DeepnexError, NotFoundError
    if args.keep:
        print(f"deepnex: kept container {name} on allocation {alloc} "
              f"({again}; deepnex stop {name})", file=sys.stderr)
        return
    try:
        if started:
            c.stop_container(name, grace=1.0)
        if made is not None:
            c.release(made.id)
    except NotFoundError:
        pass  # released with its last container
    except DeepnexError as e:
        print(f"deepnex: cleaning up after {name}: {e}", file=sys.stderr)


def _shell(args):
    """Replaces this process with deepnex-shell and the flags argparse read
    (checked, defaults filled in, abbreviations spelled out), so that the
    shell's prompt comes without loading deepnex's compiled module here."""
    native = native_shell()
    if native is None:
        raise SystemExit("deepnex shell: deepnex-shell is missing (the package's deepnex/bin/, "
                         "a build tree's bin/); reinstall the deepnex package")
    argv = [native]
    for dest, value in sorted(vars(args).items()):
        if dest in ("command", "func") or value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        argv.append(flag if value is True else f"{flag}={value}")
    env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_SHELL_PYTHON"}
    try:
        os.execve(native, argv, env)
    except OSError as e:
        raise SystemExit(f"deepnex shell: cannot run {native}: {os.strerror(e.errno)}")


# Jupyter on a port free in the container (picked there, as the container
# may have a network of its own), which it says first; the token in the
# environment (JUPYTER_TOKEN), never in arguments: a process container
# shares the host's /proc, where every user reads every process's arguments
# but only its own user reads its environment.
# Jupyter and its kernels write under $HOME: a new directory where the
# user's is not theirs (a process container's user has HOME=/), removed
# when Jupyter ends (the container's stop signals both).
NOTEBOOK = ("home=; pid=; trap '[ -n \"$pid\" ] && kill -TERM $pid || "
            "{ [ -z \"$home\" ] || rm -rf \"$home\"; exit 143; }' TERM INT; "
            "[ -w \"$HOME\" ] || home=$(mktemp -d -t deepnex-notebook.XXXXXX) && "
            "export HOME=${home:-$HOME} && "
            "port=$(python3 -c 'import socket; s = socket.socket(); "
            "s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])') && "
            "echo \"deepnex-notebook: port $port\" || exit 1; "
            "jupyter notebook --no-browser --ip=127.0.0.1 --port=$port "
            "--NotebookApp.port_retries=0 & pid=$!; "
            "while kill -0 $pid 2>/dev/null; do wait $pid; code=$?; done; "
            "[ -z \"$home\" ] || rm -rf \"$home\"; exit $code")
PORT_LINE = re.compile(r"^deepnex-notebook: port (\d+)$", re.M)
# How often a forwarding notebook client looks whether its container ended.
NOTEBOOK_POLL_S = 2.0


def _notebook_port(c, name, deadline):
    """The port jupyter listens on in container `name`, from its log."""
    while True:
        m = PORT_LINE.search(c.container_logs(name))
        if m:
            return int(m.group(1))
        _still_running(c, name, deadline, "said its port")
        time.sleep(0.05)


def _still_running(c, name, deadline, what):
    """An error, with the end of its log, when container `name` ended or the
    deadline passed before jupyter `what`."""
    from deepnex import DeadlineExceededError
    _raise_if_ended(c, name, f"before jupyter {what}")
    if time.monotonic() >= deadline:
        raise DeadlineExceededError(f"notebook {name}: jupyter has not {what} "
                                    "within --start-timeout")


def _raise_if_ended(c, name, when):
    """An error, with the end of its log, when container `name` ended."""
    from deepnex import DeepnexError
    info = next((x for x in c.containers() if x["name"] == name), None)
    state = (info or {}).get("state", "gone")
    if state in ("stopped", "exited", "gone"):
        tail = c.container_logs(name).strip().splitlines()[-5:] if info else []
        raise DeepnexError(f"notebook {name}: {state} {when}"
                           + "".join(f"\n  {line}" for line in tail))


def _answers(c, name, port, token):
    """Whether jupyter answers /api/status with the token on `port` in
    container `name` (asked through a session of its own, not the local
    forward, whose refused connections would each say so)."""
    from deepnex import DeepnexError
    from deepnex._session import open_session
    reply = b""
    s = None
    try:
        s = open_session(c._c, name, port=port)
        s.write(f"GET /api/status HTTP/1.0\r\nAuthorization: token {token}\r\n\r\n".encode())
        s.close_stdin()
        while True:
            kind, data, _ = s.read()
            if kind == "exit":
                break
            reply += data
    except DeepnexError:  # not listening yet (or gone: the caller looks)
        return False
    finally:
        if s is not None:
            s.cancel()
    return reply.split(b"\r\n", 1)[0].split(b" ")[1:2] == [b"200"]


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _notebook(args):
    import secrets

    from deepnex import UnavailableError, launch
    from deepnex._session import PortForward
    c = client(args)
    name = args.name or f"notebook-{secrets.token_hex(3)}"
    token = secrets.token_hex(16)
    alloc = made = None
    started = False
    fwd = None
    remote = None
    # SIGTERM, and SIGHUP (its terminal closed), end it as Ctrl-C does:
    # forwarding stops, the container too (SIGHUP's default left both).
    # The first of them only: a second one cut the cleanup short, and the
    # client hung at exit on the forwarder's threads; each of its calls has
    # a deadline.
    def stop(*_):
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt
    for sig in _STOP_SIGNALS:
        signal.signal(sig, stop)
    try:
        # Inside: Ctrl-C while the request waits in the queue withdraws it.
        alloc, made = _allocation(c, args)
        c.start_container(launch.ContainerSpec(
            name=name, image=args.image, command=["sh", "-c", NOTEBOOK],
            env={"JUPYTER_TOKEN": token}), alloc)
        started = True
        deadline = time.monotonic() + args.start_timeout
        remote = _notebook_port(c, name, deadline)
        while not _answers(c, name, remote, token):
            _still_running(c, name, deadline, "answered")
            time.sleep(0.1)
        try:
            fwd = PortForward(c._c, name, remote, local=args.port, host=args.address)
        except OSError as e:
            raise UnavailableError(f"--port {args.port} on {args.address}: {os.strerror(e.errno)}")
        print(f"Notebook {name}: http://{fwd.host}:{fwd.port}/?token={token}", flush=True)
        # Forwarding to nothing helps nobody: the client ends with its
        # container (stopped by `deepnex stop`, or jupyter ended), as
        # kubectl port-forward does with its pod.
        while True:
            time.sleep(NOTEBOOK_POLL_S)
            _raise_if_ended(c, name, "while forwarding: jupyter ended")
    except KeyboardInterrupt:
        return 0 if fwd is not None else 130
    finally:
        if fwd is not None:
            fwd.close()
        if alloc is not None:
            _end(c, args, name, alloc, made, started,
                 f"deepnex port-forward {name} {remote or 'PORT'}")


def _parse_ports(text):
    local, _, remote = text.rpartition(":")
    try:
        ports = (int(local) if local else None, int(remote))
    except ValueError:
        ports = None
    if ports is None or not 1 <= ports[1] <= 65535 or (
            ports[0] is not None and not 0 <= ports[0] <= 65535):
        raise SystemExit(f"deepnex port-forward: \"{text}\" is not [LOCAL:]REMOTE with TCP ports")
    return ports


def _port_forward(args):
    from deepnex._session import PortForward
    from deepnex import NotFoundError
    local, remote = _parse_ports(args.ports)
    c = client(args)
    # Said now, not at the first connection: a container the caller may not
    # reach (another user's: PermissionDenied) or that does not exist.
    if not any(x["name"] == args.name for x in c.containers(user=args.user)):
        raise NotFoundError(f'no container "{args.name}"'
                            + (f" of user {args.user}" if args.user else ""))
    fwd = PortForward(c._c, args.name, remote, local=remote if local is None else local,
                      host=args.address, user=args.user)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"Forwarding from {fwd.host}:{fwd.port} -> {args.name}:{remote}", flush=True)
    stop.wait()
    fwd.close()
    return 0


def add_commands(commands):
    p = commands.add_parser("exec", help="run a command in one of your running containers")
    add_central_args(p)
    p.add_argument("-i", "--stdin", action="store_true", help="pass this stdin on (until EOF)")
    p.add_argument("-t", "--tty", action="store_true",
                   help="on a pseudo-terminal (this terminal in raw mode, its size passed on)")
    p.add_argument("--user", help="whose container (admins)")
    p.add_argument("name", help="the container's name")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARG ...")
    p.set_defaults(func=guard(_exec))

    p = commands.add_parser("shell", help="a shell in a new container on (new) resources")
    _add_run_args(p, "shell")
    p.set_defaults(func=guard(_shell))

    p = commands.add_parser("notebook",
                            help="Jupyter in a new container on (new) resources, forwarded here")
    _add_run_args(p, "notebook")
    # Checked before anything is allocated.
    p.add_argument("--port", type=_local_port, default=0,
                   help="the local port to forward from (default 0: any free one)")
    p.add_argument("--address", default="127.0.0.1", help="local address to listen on")
    p.add_argument("--start-timeout", type=_positive_seconds, default=120.0,
                   help="seconds for jupyter to answer (default 120)")
    p.set_defaults(func=guard(_notebook))

    p = commands.add_parser("port-forward",
                            help="forward a local TCP port to a port in one of your containers")
    add_central_args(p)
    p.add_argument("--address", default="127.0.0.1", help="local address to listen on")
    p.add_argument("--user", help="whose container (admins)")
    p.add_argument("name", help="the container's name")
    p.add_argument("ports", metavar="[LOCAL:]REMOTE",
                   help="REMOTE: the container's port; LOCAL: here (default REMOTE; 0: any)")
    p.set_defaults(func=guard(_port_forward))


def _local_port(text):
    """An argparse type: a TCP port, 0 for any."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535; 0: any)")
    return port


def _positive_seconds(text):
    """An argparse type: a finite number of seconds above 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return seconds


def _add_run_args(p, what):
    """shell's and notebook's: where and in what the container runs."""
    add_central_args(p)
    p.add_argument("--alloc", help="an allocation of yours to run on (default: allocate one)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to allocate (default 0)")
    p.add_argument("--gpu-mode", default="exclusive", choices=["exclusive", "shared"])
    p.add_argument("--gpu-memory", default=0, help="per GPU in shared mode, e.g. 8GiB")
    p.add_argument("--cpus", type=int, default=1, help="CPU cores to allocate (default 1)")
    p.add_argument("--memory", default="1GiB", help="host memory to allocate (default 1GiB)")
    p.add_argument("--image", default="host", help="a name from deepnex-central's images")
    p.add_argument("--name", help=f"the container's name (default: {what}-<random>)")
    p.add_argument("--keep", action="store_true",
                   help="leave the container running and the allocation held on exit")
