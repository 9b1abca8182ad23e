"""deepnex run --central with deepnex-agents: each worker and parameter
server runs on its allocation's node through central and the node's agent
(the "central" launch backend), its output comes back with rank prefixes,
exit codes and restarts are the job's, and a lost node fails the job naming
the node or, with --restart, re-places its worker on another node. A job
rides out a partition shorter than --node-lost-after; after a longer one,
the lost worker that the healed node still runs is stopped.

On 127.0.0.1 (central and agents as plain processes; no root needed), and
on simulated hosts (central and `deepnex run` on h1, agents on h2 and h3;
skips without root)."""

import contextlib
import os
import pwd
import re
import signal
import subprocess
import sys
import time

import pytest

import _agents
import _central
from _wait import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
DIGITS = os.path.join(ROOT, "examples", "digits", "mlp_numpy.py")
# Jobs' containers use the host network (their store is on the runner's
# host).
CENTRAL_FLAGS = ("--allow-host-network", "alice")
# A node silent for 5 s has lost its containers: for the tests that lose
# one (the others keep the default, 5 min, as a loaded machine may stall an
# agent's heartbeats for seconds).
LOSING = ("--node-lost-after", "5")


def run_argv(central, *flags):
    """`deepnex run --central` as alice, 512 MiB per worker; flags end with
    -- and the command."""
    return [PY, "-m", "deepnex", "run", "--central", central, "--token", "alicetok",
            "--memory", "512MiB", *flags]


def job_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DEEPNEX_") or k in ("DEEPNEX_BUILD_DIR", "DEEPNEX_PS_BIN")}
    env.pop("DEEPNEX_CENTRAL", None)
    return env


