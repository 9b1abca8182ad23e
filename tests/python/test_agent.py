"""deepnex-agent as a subprocess beside deepnex-central on 127.0.0.1: two
nodes register with node tokens and heartbeat, `deepnex nodes` shows their
STATUS and heartbeat, a container pinned to a node runs through that node's
agent, a killed agent's node turns NotReady, and tokens that are not the
node's are refused."""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from _agents import (AGENT_BIN, Agents, _cli_env, cli, client, http_get, pid_alive,
                     require_binaries, start_central, status)
import _prometheus as prometheus
from _wait import wait_for


@pytest.fixture
def central_proc(tmp_path):
    """[Daemon, address] of central; a test may replace the Daemon."""
    c = list(start_central(tmp_path))
    yield c
    c[0].stop()


@pytest.fixture
def central(central_proc):
    return central_proc[1]


@pytest.fixture
def agents(tmp_path, central):
    a = Agents(tmp_path, central)
    yield a
    a.close()


def test_agents_register_run_containers_and_go_not_ready(central, agents, tmp_path):
    h1 = agents.start("h1", "h1tok")
    h2 = agents.start("h2", "h2tok")
    for name, p in (("h1", h1), ("h2", h2)):
        agents.registered(p, name)
    admin = client(central, "admintok")
    nodes = {n.name: n for n in admin.nodes()}
    assert set(nodes) == {"h1", "h2"}
    assert all(n.ready and n.last_heartbeat > 0 for n in nodes.values())
    assert [g["memory"] for g in nodes["h2"].gpus] == [16 << 30, 16 << 30]
    assert nodes["h2"].labels == {"rack": "r1", "deepnex.io/agent": "true"}
    table = cli(central, "nodes").stdout.splitlines()
    assert table[0].split()[:4] == ["NODE", "MODE", "STATUS", "HEARTBEAT"]
    assert status(central) == {"h1": "Ready", "h2": "Ready"}
    assert table[1].split()[3].endswith("s") and table[1].split()[4] == "ago"
    # The agents measure their node: cores busy, memory in use.
    wait_for(lambda: all(n.memory_in_use > 0 for n in admin.nodes()), "the nodes' usage")
    usage = cli(central, "nodes", "--usage").stdout.splitlines()
    assert usage[0].endswith("CPUS BUSY  MEMORY IN USE")
    assert usage[1].split()[-1].endswith("B")
    assert "deepnex_node_memory_in_use_bytes{node=\"h1\"}" in admin.metrics()

    # A container on an allocation pinned to h2 runs through h2's agent.
    alice = client(central, "alicetok")
    from deepnex import gpu
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h2"))
    out = cli(central, "launch", "--alloc", a.id, "--name", "w0", "--",
              "sh", "-c", "echo hi on $CUDA_VISIBLE_DEVICES; sleep 60", token="alicetok")
    assert out.returncode == 0, out.stderr
    assert os.path.isdir(tmp_path / "h2" / "containers" / "alice.w0")
    assert not os.path.exists(tmp_path / "central" / "containers" / "alice.w0")
    want = f"hi on {a.gpus[0].index}\n"
    wait_for(lambda: cli(central, "logs", "w0", token="alicetok").stdout == want, "w0's log")
    # A user reads the usage of their own containers and the nodes', as an
    # admin all of it; bob once read alice's too.
    series = 'deepnex_container_memory_bytes{container="alice.w0",node="h2",user="alice"}'
    wait_for(lambda: series in admin.metrics(), "w0's usage in the metrics")
    assert series in alice.metrics()
    bobs = client(central, "bobtok").metrics()
    assert "alice" not in bobs and 'deepnex_node_memory_in_use_bytes{node="h2"}' in bobs
    ps = cli(central, "ps", token="alicetok").stdout.splitlines()
    assert ps[0].split()[:3] == ["NAME", "NODE", "BACKEND"]
    assert ps[1].split()[:4] == ["w0", "h2", "process", "running"]
    stop = cli(central, "stop", "w0", "--grace", "5", token="alicetok")
    assert (stop.returncode, stop.stdout) == (0, "w0 stopped signaled(SIGTERM), allocation released\n")

    # SIGKILL of h1's agent: NotReady within node-timeout + 5 s, no grant there.
    h1.kill()
    wait_for(lambda: status(central)["h1"] == "NotReady", "h1 NotReady", timeout=7)
    assert not {n.name: n for n in admin.nodes()}["h1"].ready
    refused = cli(central, "alloc", "--gpus", "1", "--node", "h1", "--no-wait", token="alicetok")
    assert refused.returncode != 0
    assert status(central)["h2"] == "Ready"
    # Restarted, it is Ready again within 10 s.
    again = agents.start("h1", "h1tok")
    agents.registered(again, "h1")
    wait_for(lambda: status(central)["h1"] == "Ready", "h1 Ready again", timeout=10)


