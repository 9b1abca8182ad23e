"""deepnex-central and deepnex-agents as subprocesses, for the tests of the
agent (test_agent.py on 127.0.0.1, test_agent_hosts.py on simulated hosts)
and of what runs through it.

On 127.0.0.1:

    proc, address = start_central(tmp_path)
    agents = Agents(tmp_path, address)
    h1 = agents.start("h1", "h1tok")          # a Daemon; its output in files
    h1.wait_line("deepnex-agent: node h1 registered")
    cli(address, "nodes"); client(address, "alicetok").nodes(); status(address)

On simulated hosts (tests/python/_hosts.py), with the agent_hosts fixture
of conftest.py: central on head host h1 (10.77.0.11), agents on h2 and h3
(`--gpus 2x16GiB`, process backend unless told, state in tmp_path/<node>):

    def test_x(agent_hosts):
        c = agent_hosts                        # an AgentHosts, both nodes Ready
        c.cli("ps", token="alicetok")          # the CLI, run on h1
        c.call("alicetok", "c.containers()")   # Python on h1, as plain data
        c.kill_agent("h2"); c.start_agent("h2")
        c.kill_central(); c.start_central()    # the same address again

The machine's side has no address on the hosts' bridge, so everything that
talks to central runs on h1 (cli, call). Tokens: _central.TOKENS and h1tok,
h2tok, h3tok for nodes h1, h2, h3. Every daemon's stdout and stderr go to
files (a pipe nobody reads would fill and stop it); Daemon.wait_line waits
for a line there with a deadline.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from _central import BUILD_DIR, CENTRAL_BIN, TOKENS, USER_IDS
from _wait import wait_for

AGENT_BIN = os.path.abspath(os.path.join(BUILD_DIR, "bin", "deepnex-agent"))
NODE_TOKENS = "h1tok h1 node\nh2tok h2 node\nh3tok h3 node\n"
# The flags of every agent a test starts, before its own.
AGENT_FLAGS = ("--gpus", "2x16GiB", "--cpus", "4", "--memory", "8GiB", "--labels", "rack=r1")


def sweep_recorded_launchers(root):
    """Launcher.cleanup of every launcher whose container records lie under
    `root`: a test that kills an agent or cuts off its host leaves its
    containers' cgroups (the machine's, not the simulated host's), which
    nothing else would remove."""
    import pathlib
    from deepnex import launch
    ids = set()
    for record in pathlib.Path(root).glob("**/containers/*/record.json"):
        try:
            ids.add(json.loads(record.read_text()).get("launcher_id", ""))
        except (OSError, ValueError):
            continue
    ids.discard("")
    if ids:
        with launch.Launcher("process") as sweeper:
            for launcher_id in ids:
                sweeper.cleanup(launcher_id)


def require_binaries():
    for binary in (CENTRAL_BIN, AGENT_BIN):
        if not os.path.exists(binary):
            pytest.skip(f"{binary} not built")


class Daemon:
    """A process started here or on a simulated host (`on`: (hosts, name)),
    its stdout and stderr in `log`.out and `log`.err."""

    def __init__(self, argv, log, on=None):
        self.argv, self.log = [str(a) for a in argv], str(log)
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        with open(self.log + ".out", "w") as out, open(self.log + ".err", "w") as err:
            if on is None:
                self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err)
            else:
                self.proc = on[0].popen(on[1], self.argv, stdout=out, stderr=err)

    @property
    def pid(self):
        return self.proc.pid

    def stdout(self):
        with open(self.log + ".out") as f:
            return f.read()

    def stderr(self):
        with open(self.log + ".err") as f:
            return f.read()

    def wait_line(self, prefix, timeout=30):
        """The first line of stdout that starts with prefix; fails when the
        process exits first or after `timeout` s, showing its stderr."""
        def line():
            for text in self.stdout().splitlines():
                if text.startswith(prefix):
                    return text
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.argv[0]} exited {self.proc.returncode} before "
                                     f"{prefix!r}: {self.stdout()}{self.stderr()}")
            return None
        return wait_for(line, lambda: f"{prefix!r} from {self.argv[0]}: {self.stderr()}",
                        timeout=timeout)

    def wait(self, timeout=30):
        return self.proc.wait(timeout=timeout)

    def kill(self):
        """SIGKILL (as a crash would), and reaps it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def start_central(tmp_path, listen="127.0.0.1:0", on=None, flags=(), node_timeout=2):
    """deepnex-central without declared nodes (the agents bring theirs),
    alice's containers as USER_IDS, its ledger in tmp_path/ledger and its
    own launcher's state in tmp_path/central; (Daemon, address). `on`:
    (hosts, host) to run it on a simulated host."""
    require_binaries()
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS + NODE_TOKENS)
    logs = tmp_path / "logs"
    n = len(list(logs.glob("central.*.out"))) if logs.exists() else 0
    d = Daemon([CENTRAL_BIN, "--listen", listen, "--token-file", tokens,
                "--node-timeout", node_timeout, "--user", f"alice={USER_IDS}",
                "--state-dir", tmp_path / "ledger", "--launch-state-dir", tmp_path / "central",
                *flags], logs / f"central.{n}", on)
    line = d.wait_line("deepnex-central listening on ")
    return d, line.split()[3]


