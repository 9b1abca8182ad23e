"""Sessions with containers on deepnex-central (issue #16): exec (output
streamed, stdin, exit code, as the container's user), a shell on a pseudo-
terminal, and port-forward; locally and through a deepnex-agent on another
simulated host. Another user's container is NotFound."""

import fcntl
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from _central import AS_ROOT, USER_IDS, clients
from _wait import wait_for
from deepnex import NotFoundError, _session, gpu, launch
from deepnex._cli_common import native_shell

PY = sys.executable
# What a container runs: it runs as the mapped user, who may not reach the
# tests' interpreter (CI's venv is in a private directory).
CONTAINER_PY = "/usr/bin/python3"


def grant(cpus=1, memory="256MiB"):
    return gpu.Request(user="", gpus=1, cpus=cpus, memory=memory)


def start_sleeper(client, name="box", env=None):
    """A running container `name` on a new allocation of the client's."""
    a = client.allocate(grant())
    client.start_container(launch.ContainerSpec(name=name, command=["sleep", "600"],
                                                env=env or {}), a)
    wait_for(lambda: next(c for c in client.containers() if c["name"] == name)["state"]
             == "running", f"{name} running")
    return a


def test_exec_streams_output_takes_stdin_and_returns_the_exit_code(central):
    alice, bob = clients(central)
    start_sleeper(alice, env={"GREETING": "hello"})
    r = alice.exec("box", ["sh", "-c", "echo $GREETING; id -u; cat; echo oops >&2; exit 3"],
                   input=b"from stdin\n")
    assert r == (3, f"hello\n{USER_IDS.split(':')[0]}\nfrom stdin\n".encode(), b"oops\n")
    # Streamed as it comes: the first piece arrives while the command still runs.
    pieces = []
    first = threading.Event()

    def on_output(kind, data):
        pieces.append((kind, data))
        first.set()
    done = []
    t = threading.Thread(target=lambda: done.append(alice.exec(
        "box", ["sh", "-c", "echo one; read x; echo two $x"], input=None, on_output=on_output)))
    # stdin is closed at once: `read` sees EOF.
    t.start()
    assert first.wait(30)
    t.join(30)
    assert done[0].exit_code == 0 and b"".join(d for _, d in pieces) == b"one\ntwo\n"
    # A signal's exit code is 128 + N.
    assert alice.exec("box", ["sh", "-c", "kill -9 $$"]).exit_code == 137


def test_exec_starts_where_the_containers_process_started(central):
    """The process backend ran exec'd commands in central's own working
    directory (probe), where the container's process starts in the user's
    home, or "/" when that cannot be entered."""
    alice, _ = clients(central)
    a = alice.allocate(grant())
    alice.start_container(
        launch.ContainerSpec(name="wd", command=["sh", "-c", "pwd; exec sleep 600"]), a)
    wait_for(lambda: alice.container_logs("wd").endswith("\n"), "the container's pwd")
    started_in = alice.container_logs("wd")
    assert started_in != os.getcwd() + "\n"  # central's
    r = alice.exec("wd", ["pwd"])
    assert (r.exit_code, r.stdout.decode()) == (0, started_in)
    # A working_dir gone since the start is said, not a bare 126 (probe).
    import tempfile
    gone = tempfile.mkdtemp(prefix="deepnex-wd-")
    os.chmod(gone, 0o755)
    try:
        alice.start_container(launch.ContainerSpec(name="wd2", command=["sleep", "600"],
                                                   working_dir=gone), alice.allocate(grant()))
        wait_for(lambda: next(c for c in alice.containers() if c["name"] == "wd2")["state"]
                 == "running", "wd2 running")
    finally:
        os.rmdir(gone)
    r = alice.exec("wd2", ["pwd"])
    assert (r.exit_code, r.stdout, r.stderr.decode()) == (
        126, b"", f"deepnex exec: cannot enter the working directory {gone}\n")


def test_exec_runs_in_the_containers_cgroup(central):
    """The exec'd process is in the container's cgroup before it runs (on
    cgroup v1 it joins it itself, between fork and exec)."""
    alice, _ = clients(central)
    start_sleeper(alice)
    box = next(c for c in alice.containers() if c["name"] == "box")
    with open(f"/proc/{box['id']}/cgroup") as f:
        want = f.read()
    with open("/proc/self/cgroup") as f:
        if f.read() == want:
            pytest.skip("deepnex-central makes no cgroups here (not root, or not writable)")
    r = alice.exec("box", ["cat", "/proc/self/cgroup"])
    assert (r.exit_code, r.stdout.decode()) == (0, want)
    assert "alice.box-0\n" in want