def finish(p, timeout=120):
    """(exit code, stdout + stderr) of a deepnex run Popen; fails if it hangs."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        out, _ = p.communicate(timeout=60)
        pytest.fail(f"deepnex run hung:\n{out}")
    return p.returncode, out


# ---- on 127.0.0.1


@pytest.fixture
def local_agents(tmp_path):
    """central and agents h1 and h2 on 127.0.0.1 (2x16GiB each), both
    registered; (address, Agents)."""
    central, address = _agents.start_central(tmp_path, flags=CENTRAL_FLAGS, node_timeout=5)
    agents = _agents.Agents(tmp_path, address)
    try:
        for node in ("h1", "h2"):
            agents.registered(agents.start(node, f"{node}tok"), node)
        yield address, agents
    finally:
        agents.close()
        central.stop()


def local_run(address, *flags, cwd=ROOT):
    return subprocess.Popen(run_argv(address, *flags), env=job_env(), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_workers_run_through_central_on_their_nodes(local_agents, tmp_path):
    address, _ = local_agents
    code, out = finish(local_run(
        address, "--name", "j1", "--workers", "2", "--nodes", "2", "--gpus-per-worker", "1",
        "--mode", "allreduce", "--", "sh", "-c",
        'echo "rank $DEEPNEX_RANK gpus $CUDA_VISIBLE_DEVICES of $WORLD_SIZE"; exit $DEEPNEX_RANK'))
    # Worker 1 exited 1: the job's exit code, as with a local backend.
    assert code == 1, out
    # One GPU of each node: index 0 on both.
    assert sorted(re.findall(r"^\[worker (\d)\] rank (\d) gpus 0 of 2$", out, re.M)) == [
        ("0", "0"), ("1", "1")], out
    assert "deepnex run: job j1: 2 workers, mode allreduce, backend central\n" in out, out
    assert "deepnex run: worker 0: exited(0)\n" in out, out
    assert "deepnex run: worker 1: exited(1)\n" in out, out
    # Each ran through its node's agent, none on this process's launcher.
    assert os.path.isdir(tmp_path / "h1" / "containers" / "alice.j1-worker0")
    assert os.path.isdir(tmp_path / "h2" / "containers" / "alice.j1-worker1")
    # Every allocation went back.
    assert _agents.client(address, "alicetok").allocations() == []


def test_a_worker_restarted_by_its_agent_is_told_and_the_job_passes(local_agents, open_dir):
    address, _ = local_agents
    gate = open_dir / "failed-once"
    code, out = finish(local_run(
        address, "--name", "j2", "--workers", "1", "--mode", "allreduce",
        "--restart", "on-failure:1", "--", "sh", "-c",
        f'if [ -e {gate} ]; then echo second; else touch {gate}; echo first; exit 3; fi'))
    assert code == 0, out
    assert re.findall(r"^\[worker 0\] (\w+)$", out, re.M) == ["first", "second"], out
    assert "deepnex run: worker 0 exited(3); restarting (1/1)" in out, out
    assert "deepnex run: worker 0: exited(0) after 1 restart\n" in out, out


def start_sleeping(address, name):
    """A 2-worker job whose workers sleep, once both run on the agents."""
    p = local_run(address, "--name", name, "--workers", "2", "--mode", "allreduce", "--",
                  "sleep", "600")
    alice = _agents.client(address, "alicetok")
    wait_for(lambda: sorted((c["name"], c["state"]) for c in alice.containers()) == [
        (f"{name}-worker0", "running"), (f"{name}-worker1", "running")] or p.poll() is not None,
        f"{name}'s workers running")
    return p, alice


def test_a_cancelled_job_fails_though_its_workers_end_first(local_agents):
    """Central stops a cancelled job's containers at once: the runner once
    saw them end before it heard of the cancel, exited 0 and recorded a
    cancelled job as exit 0."""
    address, _ = local_agents
    p, alice = start_sleeping(address, "jc")
    alice.cancel_job("jc")
    code, out = finish(p)
    assert code == 1, out
    assert "job jc was cancelled by alice through deepnex-central" in out, out
    record = alice.job("jc")
    assert (record["state"], record["exit_code"]) == ("cancelled", 1)
    assert alice.allocations() == []


def test_a_worker_stopped_from_outside_fails_the_job(local_agents):
    """`deepnex stop` of one worker once left the job "completed", exit 0,
    however far the training had come."""
    address, _ = local_agents
    p, alice = start_sleeping(address, "js")
    alice.stop_container("js-worker1", grace=5)
    code, out = finish(p)
    assert code == 128 + 15, out
    assert "deepnex run: worker 1 was stopped from outside the job: signaled(SIGTERM)\n" in out, out
    record = alice.job("js")
    assert (record["state"], record["exit_code"]) == ("failed", 143)
    assert alice.allocations() == []


def test_ps_job_runs_its_server_through_an_agent(local_agents, tmp_path):
    address, _ = local_agents
    code, out = finish(local_run(
        address, "--name", "j3", "--workers", "1", "--ps", "1", "--mode", "sync",
        "--", "sh", "-c", 'echo "ps $DEEPNEX_PS_ADDRS"'))
    assert code == 0, out
    assert re.search(r"^\[ps 0\] deepnex-ps listening on \S+:\d+", out, re.M), out
    # At the address its node's agent advertises.
    listening = re.search(r"^\[ps 0\] deepnex-ps listening on (\S+:\d+)", out, re.M).group(1)
    advertised = {n.address for n in _agents.client(address, "admintok").nodes()}
    assert listening.rsplit(":", 1)[0] in advertised, (advertised, out)
    assert f"[worker 0] ps {listening}\n" in out, out
    assert os.path.isdir(tmp_path / "h1" / "containers" / "alice.j3-ps0") or \
        os.path.isdir(tmp_path / "h2" / "containers" / "alice.j3-ps0"), out
    # The server was stopped before the record was final: a probe's
    # `deepnex job show` listed it running after the job's end.
    record = _agents.client(address, "alicetok").job("j3")
    assert record["state"] == "completed", record
    states = {c["role"]: c["state"] for c in record["containers"]}
    assert states["worker"] == "exited" and states["ps"] != "running", record


def test_workers_run_as_the_mapped_user_have_that_users_home(local_agents):
    """A new user's workers ran as the uid central maps her to with the
    submitter's HOME (/root): every cache written there failed. Through
    central they get the mapped user's home (passwd's where it exists,
    else /); they start in the submitter's directory, as srun's do."""
    address, _ = local_agents
    code, out = finish(local_run(address, "--name", "j6", "--workers", "1", "--mode", "allreduce",
                                 "--", "sh", "-c", 'echo "home $HOME"'))
    assert code == 0, out
    uid = int(_central.USER_IDS.split(":")[0])
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        home = "/"
    if not os.path.isdir(home):
        home = "/"
    assert f"[worker 0] home {home}\n" in out, out
    assert "deepnex run: job j6: 1 worker, mode allreduce, backend central\n" in out, out


def test_a_parameter_server_that_does_not_fit_beside_the_workers(local_agents, tmp_path):
    """A probe's job whose workers filled their node queued its server's
    request behind the workers' own grants and waited for ever. The server
    now goes to another node with room, and where none has any the job
    fails at once, naming what to ask for."""
    address, _ = local_agents
    code, out = finish(local_run(
        address, "--name", "j4", "--workers", "1", "--cpus", "4", "--ps", "1", "--mode", "sync",
        "--", "sh", "-c", 'echo "ps $DEEPNEX_PS_ADDRS"'))
    assert code == 0, out
    assert re.search(r"^\[worker 0\] ps \S+:\d+$", out, re.M), out
    worker = [n for n in ("h1", "h2") if os.path.isdir(tmp_path / n / "containers" / "alice.j4-worker0")]
    server = [n for n in ("h1", "h2") if os.path.isdir(tmp_path / n / "containers" / "alice.j4-ps0")]
    assert len(worker) == len(server) == 1 and worker != server, out
    code, out = finish(local_run(
        address, "--name", "j5", "--workers", "2", "--nodes", "2", "--cpus", "4", "--ps", "1",
        "--mode", "sync", "--", "true"))
    assert code != 0, out
    assert "ps 0: no node has room now for a parameter server (4 cpus and 512MiB, as a worker) " \
           "beside the job's workers" in out, out
    assert "ask for fewer --cpus or --memory per worker, or fewer --workers" in out, out
    assert _agents.client(address, "alicetok").allocations() == [], out  # nothing kept


def test_the_central_backend_needs_an_allocation_and_an_address():
    from deepnex import DeepnexError, launch
    with pytest.raises(DeepnexError, match=r"^central\.address: empty"):
        launch.Launcher(backend="central")


# ---- on simulated hosts


@pytest.fixture
def make_cluster(make_hosts, tmp_path):
    """make_cluster(*central_flags, node_timeout=S): central on h1, agents on
    h2 and h3 (2x16GiB, process backend), both Ready, central allowing alice
    the host network."""
    _agents.require_binaries()
    made = []

    def make(*flags, node_timeout=10):
        c = _agents.AgentHosts(make_hosts({"h1": 11, "h2": 12, "h3": 13}), tmp_path,
                               central_flags=(*CENTRAL_FLAGS, *flags), node_timeout=node_timeout)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.close()


def hosts_run(c, *flags):
    """deepnex run --central on h1 (central's host) as alice."""
    return c.hosts.popen("h1", run_argv(c.address, *flags), env=job_env(), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def placed(out):
    """{rank: hostname} from the workers' "rank R on HOST" lines (the last
    for each rank)."""
    return dict(re.findall(r"^\[worker \d+\] rank (\d+) on (\S+)$", out, re.M))


def digits(epochs=6):
    worker = (f'echo "rank $DEEPNEX_RANK on $(hostname)"; echo "master $MASTER_ADDR"; '
              f'exec {PY} {DIGITS} --epochs {epochs}')
    return ["--", "sh", "-c", worker]


ADDRESSES = {"h2": "10.77.0.12", "h3": "10.77.0.13"}


@pytest.mark.parametrize("mode,ps", [("allreduce", "0"), ("sync", "1")])
def test_digits_with_one_worker_on_each_agent_node(make_cluster, mode, ps):
    pytest.importorskip("sklearn")
    cluster = make_cluster()
    # One GPU of each node taken: two workers of one GPU each land one per node.
    for node in ("h2", "h3"):
        cluster.allocate(node, token="bobtok", user="bob")
    code, out = finish(hosts_run(cluster, "--workers", "2", "--gpus-per-worker", "1",
                                 "--ps", ps, "--mode", mode, "--lr", "0.1", "--momentum", "0.9",
                                 *digits()), timeout=240)
    assert code == 0, out
    where = placed(out)
    assert sorted(where.items()) in ([("0", "h2"), ("1", "h3")], [("0", "h3"), ("1", "h2")]), out
    # MASTER_ADDR: the address rank 0's node's agent advertises.
    assert re.findall(r"^\[worker \d\] master (\S+)$", out, re.M) == [ADDRESSES[where["0"]]] * 2, out
    summary = re.search(r"summary: .* test_accuracy=([0-9.]+)", out)
    assert summary, out
    acc = float(summary.group(1))
    assert acc >= 0.9, out
    if ps == "1":
        # On a worker's node, at the address its agent advertises.
        host = re.search(r"^\[ps 0\] deepnex-ps listening on (\S+):\d+", out, re.M).group(1)
        assert host in ADDRESSES.values(), out


# Worker 1 waits at the gate (the test kills its node's agent meanwhile); a
# worker that is not the first run of rank 1 finishes at once.
GATED = ('echo "rank $DEEPNEX_RANK on $(hostname)"; '
         'if [ "$DEEPNEX_RANK" = 1 ] && [ ! -e {gate}.1 ]; then touch {gate}.1; '
         'while [ ! -e {gate} ]; do sleep 0.05; done; fi; '
         'if [ "$DEEPNEX_RANK" = 0 ]; then while [ ! -e {gate}.done ]; do sleep 0.05; done; fi; '
         'echo "rank $DEEPNEX_RANK done"; touch {gate}.done')


@pytest.mark.parametrize("restart", [False, True])
def test_a_lost_node_fails_the_job_or_replaces_its_worker(make_cluster, open_dir, restart):
    cluster = make_cluster(*LOSING, node_timeout=2)
    gate = open_dir / "gate"
    flags = ["--restart", "on-failure:1"] if restart else []
    p = hosts_run(cluster, "--name", "lost", "--workers", "2", "--nodes", "2",
                  "--gpus-per-worker", "1",
                  "--mode", "allreduce", *flags, "--", "sh", "-c", GATED.format(gate=gate))
    try:
        wait_for(lambda: os.path.exists(f"{gate}.1") or p.poll() is not None,
                 "worker 1 at the gate")
        # Whichever node worker 1 runs on goes: its agent is killed.
        node = cluster.containers()["lost-worker1"]["node"]
        cluster.kill_agent(node)
        code, out = finish(p, timeout=120)
    finally:
        open(gate, "w").close()
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=60)
    other = {"h2": "h3", "h3": "h2"}[node]
    if not restart:
        assert code == 1, out
        assert f'deepnex run: worker 1 was lost with its node "{node}"\n' in out, out
        assert "deepnex run: worker 1: lost\n" in out, out
    else:
        assert code == 0, out
        assert "deepnex run: worker 1 lost; restarting (1/1)" in out, out
        # Started again on the other node, not on the lost one. The lost
        # run's line went with its node unless it was read before the kill.
        runs = re.findall(r"^\[worker 1\] rank 1 on (\S+)$", out, re.M)
        assert runs[-1:] == [other] and runs[:-1] in ([], [node]), out
        assert "[worker 1] rank 1 done" in out and "[worker 0] rank 0 done" in out, out


# Each worker says where it runs, marks that it started, and waits at the
# gate (the test partitions a node meanwhile).
# Each run also appends its host to {gate}.RANK.on: a run lost with its node
# may have printed lines that the runner had not read yet.
WAITING = ('echo "rank $DEEPNEX_RANK on $(hostname)"; hostname >> {gate}.$DEEPNEX_RANK.on; '
           'touch {gate}.$DEEPNEX_RANK; '
           'while [ ! -e {gate} ]; do sleep 0.05; done; echo "rank $DEEPNEX_RANK done"')


@contextlib.contextmanager
def _waiting_job(cluster, gate, *flags):
    """Job "cut": 2 workers on 2 nodes that wait at `gate` (WAITING), with
    `flags`; yields its Popen once both wait. On the way out the hosts are
    healed, the gate opened and the job ended."""
    p = hosts_run(cluster, "--name", "cut", "--workers", "2", "--nodes", "2",
                  "--gpus-per-worker", "1", "--mode", "allreduce", *flags,
                  "--", "sh", "-c", WAITING.format(gate=gate))
    try:
        wait_for(lambda: (os.path.exists(f"{gate}.0") and os.path.exists(f"{gate}.1"))
                 or p.poll() is not None, "both workers at the gate")
        yield p
    finally:
        cluster.hosts.heal()
        open(gate, "w").close()
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=60)


