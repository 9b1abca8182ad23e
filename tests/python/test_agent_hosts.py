"""deepnex-agent on simulated hosts (tests/python/_hosts.py): central on
head host h1, an agent on each of h2 and h3 (the agent_hosts fixture of
conftest.py, tests/python/_agents.py; process backend, 2x16GiB, central's
--node-timeout 2). A container runs on its allocation's node, agents and
central die and come back without killing a container, and a partitioned
node comes back without a duplicate. Skips without root."""

import os
import re
import time

import pytest

from _agents import AgentHosts, http_get, pid_alive, require_binaries
from _wait import wait_for


def processes_naming(marker):
    """Live processes (not zombies) whose command line contains marker."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read() and pid_alive(entry):
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def marked(c, seconds=300):
    """A command that sleeps, named by a marker unique to this test's hosts."""
    return ["sh", "-c", f"sleep {seconds}; : {c.hosts.tag}"]


def test_both_nodes_register_with_their_addresses_and_are_ready(agent_hosts):
    c = agent_hosts
    nodes = c.nodes()
    assert {n: (v["ready"], v["address"], v["labels"]) for n, v in nodes.items()} == {
        "h2": (True, "10.77.0.12", {"rack": "r1", "deepnex.io/agent": "true"}),
        "h3": (True, "10.77.0.13", {"rack": "r1", "deepnex.io/agent": "true"})}
    assert all(n["last_heartbeat"] > 0 for n in nodes.values())
    assert [g["memory"] for g in nodes["h2"]["gpus"]] == [16 << 30, 16 << 30]


def test_container_on_h2_runs_there_and_is_run_through_central(agent_hosts, tmp_path):
    c = agent_hosts
    w0 = c.launch("h2", "w0", "sh", "-c", "hostname; sleep 300")
    assert (w0["node"], w0["state"]) == ("h2", "running")
    assert os.path.isdir(tmp_path / "h2" / "containers" / "alice.w0")
    assert not os.path.exists(tmp_path / "h3" / "containers" / "alice.w0")
    wait_for(lambda: c.cli("logs", "w0", token="alicetok").stdout == "h2\n",
             lambda: f"w0's log: {c.cli('logs', 'w0', token='alicetok')}")
    ps = c.cli("ps", token="alicetok").stdout.splitlines()
    assert ps[1].split()[:4] == ["w0", "h2", "process", "running"]
    # Usage as h2's agent measures it, through central.
    wait_for(lambda: c.containers()["w0"]["usage"]["memory"] > 0,
             lambda: f"w0's usage: {c.containers()['w0']}")
    c.stop("w0")
    wait_for(lambda: not pid_alive(w0["id"]), "w0's process gone")


def test_killed_agent_goes_not_ready_then_reattaches(agent_hosts):
    c = agent_hosts
    w0 = c.launch("h2", "w0", "sh", "-c", "echo up; sleep 300")
    c.kill_agent("h2")
    killed = time.monotonic()
    c.wait_status("h2", "NotReady", timeout=c.node_timeout + 5)
    assert time.monotonic() - killed <= c.node_timeout + 5
    refused = c.cli("alloc", "--gpus", "1", "--node", "h2", "--no-wait", token="alicetok")
    assert refused.returncode != 0
    assert refused.stderr == ("deepnex: no free capacity now for this request (alice asks 1 "
                              "exclusive GPU, 0 cpus, 0B memory) and wait=false; queued, it "
                              "would be waiting for a node to take it (1 matching node(s), all "
                              "cordoned, not ready or switching mode)\n")
    assert c.status()["h3"] == "Ready"
    assert pid_alive(w0["id"])
    # Restarted: Ready within 10 s, w0 still running, the same process.
    c.start_agent("h2")
    c.wait_status("h2", "Ready", timeout=10)
    # Its other GPU is granted again, now that it is Ready.
    granted = c.cli("alloc", "--gpus", "1", "--node", "h2", "--no-wait", token="alicetok")
    assert granted.returncode == 0, granted.stderr
    got = c.containers()["w0"]
    assert (got["node"], got["id"], got["state"]) == ("h2", w0["id"], "running")
    assert pid_alive(w0["id"])
    assert c.cli("logs", "w0", token="alicetok").stdout == "up\n"
    # The new agent stops it.
    c.stop("w0")
    wait_for(lambda: not pid_alive(w0["id"]), "w0's process gone")