class Agents:
    """The agents a test starts (Daemons, on 127.0.0.1 or `on` a simulated
    host); each stopped by close() as an admin would (SIGTERM): an agent
    stops its containers and deletes what their runs held (an oci run's
    mounted writable layer), which a SIGKILL would leave behind."""

    def __init__(self, tmp_path, central):
        self.tmp_path, self.central, self.daemons = tmp_path, central, []

    def start(self, node, token, flags=(), on=None, default_state_dir=False):
        """deepnex-agent for `node` with AGENT_FLAGS, then `flags`, its
        state in tmp_path/<node> (default_state_dir: where the agent keeps
        it by default); does not wait for its registration."""
        require_binaries()
        state = [] if default_state_dir else ["--state-dir", self.tmp_path / node]
        d = Daemon([AGENT_BIN, "--central", self.central, "--node", node, "--token", token,
                    *AGENT_FLAGS, *state, *flags],
                   self.tmp_path / "logs" / f"agent-{node}.{len(self.daemons)}", on)
        self.daemons.append(d)
        return d

    def registered(self, daemon, node):
        """Waits for `daemon`'s "registered" line."""
        return daemon.wait_line(f"deepnex-agent: node {node} registered with {self.central}")

    def close(self):
        for d in self.daemons:  # all at once: each waits out its containers' grace
            if d.proc.poll() is None:
                d.proc.terminate()
        for d in self.daemons:
            d.stop()


def _cli_env(central, token):
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN=token)
    env.pop("DEEPNEX_STATE_DIR", None)
    return env


def cli(central, *args, token="admintok", on=None):
    """`python -m deepnex *args` against central (on 127.0.0.1, or on a
    simulated host: `on`); the CompletedProcess."""
    argv = [sys.executable, "-m", "deepnex", *args]
    if on is None:
        return subprocess.run(argv, env=_cli_env(central, token), text=True,
                              capture_output=True, timeout=60)
    return on[0].run(on[1], argv, env=_cli_env(central, token), check=False, timeout=60)


def client(central, token):
    """A gpu.CentralClient in this process (127.0.0.1 only; see call)."""
    from deepnex import gpu
    return gpu.CentralClient(central, token=token, timeout=10)


# Python run on a simulated host: eval(expression) with `c` a client of
# central and `gpu` imported; the result printed as JSON, pybind objects as
# dicts of their attributes, an error as {"error": [type, message]}.
_CALL = r"""
import json, sys
from deepnex import gpu
def plain(x):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    return {a: plain(getattr(x, a)) for a in dir(x)
            if not a.startswith("_") and not callable(getattr(x, a))}
c = gpu.CentralClient(sys.argv[1], token=sys.argv[2], timeout=10)
try:
    out = plain(eval(sys.argv[3]))
except Exception as e:
    out = {"error": [type(e).__name__, str(e)]}
print(json.dumps(out))
"""


def call(central, token, expression, on):
    """eval(expression) on simulated host `on` ((hosts, host)) with `c` a
    CentralClient of `token` and `gpu` imported: its result as plain data
    (objects as dicts of their attributes); an exception as
    {"error": [type name, message]}."""
    r = on[0].run(on[1], [sys.executable, "-c", _CALL, central, token, expression],
                  env=_cli_env(central, token), timeout=60)
    return json.loads(r.stdout)


# GET of http://ADDRESS/PATH, run where the server is reachable.
_GET = r"""
import sys, urllib.error, urllib.request
request = urllib.request.Request(f"http://{sys.argv[1]}{sys.argv[2]}")
if len(sys.argv) > 3:
    request.add_header("Authorization", f"Bearer {sys.argv[3]}")
try:
    r = urllib.request.urlopen(request, timeout=10)
    code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
sys.stdout.write(f"{code}\n{body.decode()}")
"""


def http_get(address, path, on=None, token=None):
    """(status, body) of GET http://address/path, from here or from a
    simulated host (`on`), with `token` as a bearer token if given."""
    argv = [sys.executable, "-c", _GET, address, path, *([token] if token else [])]
    if on is None:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    else:
        r = on[0].run(on[1], argv, timeout=60)
    code, body = r.stdout.split("\n", 1)
    return int(code), body