def test_a_job_rides_out_a_partition_shorter_than_node_lost_after(make_cluster, open_dir):
    # --node-lost-after stays 5 min: h2 is NotReady for a while, never lost.
    cluster = make_cluster(node_timeout=2)
    gate = open_dir / "gate"
    with _waiting_job(cluster, gate) as p:
        on_h2 = [n for n, w in cluster.containers().items() if w["node"] == "h2"]
        assert len(on_h2) == 1, cluster.containers()
        cluster.hosts.partition("h2")
        cluster.wait_status("h2", "NotReady", timeout=cluster.node_timeout + 5)
        # h2's agent noticed too (keepalive) and redials: the job rides out
        # a new stream, not the old one resumed.
        agent = cluster.agents["h2"]
        wait_for(lambda: "ended (" in agent.stderr(), lambda: f"h2's agent: {agent.stderr()}")
        cluster.hosts.heal()
        cluster.wait_status("h2", "Ready", timeout=30)
        open(gate, "w").close()
        code, out = finish(p, timeout=120)
    assert code == 0, out
    # Each worker started once, on its own node, and finished: none was
    # lost, restarted or started twice.
    assert sorted(re.findall(r"^\[worker (\d)\] rank \d on (\S+)$", out, re.M)) in (
        [("0", "h2"), ("1", "h3")], [("0", "h3"), ("1", "h2")]), out
    assert sorted(re.findall(r"^\[worker (\d)\] rank \d done$", out, re.M)) == ["0", "1"], out
    assert "deepnex run: worker 0: exited(0)\n" in out, out
    assert "deepnex run: worker 1: exited(0)\n" in out, out
    assert "lost" not in out and "restarting" not in out, out
    assert cluster.call("alicetok", "c.allocations()") == [], out