def test_restarted_agent_keeps_what_central_knows_and_loses_the_rest(agent_hosts):
    c = agent_hosts
    keep = c.launch("h2", "keep", "sleep", "300")
    gone = c.launch("h2", "gone", "sleep", "300")
    c.kill_agent("h2")
    c.wait_status("h2", "NotReady", timeout=c.node_timeout + 5)
    # While h2's agent is away, gone's allocation goes: central no longer
    # knows a reason for it to run.
    assert c.call("admintok", f"c.release({gone['allocation']!r})") is None
    assert pid_alive(gone["id"])
    c.start_agent("h2")
    wait_for(lambda: not pid_alive(gone["id"]), "gone stopped after h2's agent came back")
    got = c.containers()
    assert (got["keep"]["id"], got["keep"]["state"]) == (keep["id"], "running")
    assert pid_alive(keep["id"])


def test_killed_central_gets_every_container_back(agent_hosts):
    c = agent_hosts
    before = {}
    for node in ("h2", "h3"):
        w = c.launch(node, f"w-{node}", *marked(c))
        before[w["name"]] = (node, w["id"], "running")
    c.kill_central()
    c.start_central()
    wait_for(lambda: {n: (w["node"], w["id"], w["state"]) for n, w in c.containers().items()}
             == before, lambda: f"the containers back: {c.containers()}", timeout=20)
    assert all(pid_alive(pid) for _, pid, _ in before.values())
    assert sorted(processes_naming(c.hosts.tag)) == sorted(int(p) for _, p, _ in before.values())


def test_partitioned_node_comes_back_without_duplicates(agent_hosts, tmp_path):
    c = agent_hosts
    # /healthz on h2's loopback, which the partition leaves up.
    c.kill_agent("h2")
    h2 = c.start_agent("h2", flags=("--listen", "127.0.0.1:0"))
    http = h2.wait_line("deepnex-agent: serving /healthz and /metrics on 127.0.0.1:").split()[-1]
    assert http_get(http, "/healthz", on=c.on("h2")) == (200, "ok\n")
    w0 = c.launch("h2", "w0", *marked(c))
    c.hosts.partition("h2")
    partitioned = time.monotonic()
    c.wait_status("h2", "NotReady", timeout=c.node_timeout + 5)
    assert c.status()["h3"] == "Ready"
    # The agent notices too (no reset comes through a partition: its pings
    # go unanswered), within its keepalive of 2 s answered within 2 s.
    wait_for(lambda: http_get(http, "/healthz", on=c.on("h2"))[0] == 503, "h2 unhealthy",
             timeout=c.node_timeout + 10)
    assert time.monotonic() - partitioned <= c.node_timeout + 10
    # Whichever gives up first: gRPC's keepalive watchdog, or the kernel
    # (gRPC sets TCP_USER_TIMEOUT to the keepalive timeout) on the ping or
    # heartbeat left unacknowledged.
    code, body = http_get(http, "/healthz", on=c.on("h2"))
    assert code == 503 and re.fullmatch(
        re.escape(f"node h2: not registered with deepnex-central at {c.address} (")
        + r"(keepalive watchdog timeout|recvmsg:Connection timed out)\)\n", body), body
    c.hosts.heal()
    c.wait_status("h2", "Ready", timeout=30)
    wait_for(lambda: http_get(http, "/healthz", on=c.on("h2")) == (200, "ok\n"),
             "h2 healthy after the heal", timeout=30)
    assert {n: (w["node"], w["id"], w["state"]) for n, w in c.containers().items()} == {
        "w0": ("h2", w0["id"], "running")}
    assert processes_naming(c.hosts.tag) == [int(w0["id"])]
    assert os.listdir(tmp_path / "h2" / "containers") == ["alice.w0"]