def test_an_agent_stopped_by_sigterm_tells_central_how_its_containers_ended(central, agents):
    """An agent stops its containers on SIGTERM; central showed them running
    and held their allocations until the node was lost, 300 s by default
    (probe). It hears of their end before the stream closes."""
    h1 = agents.start("h1", "h1tok")
    agents.registered(h1, "h1")
    alice = client(central, "alicetok")
    from deepnex import gpu, launch
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1"))
    alice.start_container(launch.ContainerSpec(name="box", command=["sleep", "600"]), a)

    def state():
        return next(c["state"] for c in alice.containers() if c["name"] == "box")
    wait_for(lambda: state() == "running", "box running")
    h1.proc.terminate()
    assert h1.wait(timeout=30) == 0
    # The node is lost only after --node-lost-after (300 s): this is the report.
    wait_for(lambda: state() in ("stopped", "exited"), "central to see box's end", timeout=10)
    wait_for(lambda: alice.allocations() == [], "box's allocation to be released", timeout=10)


@pytest.mark.parametrize("backend", ["process", "oci"])
def test_a_container_has_its_specs_environment_not_the_agents_or_the_clients(
        central, agents, monkeypatch, backend):
    """A container's environment is its spec's and its grant's with the
    launcher's defaults: never what the agent that runs it has in its own
    (tokens, DEEPNEX_*, LD_LIBRARY_PATH), nor the client that starts it or
    runs a command in it (exec, shell)."""
    from deepnex import gpu, launch
    if backend == "oci":
        why = launch.probe_backends().get("oci", "")
        if why:
            pytest.skip(f"oci backend: {why}")
    monkeypatch.setenv("SECRET_FROM_AGENT", "1")
    monkeypatch.setenv("DEEPNEX_FROM_AGENT", "1")
    h1 = agents.start("h1", "h1tok", flags=("--backend", backend))
    agents.registered(h1, "h1")
    monkeypatch.delenv("SECRET_FROM_AGENT")
    monkeypatch.delenv("DEEPNEX_FROM_AGENT")
    monkeypatch.setenv("SECRET_FROM_CLIENT", "1")
    alice = client(central, "alicetok")
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=2, memory=512 << 20, node="h1"))
    # box first: the allocation goes when its last container ends.
    alice.start_container(launch.ContainerSpec(name="box", command=["sleep", "600"],
                                               env={"FROM_SPEC": "1"}, cpus=1,
                                               memory="256MiB"), a)
    alice.start_container(launch.ContainerSpec(name="env", command=["env"],
                                               env={"FROM_SPEC": "1"}, cpus=1,
                                               memory="256MiB"), a)
    wait_for(lambda: any(c["name"] == "env" and c.get("last_exit") == "exited(0)"
                         for c in alice.containers()), "env's exit")
    own = dict(line.split("=", 1) for line in alice.container_logs("env").splitlines())
    wait_for(lambda: any(c["name"] == "box" and c["state"] == "running"
                         for c in alice.containers()), "box running")
    out = cli(central, "exec", "box", "--", "env", token="alicetok")
    assert out.returncode == 0, out.stderr
    execd = dict(line.split("=", 1) for line in out.stdout.splitlines())
    granted = dict(a.env)
    if backend == "oci":   # each container's own host name, as docker's have
        assert (own.pop("HOSTNAME"), execd.pop("HOSTNAME")) == ("alice.env", "alice.box")
    assert own == execd
    assert {k: v for k, v in own.items() if k not in ("PATH", "HOME", "USER",
                                                       "DEEPNEX_LAUNCHER_ID")} == {
        "FROM_SPEC": "1", **granted}, own
    assert not set(own) & {"SECRET_FROM_AGENT", "DEEPNEX_FROM_AGENT", "SECRET_FROM_CLIENT",
                           "DEEPNEX_TOKEN", "DEEPNEX_CENTRAL", "LD_LIBRARY_PATH"}, own
    # deepnex shell's login shell on pipes: it adds its own (PWD, SHLVL), no more.
    shell = subprocess.run([sys.executable, "-m", "deepnex", "shell", "--cpus", "1", "--memory",
                            "256MiB"], input="env\n", env=_cli_env(central, "alicetok"),
                           capture_output=True, text=True, timeout=60)
    assert shell.returncode == 0, shell.stderr
    assert not {line.split("=", 1)[0] for line in shell.stdout.splitlines()} & {
        "SECRET_FROM_AGENT", "DEEPNEX_FROM_AGENT", "SECRET_FROM_CLIENT", "DEEPNEX_TOKEN",
        "DEEPNEX_CENTRAL", "LD_LIBRARY_PATH"}, shell.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent runs users' containers only as root")