def test_exec_whose_process_leaves_its_stdin_unread_ends_and_central_serves_on(central_process):
    """More input than a pipe holds, for a process that exits without
    reading it: writing the rest is an EPIPE for that session. A probe's
    exec so killed deepnex-central with SIGPIPE, and everyone's calls with it."""
    address, proc = central_process
    alice, bob = clients(address)
    start_sleeper(alice)
    r = alice.exec("box", ["sh", "-c", "sleep 0.5; exit 6"], input=b"x" * (4 << 20))
    assert r.exit_code == 6
    assert proc.poll() is None
    assert bob.allocations() == [] and alice.exec("box", ["true"]).exit_code == 0


def test_a_tty_session_ends_with_its_process_not_with_what_it_left_in_the_background(central):
    """A shell that exits leaving a job in the background that holds the
    terminal ends its session, as sshd's does; the session waited for the
    job, and `deepnex shell` hung after `exit` (probe). On pipes, EOF ends it."""
    alice, _ = clients(central)
    start_sleeper(alice)
    # set -m: the job in a process group of its own, as an interactive
    # shell puts it, which the shell's end does not hang up.
    s = _session.open_session(
        alice._c, "box", ["sh", "-c", "set -m; sleep 300 & echo left-$((1+1)); exit 3"], tty=True)
    seen, ended = [], []

    def read():
        while True:
            kind, data, code = s.read()
            if kind == "exit":
                ended.append(code)
                return
            seen.append(data)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: ended, lambda: f"the session's end; its output so far: {seen!r}",
                 timeout=30)
    finally:
        s.cancel()
        reader.join(timeout=30)
    assert ended == [3] and b"left-2" in b"".join(seen)


def test_a_window_size_out_of_a_ptys_range_is_clamped(central):
    """-1 rows gave 65535 and 70000 columns 4464: a cast to 16 bits (probe)."""
    alice, _ = clients(central)
    start_sleeper(alice)
    s = _session.open_session(alice._c, "box", ["sh", "-c", "stty size; read x; stty size"],
                              tty=True, rows=24, cols=80)
    out = b""
    while b"24 80" not in out:
        kind, data, _ = s.read()
        assert kind == "stdout", (kind, data, out)
        out += data
    s.resize(-1, 70000)
    s.write(b"\n")
    while True:
        kind, data, code = s.read()
        if kind == "exit":
            break
        out += data
    assert code == 0
    assert out.decode().replace("\r", "").split("\n") == ["24 80", "", "0 65535", ""]


def test_input_a_process_does_not_read_holds_its_sender_back_not_centrals_memory(central):
    """Central queues at most 1 MiB of a session's input; then gRPC's flow
    control holds the client. A probe's 512 MiB to a `sleep` all went into
    central's memory in 6 s."""
    alice, _ = clients(central)
    start_sleeper(alice)
    s = _session.open_session(alice._c, "box", ["sleep", "120"])
    sent = [0]
    chunk = b"x" * (1 << 20)

    def send():
        try:
            for _ in range(128):
                s.write(chunk)
                sent[0] += len(chunk)
        except Exception:  # cancelled below
            pass
    writer = threading.Thread(target=send, daemon=True)
    writer.start()

    def stalled():
        before = sent[0]
        time.sleep(1)
        return sent[0] == before and sent[0] > 0
    wait_for(stalled, lambda: f"the writer to stall; it sent {sent[0]} bytes", timeout=60)
    try:
        assert writer.is_alive() and sent[0] <= 32 << 20, sent[0]
    finally:
        s.cancel()
        writer.join(30)
    assert not writer.is_alive()
    # The client gone, central kills the exec'd process, which frees its
    # writer blocked on the full stdin: before, the session (and central's
    # stop, which waits for it) lasted as long as the process did.
    box = next(c for c in alice.containers() if c["name"] == "box")
    procs = cgroup_procs(box["id"])
    if procs is not None:
        wait_for(lambda: cgroup_procs(box["id"]) == 1, "only the container's own process left")


