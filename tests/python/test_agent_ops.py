"""Monitoring and ops on deepnex-agent nodes, on 127.0.0.1: what the agents
measure (per node, per GPU through NVML, per container) on central's
Prometheus endpoint and in `deepnex nodes --usage`, every user's containers
in `deepnex ps --all` (admins only), and cordon, uncordon and drain
--release of an agent's node.

NVML is a fake here: a libnvidia-ml.so.1 built from FAKE_NVML into the
test's directory and found by the agent through LD_LIBRARY_PATH, so that
the figures it reports are known exactly."""

import re
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

from _agents import AGENT_BIN, Agents, Daemon, cli, client, start_central, status
from _central import USER_IDS
import _prometheus as prometheus
from _wait import wait_for

GiB = 1 << 30

# Two 16 GiB GPUs: GPU 0 with 3 GiB in use and 42% busy, GPU 1 idle.
FAKE_NVML = r"""
#include <stdio.h>
#include <string.h>
typedef struct { unsigned long long total, free, used; } Memory;
typedef struct { char legacy[16]; unsigned domain, bus, device, id, subsystem; char bus_id[32]; } Pci;
typedef struct { unsigned gpu, memory; } Utilization;
static const unsigned long long kUsed[2] = {3ull << 30, 0};
static const unsigned kBusy[2] = {42, 0};
static unsigned Index(void* d) { return (unsigned)(unsigned long)d - 1; }
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned* n) { *n = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** d) { *d = (void*)(unsigned long)(i + 1); return 0; }
int nvmlDeviceGetName(void* d, char* s, unsigned n) { snprintf(s, n, "Fake GPU"); return 0; }
int nvmlDeviceGetUUID(void* d, char* s, unsigned n) { snprintf(s, n, "GPU-fake-%u", Index(d)); return 0; }
int nvmlDeviceGetMemoryInfo(void* d, Memory* m) {
  m->total = 16ull << 30; m->used = kUsed[Index(d)]; m->free = m->total - m->used; return 0;
}
int nvmlDeviceGetPciInfo_v3(void* d, Pci* p) {
  memset(p, 0, sizeof *p); snprintf(p->bus_id, 32, "00000000:%02X:00.0", 0x1b + Index(d)); return 0;
}
int nvmlDeviceGetUtilizationRates(void* d, Utilization* u) {
  u->gpu = kBusy[Index(d)]; u->memory = 0; return 0;
}
"""


def fake_nvml(tmp_path):
    """The directory of a fake libnvidia-ml.so.1 (skips without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake NVML")
    d = tmp_path / "nvml"
    d.mkdir()
    (d / "nvml.c").write_text(FAKE_NVML)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libnvidia-ml.so.1"), str(d / "nvml.c")],
                   check=True, timeout=60)
    return d


def start_nvml_agent(tmp_path, central, monkeypatch):
    """h1's agent without --gpus: its GPUs and their usage from the fake NVML."""
    lib = fake_nvml(tmp_path)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    try:
        d = Daemon([AGENT_BIN, "--central", central, "--node", "h1", "--token", "h1tok",
                    "--cpus", "4", "--memory", "8GiB", "--state-dir", tmp_path / "h1"],
                   tmp_path / "logs" / "agent-h1-nvml", None)
    finally:
        monkeypatch.delenv("LD_LIBRARY_PATH")
    d.wait_line(f"deepnex-agent: node h1 registered with {central}")
    return d


def scrape(url, token="admintok", types=False):
    """parse's samples (`types`: types) of the Prometheus page at `url`,
    read with `token`."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return prometheus.parse(r.read().decode())[1 if types else 0]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """Central with a metrics endpoint (alice and bob may run containers),
    h1's agent on the fake NVML, h2's with --gpus 2x16GiB; alice's w0 runs
    on h1 and bob's b0 on h2. (address, metrics URL)."""
    central, address = start_central(
        tmp_path, flags=("--metrics-listen", "127.0.0.1:0", "--user", f"bob={USER_IDS}"))
    agents = Agents(tmp_path, address)
    try:
        h1 = start_nvml_agent(tmp_path, address, monkeypatch)
        agents.daemons.append(h1)
        agents.registered(agents.start("h2", "h2tok"), "h2")
        url = wait_for(lambda: re.search(r"metrics at (http://\S+/metrics)", central.stderr()),
                       "central's metrics address")[1]
        from deepnex import gpu
        for token, user, node, name in (("alicetok", "alice", "h1", "w0"),
                                        ("bobtok", "bob", "h2", "b0")):
            a = client(address, token).allocate(
                gpu.Request(user=user, gpus=1, cpus=1, memory=256 << 20, node=node))
            out = cli(address, "launch", "--alloc", a.id, "--name", name, "--cpus", "0.5",
                      "--memory", "128MiB", "--", "sleep", "120", token=token)
            assert out.returncode == 0, out.stderr
        yield address, url
    finally:
        agents.close()
        central.kill()