def test_a_users_container_on_an_agent_runs_as_their_uid(central, agents, tmp_path):
    """An agent once ran every user's container as itself: root, with every
    capability, so that any user with a token owned each agent's node."""
    h1 = agents.start("h1", "h1tok")
    agents.registered(h1, "h1")
    alice = client(central, "alicetok")
    from deepnex import gpu, launch
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1"))
    state = tmp_path / "h1"
    alice.start_container(launch.ContainerSpec(
        name="who", command=["sh", "-c", f"pwd; id -u; id -G; ls {state} 2>/dev/null || "
                                         "echo no-state; touch /etc/deepnex-owned 2>/dev/null || "
                                         "echo no-write; grep CapEff /proc/self/status"]), a)
    wait_for(lambda: alice.containers()[0].get("last_exit") == "exited(0)", "who's exit")
    # Without limits of its own it runs under its grant's, and says so.
    assert (alice.containers()[0]["cpus"], alice.containers()[0]["memory"]) == (1, 256 << 20)
    assert alice.container_logs("who") == (
        "/\n65534\n65534\nno-state\nno-write\nCapEff:\t0000000000000000\n")
    assert not os.path.exists("/etc/deepnex-owned")
    # Its logs and records are the agent's alone, as central's are.
    assert oct(os.stat(state).st_mode & 0o777) == "0o700"


def test_killed_central_gets_every_container_back(central_proc, agents, tmp_path):
    central = central_proc[1]
    for node in ("h1", "h2"):
        p = agents.start(node, f"{node}tok")
        agents.registered(p, node)
    from deepnex import gpu
    alice = client(central, "alicetok")
    for node in ("h1", "h2"):
        a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node=node))
        out = cli(central, "launch", "--alloc", a.id, "--name", f"w-{node}", "--",
                  "sleep", "120", token="alicetok")
        assert out.returncode == 0, out.stderr
    before = {c["name"]: (c["node"], c["id"], c["state"]) for c in alice.containers()}
    assert before == {"w-h1": ("h1", before["w-h1"][1], "running"),
                      "w-h2": ("h2", before["w-h2"][1], "running")}
    central_proc[0].kill()
    # Same address: the agents dial it again.
    central_proc[0], again = start_central(tmp_path, listen=central)
    assert again == central
    alice = client(central, "alicetok")
    wait_for(lambda: {c["name"]: (c["node"], c["id"], c["state"])
                      for c in alice.containers()} == before,
             lambda: f"the containers back after central's restart: {alice.containers()}",
             timeout=20)
    for _, pid, _ in before.values():
        os.kill(int(pid), 0)  # still running: nothing killed them