def cgroup_procs(pid):
    """How many processes share pid's pids cgroup (v1) or cgroup (v2);
    None without one of its own."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = f.read().splitlines()
    line = next((x for x in lines if ":pids:" in x), None) or next(
        (x for x in lines if x.startswith("0::")), None)
    path = line.split(":", 2)[2] if line else "/"
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        procs = f"{base}{path}/cgroup.procs"
        if path != "/" and os.path.exists(procs):
            with open(procs) as f:
                return len(f.read().split())
    return None


def test_output_a_client_does_not_read_holds_the_process_back_not_centrals_memory(
        central_process):
    """Central queues at most 1 MiB of output for a client; then the
    process waits in its pipe. A probe's `yes` to a client that never read
    grew central by 160 MB/s."""
    address, proc = central_process
    alice, _ = clients(address)
    start_sleeper(alice)

    def rss():
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    before = rss()
    s = _session.open_session(alice._c, "box", ["yes"])
    try:
        time.sleep(3)  # unbounded, central would have grown by hundreds of MB by now
        assert rss() - before < 64 << 20, (before, rss())
        kind, data, _ = s.read()  # what was held back is all still there, in order
        assert kind == "stdout" and data.startswith(b"y\ny\n")
    finally:
        s.cancel()


def test_one_users_open_sessions_are_capped_and_others_go_on(central):
    """Each session holds a thread and descriptors of central's: a probe
    opened hundreds. 128 at once per user; the next is ResourceExhausted,
    another user's still open, and an ended one makes room."""
    from deepnex import ResourceExhaustedError
    alice, bob = clients(central)
    start_sleeper(alice)
    start_sleeper(bob)
    c = alice._c
    held = [_session.open_session(c, "box", ["sh", "-c", "echo up; exec sleep 120"])
            for _ in range(128)]
    # Each one counts once its process runs (it says so); a probe before
    # then could take a slot from the last of them.
    for s in held:
        assert s.read() == ("stdout", b"up\n", 0)

    def refused():
        try:
            return alice.exec("box", ["true"]).exit_code != 0
        except ResourceExhaustedError as e:
            return e
    e = wait_for(refused, "alice's 129th session refused", timeout=60)
    assert "user alice has 128 sessions open" in str(e)
    assert bob.exec("box", ["true"]).exit_code == 0
    held.pop().cancel()

    def fits():
        try:
            return alice.exec("box", ["true"]).exit_code == 0
        except ResourceExhaustedError:
            return False  # the cancelled one is still ending
    wait_for(fits, "room for alice's next session", timeout=30)
    for s in held:
        s.cancel()


def test_exec_errors(central):
    alice, bob = clients(central)
    start_sleeper(alice)
    with pytest.raises(NotFoundError, match='no container "box" of user bob'):
        bob.exec("box", ["true"])
    with pytest.raises(NotFoundError, match='command "no-such-command"'):
        alice.exec("box", ["no-such-command"])
    from deepnex import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="command: 'true' is not a non-empty list"):
        alice.exec("box", "true")


def test_exec_says_why_a_session_ended_before_its_stdin_was_closed(central, monkeypatch):
    """Central ends bob's exec of alice's container at once: exec's close of
    stdin can find the session already ended (a CI run failed so, with
    'the session ended'), and the error must still be why it ended. The
    close waits here until the session has surely ended."""
    from deepnex import UnavailableError
    alice, bob = clients(central)
    start_sleeper(alice)
    real = _session.open_session

    class EndedFirst:
        def __init__(self, s):
            self._s = s

        def __getattr__(self, name):
            return getattr(self._s, name)

        def close_stdin(self):
            def ended():
                try:
                    self._s.close_stdin()
                    return False
                except UnavailableError:
                    return True
            wait_for(ended, "central to end the session")
            self._s.close_stdin()

    monkeypatch.setattr(_session, "open_session", lambda *a, **k: EndedFirst(real(*a, **k)))
    with pytest.raises(NotFoundError, match='no container "box" of user bob'):
        bob.exec("box", ["true"])


def cli(central, *args, token="alicetok", **kwargs):
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN=token)
    env.pop("DEEPNEX_STATE_DIR", None)
    return subprocess.run([PY, "-m", "deepnex", *args], env=env, capture_output=True,
                          timeout=60, **kwargs)


def test_cli_exec(central):
    alice, _ = clients(central)
    start_sleeper(alice)
    out = cli(central, "exec", "box", "-i", "--", "sh", "-c", "tr a-z A-Z; exit 5",
              input=b"shout\n")
    assert (out.returncode, out.stdout, out.stderr) == (5, b"SHOUT\n", b"")
    # Without -i its stdin is closed at once.
    out = cli(central, "exec", "box", "--", "cat", input=b"not passed\n")
    assert (out.returncode, out.stdout) == (0, b"")
    out = cli(central, "exec", "box", "--", "sh", "-c", "echo err >&2")
    assert (out.returncode, out.stdout, out.stderr) == (0, b"", b"err\n")
    out = cli(central, "exec", "box", "--", "true", token="bobtok")
    assert (out.returncode, out.stderr) == (1, b'deepnex: no container "box" of user bob\n')
    out = cli(central, "exec", "box")
    assert out.returncode != 0 and b"no command (give it after --)" in out.stderr


class Terminal:
    """A program on a new pseudo-terminal of rows x cols, which is its
    controlling terminal (so that a change of size signals it)."""

    def __init__(self, argv, env, rows=24, cols=80):
        import fcntl
        import struct
        import termios
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

        def controlling():
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        self.proc = subprocess.Popen(argv, env=env, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=controlling)
        os.close(slave)
        self.seen = b""

    def send(self, text):
        os.write(self.master, text.encode())

    def resize(self, rows, cols):
        import fcntl
        import struct
        import termios
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def expect(self, needle, timeout=30):
        """Reads until `needle` (bytes) has been seen since the last expect;
        returns what came before it."""
        deadline = time.monotonic() + timeout
        while needle not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"waited {timeout} s for {needle!r}; got {self.seen!r}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # EIO: the program and its terminal are gone
                    data = b""
                if not data:
                    raise AssertionError(f"EOF before {needle!r}; got {self.seen!r}")
                self.seen += data
        before, self.seen = self.seen.split(needle, 1)
        return before

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


