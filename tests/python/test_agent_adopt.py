"""A restarted deepnex-agent with --backend docker re-attaches to its
containers on the Docker Engine API (podman's service, started by
tests/launch/podman.sh), found by the labels the docker backend sets: their
logs, usage and stop work through central again, and a labelled container
that central does not know (its grant is gone) is swept. Skips where podman cannot start."""

import http.client
import json
import os
import socket
import subprocess
import urllib.parse

import pytest

from _agents import Agents, cli, client, start_central, status
from _wait import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("d", timeout=30)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(self.path)


def engine(sock, method, path):
    """(status, parsed JSON or text) of one Docker API call on `sock`."""
    c = _UnixHTTP(sock)
    try:
        c.request(method, path)
        r = c.getresponse()
        body = r.read().decode()
    finally:
        c.close()
    try:
        return r.status, json.loads(body)
    except ValueError:
        return r.status, body


def labelled(sock, name):
    """The engine's containers (any state) labelled deepnex.name=`name`."""
    filters = urllib.parse.quote(json.dumps({"label": [f"deepnex.name={name}"]}))
    code, listed = engine(sock, "GET", f"/containers/json?all=1&filters={filters}")
    assert code == 200, listed
    return listed


@pytest.fixture(scope="module")
def podman():
    """The socket of podman's Docker API service, its busybox image also
    tagged "host" (central's image for an agent node's container)."""
    d = f"/tmp/deepnex-podman-adopt-{os.getpid()}"
    script = os.path.join(ROOT, "tests", "launch", "podman.sh")
    start = subprocess.run(["bash", script, "start", d], capture_output=True, text=True,
                           timeout=120)
    if not os.path.exists(os.path.join(d, "env")):
        pytest.skip(f"no Docker API: {start.stdout.strip()} {start.stderr.strip()}")
    try:
        env = dict(line.split("=", 1) for line in open(os.path.join(d, "env")).read().split())
        sock, image = env["DEEPNEX_TEST_DOCKER_SOCKET"], env["DEEPNEX_TEST_DOCKER_IMAGE"]
        code, text = engine(sock, "POST", f"/images/{image}/tag?repo=host&tag=latest")
        assert code == 201, text
        yield sock
    finally:
        subprocess.run(["bash", script, "stop", d], capture_output=True, timeout=120)


def test_restarted_docker_agent_reattaches_by_labels_and_sweeps_unknown(podman, tmp_path):
    central_daemon, central = start_central(tmp_path)
    agents = Agents(tmp_path, central)
    flags = ("--backend", "docker", "--docker-socket", podman)
    try:
        h1 = agents.start("h1", "h1tok", flags)
        agents.registered(h1, "h1")
        from deepnex import gpu
        alice = client(central, "alicetok")
        a = alice.allocate(gpu.Request(user="alice", gpus=0, cpus=1, memory=256 << 20,
                                       node="h1"))
        out = cli(central, "launch", "--alloc", a.id, "--name", "w0", "--",
                  "sh", "-c", "echo up; exec sleep 120", token="alicetok")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: cli(central, "logs", "w0", token="alicetok").stdout == "up\n",
                 "w0's log")
        [c] = alice.containers()
        assert (c["name"], c["node"], c["backend"], c["state"]) == ("w0", "h1", "docker",
                                                                    "running")
        [ours] = labelled(podman, "alice.w0")
        assert ours["Id"] == c["id"]

        # A container of the same backend's labels that central never knew
        # (its record as a killed agent before would have left it).
        record = json.loads((tmp_path / "h1" / "containers" / "alice.w0" /
                             "record.json").read_text())
        labels = {"deepnex.launcher": record["launcher_id"], "deepnex.name": "alice.stale"}
        body = json.dumps({"Image": "host", "Cmd": ["sleep", "120"], "Labels": labels,
                           "HostConfig": {"NetworkMode": "none"}})
        conn = _UnixHTTP(podman)
        conn.request("POST", "/containers/create?name=deepnex-adopt-stale", body,
                     {"Content-Type": "application/json"})
        created = json.loads(conn.getresponse().read())
        conn.close()
        assert engine(podman, "POST", f"/containers/{created['Id']}/start")[0] == 204
        stale = dict(record, name="alice.stale", id=created["Id"], run_name="deepnex-adopt-stale")
        stale["allocation"] = a.id + "0"  # a grant central does not know
        (tmp_path / "h1" / "containers" / "alice.stale").mkdir()
        (tmp_path / "h1" / "containers" / "alice.stale" / "record.json").write_text(
            json.dumps(stale))

        # SIGKILL: the agent stops nothing; restarted, it finds both by labels.
        h1.kill()
        wait_for(lambda: status(central)["h1"] == "NotReady", "h1 NotReady", timeout=7)
        again = agents.start("h1", "h1tok", flags)
        agents.registered(again, "h1")
        wait_for(lambda: status(central)["h1"] == "Ready", "h1 Ready again", timeout=10)
        # The one on a grant central does not know is swept (stopped) as a
        # process one is; the one it knows runs on.
        wait_for(lambda: [x["State"] for x in labelled(podman, "alice.stale")] == ["exited"],
                 lambda: f"alice.stale swept: {labelled(podman, 'alice.stale')}")
        wait_for(lambda: sorted((x["name"], x["node"], x["id"], x["state"])
                                for x in alice.containers()) == [
                     ("stale", "h1", created["Id"], "stopped"), ("w0", "h1", c["id"], "running")],
                 lambda: f"stale stopped, w0 running: {alice.containers()}")
        assert [(x["Id"], x["State"]) for x in labelled(podman, "alice.w0")] == [
            (c["id"], "running")]

        # Logs, usage, stop and wait of the re-attached one, through central.
        assert cli(central, "logs", "w0", token="alicetok").stdout == "up\n"
        def w0():
            return [x for x in alice.containers() if x["name"] == "w0"]
        wait_for(lambda: w0()[0]["usage"]["memory"] > 0 and w0()[0]["usage"]["pids"] == 1,
                 "w0's usage")
        # sleep as the container's PID 1 ignores SIGTERM: SIGKILL after the grace.
        stop = cli(central, "stop", "w0", "--grace", "1", token="alicetok")
        assert (stop.returncode, stop.stdout) == (
            0, "w0 stopped signaled(SIGKILL), allocation released\n"), stop.stderr
        assert [(x["Id"], x["State"]) for x in labelled(podman, "alice.w0")] == [
            (c["id"], "exited")]
        assert [(x["state"], x["allocation_released"]) for x in w0()] == [("stopped", True)]
    finally:
        agents.close()
        central_daemon.stop()