def test_agent_on_a_host_serves_healthz_and_metrics(agent_hosts, tmp_path):
    c = agent_hosts
    c.kill_agent("h3")
    scraper = tmp_path / "scraper-token"
    scraper.write_text("promtok\n")
    h3 = c.start_agent("h3", flags=("--listen", "10.77.0.13:0",
                                    "--metrics-token-file", str(scraper)))
    http = h3.wait_line("deepnex-agent: serving /healthz and /metrics on 10.77.0.13:")
    http = http.split()[-1]
    # Dialled from the head host, as a monitoring system would.
    assert http_get(http, "/healthz", on=c.on()) == (200, "ok\n")
    assert 'deepnex_agent_registered{node="h3"} 1\n' in http_get(http, "/metrics", on=c.on(),
                                                                  token="promtok")[1]
    c.kill_central()
    wait_for(lambda: http_get(http, "/healthz", on=c.on())[0] == 503, "h3 unhealthy")
    # With the stream's last error, which depends on when gRPC saw central go.
    code, body = http_get(http, "/healthz", on=c.on())
    assert code == 503 and body.startswith(
        f"node h3: not registered with deepnex-central at {c.address} ("), body
    c.start_central()
    # As for the containers after central's restart: the agent redials
    # within its backoff, and gRPC's connection attempt may take seconds.
    wait_for(lambda: http_get(http, "/healthz", on=c.on()) == (200, "ok\n"), "h3 healthy again",
             timeout=30)


def test_oci_agent_runs_its_own_image_and_reattaches(make_hosts, tmp_path):
    """The oci backend on h2: image "base" is a name in central's catalog
    (its directory there is empty) and in h2's own (the host image), and
    runs h2's; a SIGKILLed agent re-attaches to the runc container."""
    require_binaries()
    from deepnex import launch
    why = launch.probe_backends().get("oci", "")
    if why:
        pytest.skip(f"oci backend: {why}")
    empty = tmp_path / "central-base"
    empty.mkdir()
    c = AgentHosts(make_hosts({"h1": 11, "h2": 12}), tmp_path, nodes=("h2",), backend="oci",
                   central_flags=("--image", f"base={empty}"),
                   agent_flags=("--image", "base=host"))
    try:
        c.start()
        a = c.allocate("h2")
        out = c.cli("launch", "--alloc", a["id"], "--name", "w0", "--image", "base", "--",
                    "sh", "-c", "echo up; sleep 300", token="alicetok")
        assert out.returncode == 0, out.stderr
        w0 = c.containers()["w0"]
        assert (w0["node"], w0["backend"], w0["state"]) == ("h2", "oci", "running")
        wait_for(lambda: c.cli("logs", "w0", token="alicetok").stdout == "up\n", "w0's log")
        runc = ["runc", "--root", str(tmp_path / "h2" / "runc")]
        init_pid = int(c.hosts.run("h2", [*runc, "state", w0["id"]]).stdout.split('"pid": ')[1]
                       .split(",")[0])
        c.kill_agent("h2")
        c.wait_status("h2", "NotReady", timeout=c.node_timeout + 5)
        c.start_agent("h2")
        c.wait_status("h2", "Ready", timeout=10)
        got = c.containers()["w0"]
        assert (got["node"], got["id"], got["state"]) == ("h2", w0["id"], "running")
        assert pid_alive(init_pid)
        assert c.cli("logs", "w0", token="alicetok").stdout == "up\n"
        wait_for(lambda: c.containers()["w0"]["usage"]["memory"] > 0, "w0's usage")
        c.stop("w0")
        assert not pid_alive(init_pid)
        # Removed from runc's state with its record.
        wait_for(lambda: c.hosts.run("h2", [*runc, "list", "-q"]).stdout == "",
                 "w0 gone from runc's state")
    finally:
        c.close()