def test_a_partition_longer_than_node_lost_after_fails_the_job_naming_the_node(make_cluster,
                                                                               open_dir):
    cluster = make_cluster(*LOSING, node_timeout=2)
    gate = open_dir / "gate"
    with _waiting_job(cluster, gate) as p:
        rank = "0" if cluster.containers()["cut-worker0"]["node"] == "h2" else "1"
        pid = int(cluster.containers()[f"cut-worker{rank}"]["id"])
        cluster.hosts.partition("h2")
        code, out = finish(p, timeout=120)
        cluster.hosts.heal()
        # Back, h2's agent reports the lost worker running, its grant
        # released meanwhile: stopped, not left holding the GPU.
        cluster.wait_status("h2", "Ready", timeout=30)
        wait_for(lambda: not _agents.pid_alive(pid),
                 lambda: f"the lost worker stopped: {cluster.containers()}")
        assert cluster.containers()[f"cut-worker{rank}"]["state"] == "stopped"
    assert code == 1, out
    assert f'deepnex run: worker {rank} was lost with its node "h2"\n' in out, out
    assert f"deepnex run: worker {rank}: lost\n" in out, out


def test_a_partition_longer_than_node_lost_after_replaces_the_worker_once(make_cluster,
                                                                          open_dir):
    cluster = make_cluster(*LOSING, node_timeout=2)
    gate = open_dir / "gate"
    with _waiting_job(cluster, gate, "--restart", "on-failure:1") as p:
        assert p.poll() is None, p.communicate()[0]
        rank = "0" if cluster.containers()["cut-worker0"]["node"] == "h2" else "1"
        name = f"cut-worker{rank}"
        pid = int(cluster.containers()[name]["id"])
        cluster.hosts.partition("h2")
        # Its record goes with the lost run, and comes back with the new one.
        replaced = lambda: cluster.containers().get(name, {})  # noqa: E731
        wait_for(lambda: (replaced().get("node"), replaced().get("state")) == ("h3", "running"),
                 lambda: f"{name} re-placed: {cluster.containers()}")
        cluster.hosts.heal()
        # Back, h2's agent reports the first run still running: stopped, so
        # that the worker does not run twice.
        cluster.wait_status("h2", "Ready", timeout=30)
        wait_for(lambda: not _agents.pid_alive(pid),
                 lambda: f"the first run stopped: {cluster.containers()}")
        open(gate, "w").close()
        code, out = finish(p, timeout=120)
    assert code == 0, out
    assert f"deepnex run: worker {rank} lost; restarting (1/1)" in out, out
    # Ran on h2, then once on h3 (h2's run was partitioned away before the
    # runner necessarily read its first line: its hosts file tells).
    assert open(f"{gate}.{rank}.on").read().split() == ["h2", "h3"], out
    assert re.findall(rf"^\[worker {rank}\] rank {rank} on (\S+)$", out, re.M)[-1] == "h3", out
    assert len(re.findall(rf"^\[worker {rank}\] rank {rank} done$", out, re.M)) == 1, out