def test_agents_report_gpu_node_and_container_usage(cluster):
    address, url = cluster
    admin = client(address, "admintok")
    # h1's GPUs are NVML's; h2's are made up (--gpus) and report no usage.
    want = {"h1": [{"index": 0, "memory_used": 3 * GiB, "utilization": 42},
                   {"index": 1, "memory_used": 0, "utilization": 0}],
            "h2": []}
    wait_for(lambda: {n.name: n.gpu_usage for n in admin.nodes()} == want
             and all(n.memory_in_use > 0 for n in admin.nodes()),
             lambda: f"the agents' usage: {[(n.name, n.gpu_usage) for n in admin.nodes()]}")
    nodes = {n.name: n for n in admin.nodes()}
    assert [(g["uuid"], g["memory"]) for g in nodes["h1"].gpus] == [("GPU-fake-0", 16 * GiB),
                                                                    ("GPU-fake-1", 16 * GiB)]

    table = cli(address, "nodes", "--usage").stdout.splitlines()
    assert re.split(r"\s{2,}", table[0])[-3:] == ["GPU UTIL/MEMORY IN USE", "CPUS BUSY",
                                                  "MEMORY IN USE"]
    rows = {r.split()[0]: r.split() for r in table[1:]}
    assert rows["h1"][-3] == "0:42%/3GiB,1:0%/0B"
    assert rows["h2"][-3] == "-"

    # Central's metrics endpoint: per node, per GPU where known, per container.
    m = scrape(url)
    assert prometheus.series(m, "deepnex_node_ready") == {(("node", "h1"),): 1, (("node", "h2"),): 1}
    for name in ("deepnex_node_cpus_busy", "deepnex_node_memory_in_use_bytes",
                 "deepnex_node_heartbeat_age_seconds"):
        assert set(prometheus.series(m, name)) == {(("node", "h1"),), (("node", "h2"),)}, name
    assert all(v > 0 for v in prometheus.series(m, "deepnex_node_memory_in_use_bytes").values())
    assert all(0 <= v < 5 for v in prometheus.series(m, "deepnex_node_heartbeat_age_seconds").values())
    assert prometheus.series(m, "deepnex_gpu_memory_in_use_bytes") == {
        (("gpu", "0"), ("node", "h1")): 3 * GiB, (("gpu", "1"), ("node", "h1")): 0}
    # A ratio, Prometheus' base unit; it was a percent.
    assert prometheus.series(m, "deepnex_gpu_utilization_ratio") == {
        (("gpu", "0"), ("node", "h1")): 0.42, (("gpu", "1"), ("node", "h1")): 0}
    containers = {(("container", "alice.w0"), ("node", "h1"), ("user", "alice")),
                  (("container", "bob.b0"), ("node", "h2"), ("user", "bob"))}
    # CPU seconds only grow: a counter, named as one (it was a gauge without _total).
    assert set(prometheus.series(m, "deepnex_container_cpu_seconds_total")) == containers
    assert set(prometheus.series(m, "deepnex_container_memory_bytes")) == containers
    assert all(v >= 0 for v in prometheus.series(m, "deepnex_container_cpu_seconds_total").values())
    types = scrape(url, types=True)
    assert (types["deepnex_container_cpu_seconds_total"], types["deepnex_container_memory_bytes"]) \
        == ("counter", "gauge")
    # Every user's containers: for an admin's token alone; a user reads
    # their own series with `deepnex metrics`.
    for token, code, message in (
            (None, 401, 'missing bearer token: send "Authorization: Bearer TOKEN" with an '
                        "admin's token of central's --token-file "
                        "(Prometheus: authorization.credentials_file)\n"),
            ("nosuchtok", 401, "invalid token\n"),
            ("alicetok", 403, '"alice" is not an admin (this call requires the admin role)\n'),
            ("h2tok", 403, 'the token of "h2" is a node token: it may only act as its node '
                           "(deepnex-agent)\n"),
            # A job's admin token reaches only its job; it once read everything.
            ("j1admintok", 403, 'the token of "root" is for job "j1"; /metrics carries every '
                                "job's series: it needs an admin's token without a job\n")):
        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert (e.value.code, e.value.read().decode()) == (code, message), token
        assert (e.value.headers.get("WWW-Authenticate") == 'Bearer realm="deepnex"') == (code == 401)
    own = cli(address, "metrics", token="alicetok")
    assert own.returncode == 0, own.stderr
    assert 'user="bob"' not in own.stdout and 'user="alice"' in own.stdout
    prometheus.parse(own.stdout)  # what is left of the page is still one
    # A job-scoped token reads no container's series (they name no job, and
    # alice's w0 is of none), as `deepnex ps` shows it none; the job's admin
    # token once read every user's, alice's job token alice's.
    for token in ("j1tok", "j1admintok"):
        job = cli(address, "metrics", token=token)
        assert job.returncode == 0, job.stderr
        assert "user=" not in job.stdout and 'deepnex_node_ready{node="h1"} 1' in job.stdout, token
        prometheus.parse(job.stdout)