NATIVE_SHELL = os.path.join(os.path.dirname(os.path.abspath(_session.__file__)), "..", "..",
                            "bin", "deepnex-shell")


def shell_env(central):
    """The environment of `deepnex shell`, whose client is deepnex-shell."""
    if native_shell() is None:
        pytest.skip("deepnex-shell is not built (nor in the package)")
    return dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")


def expect_native(t):
    """The process on the terminal is deepnex-shell: the command exec'd it."""
    exe = os.path.basename(os.readlink(f"/proc/{t.proc.pid}/exe"))
    assert exe == "deepnex-shell", exe


def assert_cleaned_up(client, name):
    """Container `name` stopped, the allocation deepnex shell made released."""
    assert next(c for c in client.containers() if c["name"] == name)["state"] == "stopped"
    assert client.allocations() == []


def test_shell_on_a_pty_runs_commands_resizes_interrupts_and_exits_with_its_code(central):
    alice, _ = clients(central)
    env = shell_env(central)
    t = Terminal([PY, "-m", "deepnex", "shell", "--cpus", "1", "--memory", "256MiB",
                  "--name", "sh1"], env)
    try:
        # The prompt first: a shell may drop what was typed before it ran.
        t.expect(b"$ ")
        expect_native(t)
        # Markers computed by the shell, so that the echo of what was typed
        # does not match.
        t.send("echo ready-$((40+2))\n")
        t.expect(b"ready-42")
        # A terminal type, as docker exec -t gives (less and vi had none).
        t.send("echo term-$TERM-$((1+2))\n")
        t.expect(b"term-xterm-3")
        assert next(c for c in alice.containers() if c["name"] == "sh1")["state"] == "running"
        assert len(alice.allocations()) == 1
        t.send("stty size; echo size-$((1+1))\n")
        t.expect(b"24 80")
        t.expect(b"size-2")
        # A new size reaches the container's terminal (through SIGWINCH here).
        # It travels on its own: ask again until the shell sees it.
        t.resize(50, 132)

        last = []

        def size():
            t.send("stty size; echo size-$((2+2))\n")
            last[:] = [t.expect(b"size-4")]
            # (bash on an xterm ends bracketed paste before the output)
            return b"50 132\r\n" in last[0]
        wait_for(size, lambda: f"the new size in the container; the last answer: {last!r}",
                 timeout=30)
        # Ctrl-C goes to the container's foreground process, not to deepnex.
        t.send("sleep 60; echo slept-$((3+3))\n")
        wait_for(lambda: alice.exec("sh1", ["pgrep", "-f", "^sleep 60$"]).exit_code == 0,
                 "sleep 60 running in the shell")
        t.send("\x03")
        t.send("echo after-$((5+5))\n")
        t.expect(b"after-10")
        assert b"slept-6" not in t.seen
        assert t.proc.poll() is None
        t.send("exit 7\n")
        assert t.proc.wait(timeout=30) == 7
    finally:
        t.close()
    assert_cleaned_up(alice, "sh1")


@pytest.mark.parametrize("how", ["shell", "exec"])
def test_keys_typed_while_the_client_starts_reach_the_container(central, how):
    """What was typed before the terminal attached (while Python, the
    allocation, the container start) waits in this terminal's input: the
    switch to raw mode with TCSAFLUSH discarded it, in deepnex-shell and in
    `deepnex exec -it`."""
    alice, _ = clients(central)
    env = shell_env(central)
    if how == "shell":
        argv = ["shell", "--cpus", "1", "--memory", "256MiB", "--name", "ahead"]
    else:
        start_sleeper(alice)
        argv = ["exec", "box", "-it", "--", "sh"]
    t = Terminal([PY, "-m", "deepnex", *argv], env)
    try:
        # Before the client even runs: Popen returns once it exec'd Python.
        # The marker is the shell's, so that this terminal's echo of the
        # line does not match.
        t.send("echo typed-$((6*7))\n")
        t.expect(b"typed-42")
        t.send("exit 3\n")
        assert t.proc.wait(timeout=30) == 3
    finally:
        t.close()
    if how == "shell":
        assert_cleaned_up(alice, "ahead")