@pytest.mark.parametrize("twice", [False, True])
def test_a_ctrl_c_with_a_node_cut_off_is_bounded_and_names_the_worker_left(make_cluster,
                                                                           open_dir, twice):
    """Ctrl-C with h2 cut off took 50 s: the containers were stopped one
    after another, each waiting for central's answer from h2's agent, and
    the error named the node alone ("node h2: its deepnex-agent went away
    ..."). Now every host's stop runs at once, the one that does not answer
    is left to its node after a deadline, and the worker and node are
    named. A second Ctrl-C meanwhile leaves at once, saying what was left."""
    cluster = make_cluster(node_timeout=2)
    gate = open_dir / "gate"
    with _waiting_job(cluster, gate) as p:
        rank = "0" if cluster.containers()["cut-worker0"]["node"] == "h2" else "1"
        cluster.hosts.partition("h2")
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        if twice:
            # Once the first one's stop waits for h2.
            time.sleep(1)
            p.send_signal(signal.SIGINT)
        code, out = finish(p, timeout=120)
        took = time.monotonic() - t0
    assert code == 130, out
    if twice:
        assert took < 5, (took, out)
        assert re.search(r"^deepnex run: job cut: SIGINT again: exiting without waiting for "
                         rf'the stop; left running: .*worker {rank} on node "h2"', out,
                         re.M), out
    else:
        assert took < 25, (took, out)  # 2 phases of 6 s, and the exit
        assert (f'deepnex run: worker {rank} on node "h2": not stopped within 6 s; '
                "left to its node\n") in out, out
        assert re.search(rf'^deepnex run: job cut stopped by SIGINT: worker {rank} on node '
                         '"h2": not stopped', out, re.M), out