def test_ps_all_lists_every_users_containers_for_admins_only(cluster):
    address, _ = cluster
    out = cli(address, "ps", "--all")
    assert out.returncode == 0, out.stderr
    table = [re.split(r"\s{2,}", r) for r in out.stdout.splitlines()]
    assert table[0] == ["USER", "NAME", "NODE", "BACKEND", "STATE", "RESTARTS", "GPU INDICES",
                        "CPUS", "MEMORY LIMIT", "CPU SECONDS", "MEMORY NOW/PEAK", "LAST EXIT"]
    assert [r[:5] for r in table[1:]] == [["alice", "w0", "h1", "process", "running"],
                                          ["bob", "b0", "h2", "process", "running"]]
    assert [r[7:9] for r in table[1:]] == [["0.5", "128MiB"], ["0.5", "128MiB"]]
    # What each uses: CPU seconds, memory now/peak.
    assert all(re.fullmatch(r"\d+\.\d\d", r[9]) and "/" in r[10] for r in table[1:]), table
    denied = cli(address, "ps", "--all", token="alicetok")
    assert (denied.returncode, denied.stdout) == (1, "")
    assert denied.stderr == ("deepnex: user alice cannot list every user's containers: "
                             "that is for admins\n")
    # The same from Python.
    from deepnex import errors
    everyone = client(address, "admintok").containers(all=True)
    assert [(c["user"], c["name"], c["node"]) for c in everyone] == [("alice", "w0", "h1"),
                                                                      ("bob", "b0", "h2")]
    assert [c["name"] for c in client(address, "bobtok").containers()] == ["b0"]
    with pytest.raises(errors.PermissionDeniedError, match="user bob cannot list every user's"):
        client(address, "bobtok").containers(all=True)
    with pytest.raises(errors.InvalidArgumentError, match="user='bob' names one"):
        client(address, "admintok").containers(all=True, user="bob")
    bad = cli(address, "ps", "--all", "--state-dir", "/tmp")
    assert bad.returncode != 0
    assert "--all lists deepnex-central's containers" in bad.stderr


def test_cordon_uncordon_and_drain_release_on_an_agents_node(tmp_path):
    central, address = start_central(tmp_path)
    agents = Agents(tmp_path, address)
    try:
        for node in ("h1", "h2"):
            agents.registered(agents.start(node, f"{node}tok"), node)
        _cordon_uncordon_drain(address)
    finally:
        agents.close()
        central.kill()