def test_shell_on_a_given_allocation_with_keep_leaves_both(central):
    alice, _ = clients(central)
    a = alice.allocate(grant())
    env = shell_env(central)
    # --kee, an abbreviation, deepnex-shell hands back to argparse, which
    # refuses it as it refuses every flag's prefix (928e32b).
    out = subprocess.run([PY, "-m", "deepnex", "shell", "--alloc", a.id, "--kee"], env=env,
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out
    assert out.stderr.endswith("deepnex shell: error: unrecognized arguments: --kee\n"), out
    t = Terminal([PY, "-m", "deepnex", "shell", "--alloc", a.id, "--keep", "--name", "k1"], env)
    try:
        t.expect(b"$ ")
        expect_native(t)
        t.send("exit\n")
        t.expect(b"deepnex: kept container k1 on allocation " + a.id.encode())
        assert t.proc.wait(timeout=30) == 0
    finally:
        t.close()
    k1 = next(c for c in alice.containers() if c["name"] == "k1")
    assert (k1["state"], k1["allocation"]) == ("running", a.id)
    assert [x.id for x in alice.allocations()] == [a.id]
    assert alice.exec("k1", ["true"]).exit_code == 0


def test_deepnex_shell_execs_the_native_client_before_argparse(central):
    """What Python loads before deepnex-shell runs: not argparse, not the
    compiled module (python -X importtime says, on stderr, before the exec)."""
    env = shell_env(central)
    del env["DEEPNEX_CENTRAL"]
    out = subprocess.run([PY, "-X", "importtime", "-m", "deepnex", "shell"], env=env,
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    lines = out.stderr.splitlines()
    assert (out.returncode, lines[-1]) == (
        1, "deepnex: no central address (--central or $DEEPNEX_CENTRAL)")
    loaded = {line.split("|")[-1].strip() for line in lines[:-1]}
    assert {"deepnex", "deepnex._cli_common"} <= loaded
    assert not loaded & {"argparse", "deepnex._C", "deepnex._cli_session", "numpy"}, loaded
    # Run directly, deepnex-shell words its own errors.
    out = subprocess.run([native_shell(), "--gpus", "x"], capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stderr) == (
        2, 'deepnex shell: --gpus: "x" is not an integer (see --help)\n')
    # Past an int: out of range, not "not an integer" (probe).
    for big in ("99999999999", "-99999999999", "9" * 30):
        out = subprocess.run([native_shell(), f"--gpus={big}"], capture_output=True, text=True,
                             timeout=60)
        assert (out.returncode, out.stderr) == (
            2, f"deepnex shell: --gpus: {big} is out of range (see --help)\n")


def test_shell_without_deepnex_shell_says_what_is_missing(monkeypatch):
    """deepnex-shell is the only shell client: a package without it fails in
    one line, naming it, before allocating anything."""
    from deepnex import _cli_session
    monkeypatch.setattr(_cli_session, "native_shell", lambda: None)
    with pytest.raises(SystemExit) as e:
        _cli_session._shell(None)
    assert str(e.value).startswith("deepnex shell: deepnex-shell is missing"), e.value


def test_deepnex_shell_loads_a_session_clients_libraries_only():
    """deepnex-shell's start is mostly dynamic loading: it links the objects
    it uses from libdeepnex's archive, not libdeepnex (which loads ~90
    libraries: curl, gnutls, krb5, cudart, nccl...). ldd lists all that the
    loader maps, transitively."""
    path = native_shell()
    if path is None:
        pytest.skip("deepnex-shell is not built (nor in the package)")
    out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = {line.split()[0].split(".so")[0] for line in out.stdout.splitlines() if "=>" in line}
    assert {"libgrpc++", "libprotobuf"} <= loaded, loaded
    assert not loaded & {"libdeepnex", "libcurl", "libcudart", "libnccl", "libnvidia-ml",
                         "libyaml-cpp", "libgnutls", "libkrb5"}, loaded


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_native_shell_ended_by_a_signal_still_cleans_up(central, sig):
    """The terminal gone (SIGHUP) or a kill: deepnex-shell ends the session
    with 128 + N, stops the container and releases the allocation."""
    alice, _ = clients(central)
    t = Terminal([PY, "-m", "deepnex", "shell", "--cpus", "1", "--memory", "256MiB",
                  "--name", "sig1"], shell_env(central))
    try:
        t.expect(b"$ ")
        expect_native(t)
        t.proc.send_signal(sig)
        assert t.proc.wait(timeout=30) == 128 + sig
    finally:
        t.close()
    assert_cleaned_up(alice, "sig1")


def signal_shell_with_central_held(central_process, name, ready, sig):
    """Starts `deepnex shell --name NAME` as alice; once ready() (polled
    without pause), holds central (SIGSTOP), sends the client `sig` and lets
    central go: the client's exit code."""
    central, proc = central_process
    t = Terminal([PY, "-m", "deepnex", "shell", "--cpus", "1", "--memory", "256MiB",
                  "--name", name], shell_env(central))
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert time.monotonic() < deadline, f"{name}: not ready within 60 s"
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(0.2)  # the client's next call waits for central
            t.proc.send_signal(sig)
            time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGCONT)
        return t.proc.wait(timeout=30)
    finally:
        t.close()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_native_shell_signalled_while_it_starts_still_cleans_up(central_process, sig):
    """Before it attached, the signals' default action ended deepnex-shell
    with the container running and the allocation held (probe). Central is
    held (SIGSTOP) once it started the container, so that the signal comes
    while the client waits to attach: it ends the start with 128 + N, and
    the container stops and the allocation goes."""
    alice, _ = clients(central_process[0])
    code = signal_shell_with_central_held(
        central_process, "sig2", lambda: any(c["name"] == "sig2" for c in alice.containers()),
        sig)
    assert code == 128 + sig
    assert_cleaned_up(alice, "sig2")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_native_shell_signalled_as_its_grant_comes_releases_it(central_process, sig):
    """A signal while the grant was on its way killed deepnex-shell before it
    took signals, and the allocation stayed held (re-probe: 5 of 36). Central
    is held (SIGSTOP) as soon as the grant is there, the signal sent, then
    central let go: the client releases the grant and ends with 128 + N."""
    alice, _ = clients(central_process[0])
    code = signal_shell_with_central_held(central_process, "sig3", alice.allocations, sig)
    assert code == 128 + sig
    wait_for(lambda: alice.allocations() == [], "the grant released")
    assert all(c["state"] != "running" for c in alice.containers())


def test_native_shell_signalled_in_the_queue_withdraws_its_request(central):
    """A stop while the request waits in the queue withdraws it (after a
    grace of 2 s for a grant already on its way) and ends with 128 + N."""
    alice, _ = clients(central)
    held = alice.allocate(gpu.Request(user="", gpus=2, cpus=1, memory="256MiB"))
    t = Terminal([PY, "-m", "deepnex", "shell", "--gpus", "1", "--cpus", "1", "--memory",
                  "256MiB", "--name", "sig4"], shell_env(central))
    try:
        wait_for(lambda: len(alice.pending()) == 1, "the shell's request in the queue")
        t.proc.send_signal(signal.SIGTERM)
        assert t.proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        t.close()
    assert alice.pending() == []
    alice.release(held.id)
    assert alice.allocations() == []


def test_shell_errors_are_one_line_and_leave_nothing_behind(central):
    alice, _ = clients(central)
    env = shell_env(central)

    def shell(*args, env=env):
        return subprocess.run([PY, "-m", "deepnex", "shell", "--cpus", "1", "--memory", "256MiB",
                               *args], env=env, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    out = shell("--alloc", "a99")
    assert (out.returncode, out.stderr) == (1, 'deepnex: allocation "a99" does not exist\n')
    out = shell("--gpu-memory", "12XB")
    assert (out.returncode, out.stderr) == (
        1, 'deepnex: gpu_memory: "12XB" is not a byte size (unknown unit "XB"; use B, KiB, '
           'MiB, GiB, TiB, PiB, EiB, K, M, G, T, P, E, KB, MB, GB, TB, PB or EB)\n')
    # Refused after the allocation was made: it is released.
    out = shell("--image", "nosuch")
    assert out.returncode == 1 and out.stderr.startswith(
        'deepnex: spec.image: "nosuch" is not an image that user alice may run'), out.stderr
    assert alice.allocations() == [] and alice.containers() == []
    out = shell(env={k: v for k, v in env.items() if k != "DEEPNEX_CENTRAL"})
    assert (out.returncode, out.stderr) == (
        1, "deepnex: no central address (--central or $DEEPNEX_CENTRAL)\n")
    # argparse's errors and help in both (deepnex-shell, which `deepnex shell`
    # starts before argparse, hands what it does not take back to it).
    out = shell("--gpu-mode", "x")
    assert out.returncode == 2 and out.stderr.endswith(
        "deepnex shell: error: argument --gpu-mode: invalid choice: 'x' "
        "(choose from 'exclusive', 'shared')\n")
    out = shell("--gpus", "x")
    assert out.returncode == 2 and out.stderr.endswith(
        "deepnex shell: error: argument --gpus: invalid int value: 'x'\n")
    out = shell("--keep=yes")
    assert out.returncode == 2 and out.stderr.endswith(
        "deepnex shell: error: argument --keep: ignored explicit argument 'yes'\n")
    out = shell("--help")
    assert (out.returncode, out.stderr) == (0, "") and out.stdout.startswith(
        "usage: deepnex shell [-h] [--central CENTRAL]")


def test_shell_and_exec_it_whose_input_is_not_a_terminal_run_on_pipes_and_end_at_its_eof(central):
    """As ssh and kubectl do: a pty's EOF is a ^D that a shell which has not
    set up its terminal yet loses, and `deepnex shell < /dev/null`, `echo ls
    | deepnex shell` and `echo ls | deepnex exec box -it -- bash` hung
    forever (probe)."""
    alice, _ = clients(central)
    env = shell_env(central)

    def run(args, stdin):
        p = subprocess.Popen([PY, "-m", "deepnex", *args], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = p.communicate(stdin, timeout=60)
        except subprocess.TimeoutExpired:
            p.terminate()  # it cleans up on SIGTERM
            p.communicate(timeout=60)
            raise
        return p.returncode, out, err
    shell = ["shell", "--cpus", "1", "--memory", "256MiB"]
    code, out, _ = run(shell + ["--name", "p1"], b"")
    assert (code, out) == (0, b"")
    code, out, err = run(shell + ["--name", "p2"], b"echo piped-$((1+1)); tty; exit 5\n")
    assert (code, out) == (5, b"piped-2\nnot a tty\n"), err
    assert_cleaned_up(alice, "p2")
    start_sleeper(alice)
    code, out, err = run(["exec", "box", "-it", "--", "sh", "-c", "cat; echo read-all"],
                         b"typed\n")
    assert (code, out) == (0, b"typed\nread-all\n"), err


def test_notebook_flags_are_checked_first_and_ctrl_c_withdraws_a_queued_request(central):
    alice, _ = clients(central)
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")
    env.pop("DEEPNEX_STATE_DIR", None)

    def notebook(*args):
        return subprocess.Popen([PY, "-m", "deepnex", "notebook", "--cpus", "1", "--memory",
                                 "256MiB", *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Refused before anything is allocated (they were found out after Jupyter
    # had started).
    for flag, value, why in [("--port", "70000", "is not a TCP port (0..65535; 0: any)"),
                             ("--start-timeout", "nan", "is not a number of seconds above 0"),
                             ("--start-timeout", "-5", "is not a number of seconds above 0")]:
        out, err = notebook(flag, value).communicate(timeout=60)
        assert err.endswith(f"deepnex notebook: error: argument {flag}: '{value}' {why}\n"), err
    assert alice.allocations() == []
    # Ctrl-C while its request waits in the queue ends it at once (it waited
    # for a grant), withdraws the request, and leaves no allocation behind.
    held = alice.allocate(gpu.Request(user="", gpus=2, cpus=1, memory="256MiB"))
    proc = notebook("--gpus", "1")
    try:
        wait_for(lambda: len(alice.pending()) == 1, "the notebook's request in the queue")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert alice.pending() == []
    alice.release(held.id)
    assert alice.allocations() == []


HTTP_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("hello from " + self.path).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def get(port, path="/x"):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def test_port_forward_reaches_a_server_in_the_container_and_only_its_owner(central):
    alice, bob = clients(central)
    a = alice.allocate(grant())
    spec = launch.ContainerSpec(name="web", command=[CONTAINER_PY, "-c", HTTP_SERVER])
    alice.start_container(spec, a)
    port = int(wait_for(lambda: alice.container_logs("web").strip(), "web's port"))
    with alice.port_forward("web", port) as fwd:
        assert fwd.port != 0
        assert get(fwd.port, "/a") == "hello from /a"
        # Connections at once, each with a session of its own.
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(get(fwd.port, f"/{i}")))
                   for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert sorted(results) == [f"hello from /{i}" for i in range(4)]
    from deepnex._session import open_session
    with pytest.raises(NotFoundError, match='no container "web" of user bob'):
        open_session(bob._c, "web", port=port).read()
    from deepnex import UnavailableError
    with pytest.raises(UnavailableError, match=f'port 1 of container "web": Connection refused'):
        open_session(alice._c, "web", port=1).read()
    # The command line: LOCAL 0 picks a free port and says which.
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")
    p = subprocess.Popen([PY, "-m", "deepnex", "port-forward", "web", f"0:{port}"], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("Forwarding from 127.0.0.1:") and line.endswith(f"-> web:{port}\n")
        local = int(line.split()[2].split(":")[1])
        assert get(local, "/cli") == "hello from /cli"
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
        p.stdout.close()
    # Another user's container, or none: said at once, not at the first
    # connection after "Forwarding from ...".
    for token, args, err in [
            ("bobtok", ["--user", "alice", "web"], "user bob cannot list the containers of alice"),
            ("bobtok", ["web"], 'no container "web"'),
            ("alicetok", ["nosuch"], 'no container "nosuch"')]:
        out = subprocess.run([PY, "-m", "deepnex", "port-forward", *args, f"0:{port}"],
                             env=dict(env, DEEPNEX_TOKEN=token), capture_output=True, text=True,
                             timeout=60)
        assert (out.returncode, out.stdout, out.stderr) == (1, "", f"deepnex: {err}\n")


def assert_a_gone_user_ends_a_process_that_leaves_its_input_unread(hosts, env, tmp_path):
    """The agent's end blocked writing input to a process that never reads
    it, the user goes: central tells the agent on the agent's own stream,
    and the agent kills the process. Before, the session's stream was never
    read again, and the process lived on (a `sleep 1234.5` here)."""
    def sleepers():
        r = subprocess.run(["pgrep", "-f", "^(/usr/bin/)?sleep 1234.5$"], capture_output=True,
                           text=True)
        return r.stdout.split()

    def stdin_full(pid):
        fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
        try:
            queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
            return queued == fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        finally:
            os.close(fd)
    big = tmp_path / "input"
    big.write_bytes(b"x" * (8 << 20))
    with open(big, "rb") as stdin:
        user = hosts.popen("hc", [PY, "-m", "deepnex", "exec", "web", "-i", "--", "sleep",
                                  "1234.5"], env=env, stdin=stdin, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        pid = wait_for(sleepers, "the exec'd sleep on h1")[0]
        wait_for(lambda: stdin_full(pid), "the sleep's stdin pipe to fill")
        user.kill()
        user.wait(timeout=30)
        wait_for(lambda: not sleepers(), "the agent to kill the process of a gone user",
                 timeout=30)
    finally:
        user.kill()
        user.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", "^(/usr/bin/)?sleep 1234.5$"])


AGENT_TOKENS = "h1tok h1 node\n"


def test_exec_and_port_forward_through_an_agent_on_another_host(make_hosts, tmp_path):
    """central on host hc, an agent on h1 (it dials central; central never
    dials it), the user's commands on hc."""
    from _central import BUILD_DIR, CENTRAL_BIN, TOKENS
    agent_bin = os.path.join(BUILD_DIR, "bin", "deepnex-agent")
    if not os.path.exists(agent_bin):
        pytest.skip(f"{agent_bin} not built")
    hosts = make_hosts({"hc": 13, "h1": 11})
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS + AGENT_TOKENS)
    central = hosts.popen("hc", [os.path.abspath(CENTRAL_BIN), "--listen", "10.77.0.13:0",
                                 "--token-file", tokens, "--user", f"alice={USER_IDS}",
                                 "--user", f"bob={USER_IDS}",
                                 "--launch-state-dir", tmp_path / "central"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = central.stdout.readline()
    assert line.startswith("deepnex-central listening on "), line + central.stderr.read()
    address = line.split()[3]
    agent = hosts.popen("h1", [agent_bin, "--central", address, "--node", "h1", "--token",
                               "h1tok", "--gpus", "1x16GiB", "--cpus", "2", "--memory", "4GiB",
                               "--state-dir", tmp_path / "h1"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert agent.stdout.readline() == f"deepnex-agent: node h1 registered with {address}\n"
    env = dict(os.environ, DEEPNEX_CENTRAL=address, DEEPNEX_TOKEN="alicetok")
    env.pop("DEEPNEX_STATE_DIR", None)

    def deepnex(*args, token="alicetok", **kwargs):
        return hosts.run("hc", [PY, "-m", "deepnex", *args], check=False,
                         env=dict(env, DEEPNEX_TOKEN=token), **kwargs)
    out = deepnex("alloc", "--gpus", "1", "--cpus", "1", "--memory", "256MiB", "--node", "h1")
    assert out.returncode == 0, out.stderr
    alloc = out.stdout.split()[0]
    out = deepnex("launch", "--alloc", alloc, "--name", "web", "--", CONTAINER_PY, "-c",
                  HTTP_SERVER)
    assert out.returncode == 0, out.stderr
    port = int(wait_for(lambda: deepnex("logs", "web").stdout.strip(), "web's port"))
    # It runs on h1 (its hostname), with stdin and the exit code through both streams.
    out = deepnex("exec", "web", "-i", "--", "sh", "-c", "hostname; tr a-z A-Z; exit 4",
                  input="up\n")
    assert (out.returncode, out.stdout, out.stderr) == (4, "h1\nUP\n", "")
    # Input the process never reads (more than a pipe holds) ends its
    # session only, not the agent (SIGPIPE).
    out = deepnex("exec", "web", "-i", "--", "sh", "-c", "sleep 0.5; exit 6",
                  input="x" * (4 << 20))
    assert out.returncode == 6 and agent.poll() is None, out.stderr
    assert_a_gone_user_ends_a_process_that_leaves_its_input_unread(hosts, env, tmp_path)
    out = deepnex("exec", "web", "--", "no-such-command")
    assert out.returncode == 1 and 'node h1: command "no-such-command"' in out.stderr
    out = deepnex("exec", "web", "--", "true", token="bobtok")
    assert (out.returncode, out.stderr) == (1, 'deepnex: no container "web" of user bob\n')
    # A port on h1's loopback, from hc.
    fwd = hosts.popen("hc", [PY, "-m", "deepnex", "port-forward", "web", f"0:{port}"], env=env,
                      stdout=subprocess.PIPE, text=True)
    try:
        line = fwd.stdout.readline()
        assert line.endswith(f"-> web:{port}\n"), line
        local = int(line.split()[2].split(":")[1])
        body = hosts.run("hc", [PY, "-c", "import urllib.request, sys; sys.stdout.write("
                                f"urllib.request.urlopen('http://127.0.0.1:{local}/via-h1', "
                                "timeout=30).read().decode())"])
        assert body.stdout == "hello from /via-h1"
    finally:
        fwd.send_signal(signal.SIGINT)
        assert fwd.wait(timeout=30) == 0
        fwd.stdout.close()
    for p in (agent, central):
        p.terminate()
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()