def status(central, on=None):
    """{node: STATUS} from `deepnex nodes`."""
    out = cli(central, "nodes", on=on)
    assert out.returncode == 0, out.stderr
    return {row.split()[0]: row.split()[2] for row in out.stdout.splitlines()[1:]}


def pid_alive(pid):
    """Whether pid runs (a zombie does not)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


class AgentHosts:
    """deepnex-central on simulated host `head`, a deepnex-agent on each
    of `nodes` (token <node>tok, AGENT_FLAGS, `backend`, `agent_flags`).
    start() brings them up and waits until every node is Ready; close()
    kills them (the hosts' teardown kills what they left running)."""

    def __init__(self, hosts, tmp_path, head="h1", nodes=("h2", "h3"), backend="process",
                 central_flags=(), agent_flags=(), node_timeout=2):
        self.hosts, self.tmp_path, self.head, self.node_names = hosts, tmp_path, head, nodes
        self.backend, self.central_flags, self.node_timeout = backend, central_flags, node_timeout
        self.agent_flags = ("--backend", backend, *agent_flags)
        self.central_daemon, self.address, self.agents, self.daemons = None, None, {}, None

    def start(self):
        self.start_central()
        self.daemons = Agents(self.tmp_path, self.address)
        for node in self.node_names:
            self.start_agent(node)
        wait_for(lambda: self.status() == {n: "Ready" for n in self.node_names},
                 lambda: f"every node Ready: {self.status()}", timeout=10)
        return self

    def on(self, host=None):
        return (self.hosts, host or self.head)

    # ---- central

    def start_central(self):
        """Starts central on the head host: on its address the first time,
        on the same address again after kill_central."""
        listen = self.address or f"{self.hosts.address(self.head)}:0"
        self.central_daemon, address = start_central(
            self.tmp_path, listen=listen, on=self.on(), flags=self.central_flags,
            node_timeout=self.node_timeout)
        assert self.address in (None, address), (self.address, address)
        self.address = address
        return self.central_daemon

    def kill_central(self):
        self.central_daemon.kill()

    # ---- agents

    def start_agent(self, node, token=None, flags=(), wait=True):
        """The agent of `node` on host `node`; waits for its registration
        unless wait=False."""
        d = self.daemons.start(node, token or f"{node}tok", (*self.agent_flags, *flags),
                               on=self.on(node))
        self.agents[node] = d
        if wait:
            self.daemons.registered(d, node)
        return d

    def kill_agent(self, node):
        self.agents[node].kill()

    # ---- talking to central (from the head host)

    def cli(self, *args, token="admintok"):
        return cli(self.address, *args, token=token, on=self.on())

    def call(self, token, expression):
        return call(self.address, token, expression, self.on())

    def status(self):
        return status(self.address, on=self.on())

    def nodes(self):
        """{name: node as a dict} from CentralClient.nodes()."""
        return {n["name"]: n for n in self.call("admintok", "c.nodes()")}

    def containers(self, token="alicetok"):
        """{name: container record} from CentralClient.containers()."""
        return {c["name"]: c for c in self.call(token, "c.containers()")}

    def allocate(self, node, token="alicetok", user="alice", gpus=1):
        """An allocation of `gpus` GPUs pinned to `node` (a dict)."""
        a = self.call(token, f"c.allocate(gpu.Request(user={user!r}, gpus={gpus}, cpus=1, "
                             f"memory=256 << 20, node={node!r}))")
        assert "error" not in a, a
        return a

    def launch(self, node, name, *command, token="alicetok"):
        """`deepnex launch` of command on an allocation pinned to node;
        the container's record."""
        a = self.allocate(node, token=token)
        out = self.cli("launch", "--alloc", a["id"], "--name", name, "--", *command,
                       token=token)
        assert out.returncode == 0, out.stderr
        return self.containers(token)[name]

    def wait_status(self, node, status, timeout):
        """Waits until `deepnex nodes` shows `node` as `status`."""
        wait_for(lambda: self.status()[node] == status, f"{node} {status}", timeout=timeout)

    def stop(self, name, token="alicetok"):
        """`deepnex stop NAME --grace 5`, checked to have stopped it and
        released its allocation."""
        out = self.cli("stop", name, "--grace", "5", token=token)
        assert (out.returncode, out.stdout) == (
            0, f"{name} stopped signaled(SIGTERM), allocation released\n"), out.stderr

    def close(self):
        if self.daemons:
            self.daemons.close()
        if self.central_daemon:
            self.central_daemon.kill()