def test_a_launch_just_after_centrals_restart_waits_for_the_agent(central_proc, agents,
                                                                     tmp_path):
    """A new user's job started seconds after central's restart failed with
    "node n1: its deepnex-agent is not connected" on a node granted to it.
    A call to an agent away within its node's grace now waits for it."""
    import signal
    central = central_proc[1]
    h1 = agents.start("h1", "h1tok")
    agents.registered(h1, "h1")
    h1.proc.send_signal(signal.SIGSTOP)  # away until the launch is under way
    try:
        central_proc[0].kill()
        central_proc[0], again = start_central(tmp_path, listen=central, node_timeout=60)
        from deepnex import gpu
        a = client(central, "alicetok").allocate(
            gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1"))
        launch = subprocess.Popen(
            [sys.executable, "-m", "deepnex", "launch", "--alloc", a.id, "--name", "early",
             "--", "true"], env=_cli_env(central, "alicetok"), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired):  # the old central failed at once
            launch.wait(timeout=3)
    finally:
        h1.proc.send_signal(signal.SIGCONT)
    out, err = launch.communicate(timeout=60)
    assert launch.returncode == 0, out + err
    assert out.startswith("early "), out


@pytest.mark.parametrize("default_state_dir", [False, True], ids=["given", "default"])
def test_restarted_agent_reattaches_to_its_containers(central, agents, tmp_path, monkeypatch,
                                                      default_state_dir):
    # Without --state-dir too: on the temporary directory that was its
    # default, a restarted agent found none of its containers, and central
    # regranted the GPU of one that ran on. The default is systemd's
    # $STATE_DIRECTORY/NODE where that is set.
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "var"))
    state = tmp_path / "var" / "h1" if default_state_dir else tmp_path / "h1"
    h1 = agents.start("h1", "h1tok", default_state_dir=default_state_dir)
    agents.registered(h1, "h1")
    from deepnex import gpu
    alice = client(central, "alicetok")
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1"))
    # It burns some CPU first: what it used must outlive the agent that
    # started it.
    out = cli(central, "launch", "--alloc", a.id, "--name", "w0", "--", "sh", "-c",
              "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; echo up; sleep 120",
              token="alicetok")
    assert out.returncode == 0, out.stderr
    pid = alice.containers()[0]["id"]
    wait_for(lambda: cli(central, "logs", "w0", token="alicetok").stdout == "up\n", "w0 up")
    record = state / "containers" / "alice.w0" / "record.json"
    cgroup = json.loads(record.read_text()).get("cgroup", "")
    assert os.stat(state).st_mode & 0o777 == 0o700
    h1.kill()
    wait_for(lambda: status(central)["h1"] == "NotReady", "h1 NotReady", timeout=7)
    again = agents.start("h1", "h1tok", default_state_dir=default_state_dir)
    agents.registered(again, "h1")
    wait_for(lambda: status(central)["h1"] == "Ready", "h1 Ready again", timeout=10)
    c = alice.containers()
    assert [(x["name"], x["node"], x["id"], x["state"]) for x in c] == [
        ("w0", "h1", pid, "running")]
    os.kill(int(pid), 0)
    assert cli(central, "logs", "w0", token="alicetok").stdout == "up\n"
    # Its grant was held all along: the node going NotReady for a moment
    # (under its node-lost-after) releases nothing.
    assert [x.id for x in alice.allocations()] == [a.id]
    # The restarted agent stops it, and the grant goes.
    stop = cli(central, "stop", "w0", "--grace", "5", token="alicetok")
    assert (stop.returncode, stop.stdout) == (0, "w0 stopped signaled(SIGTERM), allocation released\n")
    wait_for(lambda: not pid_alive(pid), "w0's process gone")
    # What it used is kept past its end; it fell to nothing (CPU seconds 0).
    if cgroup:
        usage = wait_for(lambda: [x["usage"] for x in alice.containers()
                                  if x["state"] == "stopped"], "w0 stopped")[0]
        assert usage["cpu_seconds"] > 0.02 and usage["memory_peak"] > 0, usage
        assert (usage["memory"], usage["pids"]) == (0, 0), usage
    # The cgroup the first agent made for it goes with it too.
    if cgroup:
        wait_for(lambda: not glob.glob(f"/sys/fs/cgroup/{cgroup}")
                 and not glob.glob(f"/sys/fs/cgroup/*/{cgroup}"), f"w0's cgroup {cgroup} removed")