def _cordon_uncordon_drain(address):
    from deepnex import gpu
    alice = client(address, "alicetok")
    on_h1 = gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20, node="h1")

    out = cli(address, "node", "cordon", "h1")
    assert (out.returncode, out.stdout) == (0, "node h1: cordoned\n"), out.stderr
    assert status(address) == {"h1": "Cordoned", "h2": "Ready"}
    refused = cli(address, "alloc", "--gpus", "1", "--node", "h1", "--no-wait", token="alicetok")
    assert refused.returncode == 1
    assert cli(address, "node", "uncordon", "h1").returncode == 0
    assert status(address) == {"h1": "Ready", "h2": "Ready"}

    # Two containers on h1: w0 ignores SIGTERM (it says it got it), w1 does not.
    # w0's sleeps run in a subshell that ignores SIGTERM from before it says
    # "up", so none dies of the signal to the group (the shell would print
    # "Terminated"); the shell's trap runs as its `wait` is interrupted.
    stubborn = ("trap 'echo got TERM' TERM; "
                "(trap '' TERM; echo up; while :; do sleep 0.1; done) & "
                "while :; do wait; done")
    for name, command in (("w0", stubborn), ("w1", "echo up; exec sleep 120")):
        a = alice.allocate(on_h1)
        out = cli(address, "launch", "--alloc", a.id, "--name", name, "--", "sh", "-c", command,
                  token="alicetok")
        assert out.returncode == 0, out.stderr
        wait_for(lambda name=name: alice.container_logs(name) == "up\n", f"{name} up")
    on_h2 = alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory=256 << 20,
                                       node="h2"))

    drained = cli(address, "node", "drain", "h1", "--release")
    assert (drained.returncode, drained.stdout) == (
        0, "node h1: drained, its allocations released\n"), drained.stderr
    assert status(address) == {"h1": "Draining", "h2": "Ready"}
    # Through h1's agent: SIGTERM, then SIGKILL after the grace period.
    def stopped():
        c = {c["name"]: c for c in alice.containers()}
        return c if all(x["state"] != "running" for x in c.values()) else None
    ended = wait_for(stopped, "w0 and w1 stopped by the drain", timeout=30)
    assert {n: (c["state"], c["last_exit"], c["node"]) for n, c in ended.items()} == {
        "w0": ("stopped", "signaled(SIGKILL)", "h1"),
        "w1": ("stopped", "signaled(SIGTERM)", "h1")}
    assert alice.container_logs("w0") == "up\ngot TERM\n"
    # Their allocations are released; h2's stays.
    assert [a.id for a in alice.allocations()] == [on_h2.id]
    refused = cli(address, "alloc", "--gpus", "1", "--node", "h1", "--no-wait", token="alicetok")
    assert refused.returncode == 1


def test_usage_and_ps_all_across_simulated_hosts(make_hosts, tmp_path):
    """Central on h1, agents on h2 and h3: alice's container on h2 and bob's
    on h3 show in ps --all and in the metrics with their user and node."""
    import _agents
    _agents.require_binaries()
    c = _agents.AgentHosts(make_hosts({"h1": 11, "h2": 12, "h3": 13}), tmp_path,
                           central_flags=("--user", f"bob={USER_IDS}"))
    try:
        c.start()
        c.launch("h2", "w2", "sleep", "120")
        a = c.allocate("h3", token="bobtok", user="bob")
        out = c.cli("launch", "--alloc", a["id"], "--name", "b3", "--", "sleep", "120",
                    token="bobtok")
        assert out.returncode == 0, out.stderr
        out = c.cli("ps", "--all")
        assert out.returncode == 0, out.stderr
        assert [r.split()[:5] for r in out.stdout.splitlines()] == [
            ["USER", "NAME", "NODE", "BACKEND", "STATE"],
            ["alice", "w2", "h2", "process", "running"],
            ["bob", "b3", "h3", "process", "running"]]
        denied = c.cli("ps", "--all", token="bobtok")
        assert (denied.returncode, denied.stderr) == (
            1, "deepnex: user bob cannot list every user's containers: that is for admins\n")
        text = c.call("admintok", "c.metrics()")
        assert 'deepnex_container_memory_bytes{container="alice.w2",node="h2",user="alice"}' in text
        assert 'deepnex_container_memory_bytes{container="bob.b3",node="h3",user="bob"}' in text
        wait_for(lambda: all(n["memory_in_use"] > 0 and n["gpu_usage"] == []
                             for n in c.nodes().values()), "both nodes' usage")
        usage = c.cli("nodes", "--usage").stdout.splitlines()
        assert [r.split()[0] for r in usage[1:]] == ["h2", "h3"]
        assert all(r.split()[-3] == "-" for r in usage[1:])  # --gpus GPUs: no NVML figures
    finally:
        c.close()