def _start_time(pid):
    """Field 22 of /proc/PID/stat: the kernel start time, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[19])


def test_a_container_its_restarted_agent_does_not_report_ends_lost(central, agents, tmp_path):
    """An agent restarted on another state directory knows nothing of what
    the killed one ran: central once showed such a container "starting"
    for ever, its grant held; one that had ended lost its exit."""
    h1 = agents.start("h1", "h1tok")
    agents.registered(h1, "h1")
    from deepnex import gpu, launch
    alice = client(central, "alicetok")
    ended = alice.allocate(gpu.Request(user="alice", cpus=1, memory=256 << 20, node="h1"))
    alice.start_container(launch.ContainerSpec(name="done", command=["true"]), ended)
    wait_for(lambda: alice.containers()[0].get("last_exit") == "exited(0)", "done's exit")
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1"))
    alice.start_container(launch.ContainerSpec(name="w", command=["sleep", "120"]), a)
    wait_for(lambda: {c["name"]: c["state"] for c in alice.containers()}.get("w") == "running",
             "w running")
    pid = int(next(c["id"] for c in alice.containers() if c["name"] == "w"))
    launcher_id = json.loads(
        (tmp_path / "h1" / "containers" / "alice.w" / "record.json").read_text())["launcher_id"]
    h1.kill()
    try:
        again = agents.start("h1", "h1tok", ["--state-dir", str(tmp_path / "h1-new")])
        agents.registered(again, "h1")
        wait_for(lambda: {c["name"]: c.get("last_exit") for c in alice.containers()} == {
            "done": "exited(0)", "w": "lost"}, lambda: f"w lost: {alice.containers()}")
        wait_for(lambda: alice.allocations() == [], "w's grant back")
    finally:
        # What the killed agent left running: no agent knows it now.
        launch.Launcher(state_dir=str(tmp_path / "h1-sweep")).cleanup(launcher_id)
    wait_for(lambda: not pid_alive(pid), "the orphan's end")


def test_restarted_agent_does_not_adopt_a_reused_pid(central, agents, tmp_path):
    # A container recorded as running whose pid is alive but is another
    # process now (its start time differs): a group leader, so that a
    # signal to the recorded container's group would reach it. Its grant is
    # one central does not know: adopted, it would be stopped.
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        record = tmp_path / "h1" / "containers" / "alice.w0" / "record.json"
        record.parent.mkdir(parents=True)
        forged = {"name": "alice.w0", "launcher_id": "gone", "launcher_pid": 0,
                  "backend": "process", "state": "running", "restarts": 0, "id": str(other.pid),
                  "run_name": "alice.w0", "image": "", "command": ["sleep", "120"],
                  "user": "alice", "cpus": 1.0, "memory": 0, "pids_limit": 0,
                  "restart": "never", "allocation": "a999", "gpus": [], "started_at": 1.0,
                  "start_time": _start_time(other.pid) + 1}
        record.write_text(json.dumps(forged))
        h1 = agents.start("h1", "h1tok")
        agents.registered(h1, "h1")
        want = (f"deepnex-agent: container alice.w0: pid {other.pid} is another process now "
                f"(start_time {forged['start_time'] - 1}, recorded {forged['start_time']}): "
                f"not re-attached\n")
        assert want in h1.stderr()
        # Its record ended: neither ps nor a later agent takes it for running.
        ended = json.loads(record.read_text())
        assert (ended["state"], ended["last_exit"], "start_time" in ended) == (
            "exited", "lost", False)
        assert client(central, "alicetok").containers() == []
        # Two heartbeats later central has had the agent's reports, and its
        # reaper had time to stop what it took: nothing was taken.
        admin = client(central, "admintok")
        for _ in range(2):
            beat = {n.name: n.last_heartbeat for n in admin.nodes()}["h1"]
            wait_for(lambda: {n.name: n.last_heartbeat for n in admin.nodes()}["h1"] > beat,
                     "h1's next heartbeat")
        assert client(central, "alicetok").containers() == []
        assert other.poll() is None and pid_alive(other.pid)
    finally:
        other.kill()
        other.wait()


def test_agent_serves_healthz_and_metrics_and_advertises_its_host(central_proc, agents,
                                                                  tmp_path):
    central = central_proc[1]
    scraper = tmp_path / "scraper-token"
    scraper.write_text("promtok\n")
    h1 = agents.start("h1", "h1tok", ("--listen", "127.0.0.1:0", "--advertise", "h1.lab",
                                      "--metrics-token-file", str(scraper)))
    http = h1.wait_line("deepnex-agent: serving /healthz and /metrics on 127.0.0.1:").split()[-1]
    agents.registered(h1, "h1")
    assert http_get(http, "/healthz") == (200, "ok\n")
    # /metrics names every user's containers: for a token of the file alone.
    assert http_get(http, "/metrics") == (
        401, 'missing bearer token: send "Authorization: Bearer TOKEN" with a token of the '
             "agent's --metrics-token-file (Prometheus: authorization.credentials_file)\n")
    for wrong in ("h1tok", "alicetok"):
        assert http_get(http, "/metrics", token=wrong) == (401, "invalid token\n")
    # Central keeps the advertised host per node and shows it.
    assert [(n.name, n.address) for n in client(central, "admintok").nodes()] == [("h1", "h1.lab")]
    table = cli(central, "nodes").stdout.splitlines()
    assert (table[0].split()[-1], table[1].split()[-1]) == ("ADDRESS", "h1.lab")
    from deepnex import gpu
    alice = client(central, "alicetok")
    a = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1"))
    out = cli(central, "launch", "--alloc", a.id, "--name", "w0", "--", "sleep", "60",
              token="alicetok")
    assert out.returncode == 0, out.stderr
    # The node's usage (after a heartbeat measured it) and the container's.
    wanted = ('deepnex_agent_registered{node="h1"} 1\n',
              'deepnex_container_memory_bytes{container="alice.w0",node="h1",user="alice"} ')
    wait_for(lambda: all(w in http_get(http, "/metrics", token="promtok")[1] for w in wanted)
             and 'deepnex_node_memory_in_use_bytes{node="h1"} 0\n'
             not in http_get(http, "/metrics", token="promtok")[1],
             lambda: f"the agent's metrics: {http_get(http, '/metrics', token='promtok')}")
    prometheus.parse(http_get(http, "/metrics", token="promtok")[1])
    assert http_get(http, "/nothing") == (404, "deepnex serves GET /metrics and GET /healthz\n")
    # Central gone: unhealthy, as a kubelet that cannot reach its API server.
    central_proc[0].kill()
    wait_for(lambda: http_get(http, "/healthz")[0] == 503, "the agent unhealthy")
    # With the stream's last error, which depends on when gRPC saw central go.
    code, body = http_get(http, "/healthz")
    assert code == 503 and body.startswith(
        f"node h1: not registered with deepnex-central at {central} ("), body
    assert 'deepnex_agent_registered{node="h1"} 0\n' in http_get(http, "/metrics",
                                                                  token="promtok")[1]


def test_an_agent_without_a_metrics_token_file_serves_its_metrics_to_no_one(central_proc,
                                                                           agents):
    h1 = agents.start("h1", "h1tok", ("--listen", "127.0.0.1:0"))
    http = h1.wait_line("deepnex-agent: serving /healthz and /metrics on 127.0.0.1:").split()[-1]
    agents.registered(h1, "h1")
    assert http_get(http, "/healthz") == (200, "ok\n")
    refused = (403, "this agent was started without --metrics-token-file: its /metrics names "
                    "every user's containers, and no token may read it\n")
    for token in (None, "h1tok", "admintok"):
        assert http_get(http, "/metrics", token=token) == refused


@pytest.mark.parametrize("flags,message", [
    (["--advertise", "0.0.0.0"], 'advertise "0.0.0.0": peers cannot dial a wildcard address'),
    (["--advertise", "h1:7"], 'advertise "h1:7": a host name or an address, without a port'),
    (["--listen", "h1"], 'listen: metrics address "h1": expected IPv4HOST:PORT'),
    (["--listen", "127.0.0.1:99999"],
     'listen: metrics address "127.0.0.1:99999": port "99999" is not 0-65535'),
    (["--labels", "zone=z 1"], "registering node h1: node h1: label zone=\"z 1\": "
                               "use at most 253 letters, digits, '-', '_', '.'"),
    (["--labels", "k" * 300 + "=v"], "registering node h1: node h1: label key \"" + "k" * 64 +
                                     "\"...: use 1-253 letters, digits, '-', '_', '.', '/'"),
])
def test_agent_listen_and_advertise_are_checked(central, agents, flags, message):
    bad = agents.start("h1", "h1tok", flags)
    assert bad.wait(timeout=30) == 1
    assert bad.stderr() == f"deepnex-agent: {message}\n"


def test_node_token_of_another_node_and_user_token_are_refused(central, agents):
    wrong = agents.start("h2", "h1tok")
    assert wrong.wait(timeout=30) == 1
    assert wrong.stderr() == "deepnex-agent: the token of node h1 cannot act as node h2\n"
    user = agents.start("h2", "alicetok")
    assert user.wait(timeout=30) == 1
    assert "user alice cannot register a node" in user.stderr()
    # A job's token makes no node change, an admin's included: it once
    # registered a node, and took a real node's commands (users' specs).
    job = agents.start("h2", "j1admintok")
    assert job.wait(timeout=30) == 1
    assert job.stderr() == ("deepnex-agent: the token of job j1 (root) cannot register a node: "
                            'it needs a node token ("TOKEN NAME node")\n')
    assert client(central, "admintok").nodes() == []


def test_a_second_agent_for_a_node_takes_it_and_the_first_one_exits(central, agents, tmp_path):
    """Two agents given one --node once took the node from each other
    several times a second, for ever, splitting its containers."""
    first = agents.start("h1", "h1tok")
    agents.registered(first, "h1")
    second = agents.start("h1", "h1tok", ["--state-dir", str(tmp_path / "h1-second")])
    agents.registered(second, "h1")
    assert first.wait(timeout=30) == 1
    assert first.stderr().endswith(
        "deepnex-agent: node h1: replaced by a newer connection of an agent for node h1 "
        "(another deepnex-agent registered as this node)\n")
    assert second.proc.poll() is None
    assert status(central) == {"h1": "Ready"}


@pytest.mark.parametrize("flags,message", [
    (["--gpus", "16GiB"], '--gpus: "16GiB" is not NxSIZE with N from 1 to 1024 (e.g. 2x16GiB)'),
    (["--cpus", "0"], "--cpus: 0 must be at least 1"),
    (["--labels", "rack"], '--labels: "rack" is not k=v'),
    (["--labels", "rack=a,zone=z,rack=b"], '--labels: key "rack" is given twice'),
    (["--image", "base=relative/dir"],
     '--image "base=relative/dir": "relative/dir" is not an absolute directory or "host"'),
    (["--image", "/x=host"], '--image "/x=host": expected NAME=DIR with a new NAME that is not a path'),
    (["--state-dir", ""], "--state-dir: give a directory"),
    # The default state directory is named after the node.
    (["--node", ".."], '--node: ".." is not a node name'),
    (["--node", "a/b"], '--node: "a/b" is not a node name'),
])
def test_agent_flags_are_checked(flags, message):
    if not os.path.exists(AGENT_BIN):
        pytest.skip(f"{AGENT_BIN} not built")
    out = subprocess.run([AGENT_BIN, "--central", "127.0.0.1:1", "--node", "h1", *flags],
                         capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stderr) == (2, f"deepnex-agent: {message} (see --help)\n")


def test_an_agent_that_cannot_make_cgroups_refuses_to_serve():
    # Run as nobody, who may write no cgroup: the agent exits at once naming
    # why, rather than run other users' containers without their limits.
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the agent as another user")
    require_binaries()
    # Its own (pytest's directories are root's alone).
    state = tempfile.mkdtemp(prefix="deepnex-nobody-")
    os.chown(state, 65534, 65534)
    try:
        out = subprocess.run([AGENT_BIN, "--central", "127.0.0.1:1", "--node", "h1", "--token",
                              "h1tok", "--gpus", "0", "--state-dir", state], user=65534,
                             group=65534, extra_groups=[], cwd="/", capture_output=True,
                             text=True, timeout=60)
    finally:
        shutil.rmtree(state)
    assert out.returncode == 1, out
    assert out.stderr.startswith(
        "deepnex-agent: the process backend cannot make cgroups here, so containers would run "
        "without their limits and GPU device rules: cgroup "), out.stderr
    assert "is not writable: Permission denied" in out.stderr, out.stderr
