"""deepnex.gpu: the allocator from Python, with the issue's surface."""

import threading
import time

import pytest

import deepnex
from _wait import wait_for
from deepnex import gpu

GiB = 1 << 30


def shared_node(name="n1", count=8, memory="80GiB", **kw):
    return gpu.Node(name, gpus=[gpu.Gpu(memory=memory)] * count, cpus=64, memory="512GiB",
                    mode="shared", **kw)


def test_issue_example():
    alloc = deepnex.gpu.Allocator()
    alloc.add_node(deepnex.gpu.Node("n1", gpus=[deepnex.gpu.Gpu(memory="80GiB")] * 8,
                                    cpus=64, memory="512GiB", mode="shared"))
    a = alloc.allocate(deepnex.gpu.Request(user="alice", gpus=2, mode="shared",
                                           gpu_memory="10GiB", cpus=4, memory="16GiB"))
    assert a.id == "a1"
    assert a.node == "n1"
    assert [(g.index, g.uuid, g.memory, g.exclusive) for g in a.gpus] == [
        (0, "GPU-n1-0", 10 * GiB, False), (1, "GPU-n1-1", 10 * GiB, False)]
    assert a.env == {"CUDA_VISIBLE_DEVICES": "0,1",
                     "NVIDIA_VISIBLE_DEVICES": "GPU-n1-0,GPU-n1-1",
                     "DEEPNEX_GPU_MEMORY_LIMIT": str(10 * GiB)}
    assert a.cpus == 4 and a.memory == 16 * GiB
    alloc.release(a.id)
    alloc.release(a.id)  # idempotent
    assert alloc.set_quota("alice", gpus=4, gpu_memory="40GiB", cpus=32, memory="128GiB") == ""
    alloc.set_node_mode("n1", "exclusive")
    alloc.cordon("n1")
    alloc.drain("n1")
    [info] = alloc.nodes()
    assert (info.name, info.mode, info.cordoned, info.draining) == ("n1", "exclusive", True, True)
    assert alloc.allocations(user=None) == []
    alloc.remove_node("n1")
    assert alloc.nodes() == []


def test_exclusive_whole_gpus_and_views():
    alloc = gpu.Allocator()
    alloc.add_node(gpu.Node("x1", gpus=[gpu.Gpu(memory="40GiB")] * 4, cpus=16,
                            memory="64GiB", labels={"gpu": "a100"}))
    a = alloc.allocate(gpu.Request(user="bob", gpus=3, cpus=2, selector={"gpu": "a100"}))
    assert [g.index for g in a.gpus] == [0, 1, 2]
    assert all(g.exclusive and g.memory == 40 * GiB for g in a.gpus)
    assert "DEEPNEX_GPU_MEMORY_LIMIT" not in a.env
    assert [x.id for x in alloc.allocations()] == [a.id]
    assert alloc.allocations(user="alice") == []
    info = alloc.node("x1")
    assert info.gpus_free == 1 and info.cpus_used == 2
    assert info.allocation_ids == [a.id]
    assert alloc.usage("bob") == {"gpus": 3, "gpu_memory": 120 * GiB, "cpus": 2, "memory": 0}
    alloc.check_invariants()


def test_quota_refusal_and_below_use_note():
    alloc = gpu.Allocator()
    alloc.add_node(shared_node())
    alloc.set_quota("alice", gpus=2)
    alloc.allocate(gpu.Request(user="alice", gpus=2, mode="shared", gpu_memory="1GiB"))
    with pytest.raises(deepnex.ResourceExhaustedError,
                       match="quota of alice: gpus 2 in use \\+ 1 requested > quota 2") as e:
        alloc.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="1GiB"))
    assert e.value.code == "RESOURCE_EXHAUSTED"
    note = alloc.set_quota("alice", gpus=1)
    assert "below current use (gpus 2 > 1)" in note
    with pytest.raises(deepnex.ResourceExhaustedError, match="below current use"):
        alloc.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="1GiB"))
    alloc.set_default_quota(cpus=2)
    with pytest.raises(deepnex.ResourceExhaustedError, match="default quota of bob: cpus"):
        alloc.allocate(gpu.Request(user="bob", cpus=3))
    assert alloc.quota("bob")["cpus"] == 2


def test_wait_false_timeout_and_queue():
    alloc = gpu.Allocator()
    alloc.add_node(gpu.Node("n1", gpus=[gpu.Gpu(memory="80GiB")], cpus=4, memory="8GiB"))
    held = alloc.allocate(gpu.Request(user="alice", gpus=1))
    with pytest.raises(deepnex.ResourceExhaustedError, match="wait=false"):
        alloc.allocate(gpu.Request(user="bob", gpus=1), wait=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        alloc.allocate(gpu.Request(user="bob", gpus=1), timeout=0.1)
    assert time.monotonic() - t0 >= 0.1
    got = []
    t = threading.Thread(target=lambda: got.append(
        alloc.allocate(gpu.Request(user="bob", gpus=1), timeout=60)))
    t.start()
    wait_for(lambda: alloc.queue_length() == 1, "bob's request in the queue")
    alloc.release(held.id)  # the waiter holds no GIL while it waits
    t.join(60)
    assert got and got[0].user == "bob"


def test_gang_returns_all_parts_or_nothing():
    alloc = gpu.Allocator()
    alloc.add_node(gpu.Node("n1", gpus=[gpu.Gpu(memory="80GiB")] * 4, cpus=8, memory="64GiB"))
    alloc.add_node(gpu.Node("n2", gpus=[gpu.Gpu(memory="80GiB")] * 4, cpus=8, memory="64GiB"))
    parts = alloc.allocate(gpu.Request(user="alice", gpus=2, replicas=3))
    assert [p.replica for p in parts] == [0, 1, 2] and {p.gang for p in parts} == {"g1"}
    with pytest.raises(deepnex.ResourceExhaustedError):
        alloc.allocate(gpu.Request(user="alice", gpus=2, replicas=2), wait=False)
    assert len(alloc.allocations()) == 3
    alloc.release("g1")
    assert alloc.allocations() == []


def test_mode_switch_policies():
    alloc = gpu.Allocator()
    alloc.add_node(shared_node(count=2))
    a = alloc.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="8GiB"))
    with pytest.raises(deepnex.FailedPreconditionError, match="holds shared allocations a1"):
        alloc.set_node_mode("n1", "exclusive")
    alloc.set_node_mode("n1", "exclusive", when_drained=True)
    assert alloc.node("n1").pending_mode == "exclusive"
    alloc.release(a.id)
    info = alloc.node("n1")
    assert (info.mode, info.pending_mode) == ("exclusive", None)


def test_lease_expires_unless_renewed():
    alloc = gpu.Allocator(lease_check_interval=0.01)
    alloc.add_node(shared_node())
    a = alloc.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="1GiB",
                                   lease=1.0))
    assert a.lease == 1.0 and a.expires_at > time.time()
    for _ in range(3):
        time.sleep(0.1)
        alloc.renew(a.id)
    deadline = time.monotonic() + 10
    while alloc.allocations() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alloc.allocations() == []
    with pytest.raises(KeyError):
        alloc.renew(a.id)


def test_persistent_state_survives_restart(tmp_path):
    alloc = gpu.Allocator(state_dir=str(tmp_path))
    alloc.add_node(shared_node())
    a = alloc.allocate(gpu.Request(user="alice", gpus=2, mode="shared", gpu_memory="10GiB"))
    alloc.set_quota("alice", gpus=4)
    digest = alloc._digest()
    with pytest.raises(deepnex.FailedPreconditionError, match="in use"):
        gpu.Allocator(state_dir=str(tmp_path))
    del alloc
    again = gpu.Allocator(state_dir=str(tmp_path))
    assert again._digest() == digest
    assert [x.id for x in again.allocations(user="alice")] == [a.id]
    assert again.quota("alice")["gpus"] == 4


@pytest.mark.parametrize("make, error, match", [
    (lambda: gpu.Request(user="u", gpus=-1), ValueError, "gpus=-1"),
    (lambda: gpu.Request(user="u", gpus=1, cpus=-2), ValueError, "cpus=-2"),
    (lambda: gpu.Request(user="u", gpus=1, mode="shared", gpu_memory=-5), ValueError,
     "gpu_memory=-5"),
    (lambda: gpu.Request(user="u", gpus=1, mode="shared", gpu_memory="10XB"), ValueError,
     "gpu_memory.*10XB"),
    (lambda: gpu.Request(user="u", gpus=1, mode="shared", gpu_memory=0), ValueError,
     "gpu_memory=0B"),
    (lambda: gpu.Request(user="u", gpus=1, mode="fast"), ValueError, "mode.*fast"),
    (lambda: gpu.Request(user="u", gpus=1, mode="shared", gpu_memory="100GiB"), ValueError,
     "gpu_memory=100GiB is larger than any GPU"),
    (lambda: gpu.Request(user="u", gpus=1, node="nope"), KeyError, "nope"),
    (lambda: gpu.Request(user="u", gpus=1, selector={"gpu": "tpu"}), KeyError, "gpu=tpu"),
    (lambda: gpu.Request(user="u", gpus=1, mode="exclusive"), deepnex.FailedPreconditionError,
     "needs an exclusive node"),
])
def test_bad_requests_change_nothing(make, error, match):
    alloc = gpu.Allocator()
    alloc.add_node(shared_node())
    alloc.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="1GiB"))
    before = alloc._digest()
    with pytest.raises(error, match=match):
        alloc.allocate(make())
    assert alloc._digest() == before


def test_bad_nodes_change_nothing():
    alloc = gpu.Allocator()
    alloc.add_node(shared_node())
    before = alloc._digest()
    with pytest.raises(deepnex.AlreadyExistsError, match="node n1 already exists"):
        alloc.add_node(shared_node())
    with pytest.raises(ValueError, match=r"gpus\[0\].memory=0"):
        alloc.add_node(gpu.Node("n2", gpus=[gpu.Gpu(memory=0)], cpus=1, memory="1GiB"))
    with pytest.raises(ValueError, match="cpus=0"):
        alloc.add_node(gpu.Node("n2", gpus=[], cpus=0, memory="1GiB"))
    with pytest.raises(ValueError, match="memory=-1"):
        alloc.add_node(gpu.Node("n2", gpus=[], cpus=1, memory=-1))
    with pytest.raises(KeyError, match="nope"):
        alloc.cordon("nope")
    with pytest.raises(ValueError, match="gpus=-1"):
        alloc.set_quota("alice", gpus=-1)
    assert alloc._digest() == before


def test_discovery_and_node_files(tmp_path):
    found = gpu.discover()
    assert isinstance(found["summary"], str)
    assert gpu.discover("libnot-nvml.so")["summary"] == "0 GPUs (NVML not found)"
    here = gpu.local_node("here")
    assert here.name == "here" and here.cpus > 0
    path = tmp_path / "nodes.json"
    path.write_text('{"nodes": [{"name": "a", "cpus": 8, "memory": "32GiB", "mode": "shared",'
                    ' "gpus": {"count": 2, "memory": "24GiB"}}]}')
    [node] = gpu.load_nodes(path)
    assert (node.name, node.mode, len(node.gpus), node.gpus[0].memory) == ("a", "shared", 2,
                                                                          24 * GiB)
    alloc = gpu.Allocator()
    alloc.add_node(node)
    path.write_text('{"nodes": [\n  {"name": "a",\n   "cpus": }\n]}')
    with pytest.raises(ValueError, match="nodes.json: line 3"):
        gpu.load_nodes(path)
    with pytest.raises(ValueError, match=r"nodes\[0\].gpus.memory"):
        gpu.parse_nodes('{"nodes": [{"name": "a", "cpus": 1, "memory": 1,'
                        ' "gpus": {"count": 1, "memory": "1XB"}}]}')


# ---- deepnex-central: the daemon, CentralClient and the CLI

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
CENTRAL_BIN = os.path.join(BUILD_DIR, "bin", "deepnex-central")


@pytest.fixture
def central(tmp_path):
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    tokens = tmp_path / "tokens"
    tokens.write_text("admintok root admin\nalicetok alice user\nbobtok bob user\n")
    nodes = tmp_path / "nodes.json"
    nodes.write_text('{"nodes": [{"name": "n1", "cpus": 16, "memory": "64GiB", "mode": "shared",'
                     ' "gpus": {"count": 2, "memory": "80GiB"}}]}')
    proc = subprocess.Popen([CENTRAL_BIN, "--listen", "127.0.0.1:0", "--token-file", str(tokens),
                             "--nodes", str(nodes), "--state-dir", str(tmp_path / "state")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("deepnex-central listening on "), line + proc.stderr.read()
    yield line.split()[3]
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_central_client_same_surface_and_ownership(central):
    admin = gpu.CentralClient(central, token="admintok")
    alice = gpu.CentralClient(central, token="alicetok")
    bob = gpu.CentralClient(central, token="bobtok")
    a = alice.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="10GiB",
                                   cpus=2))
    assert a.user == "alice" and a.env["DEEPNEX_GPU_MEMORY_LIMIT"] == str(10 * GiB)
    with pytest.raises(PermissionError, match="user bob cannot release a1: it belongs to alice"):
        bob.release(a.id)
    assert bob.allocations() == []
    assert [x.id for x in alice.allocations()] == [a.id]
    with pytest.raises(deepnex.PermissionDeniedError):
        alice.set_node_mode("n1", "exclusive")
    with pytest.raises(deepnex.FailedPreconditionError, match="holds shared allocations a1"):
        admin.set_node_mode("n1", "exclusive")
    admin.set_quota("bob", gpus=0)
    with pytest.raises(deepnex.ResourceExhaustedError, match="quota of bob"):
        bob.allocate(gpu.Request(user="bob", gpus=1, mode="shared", gpu_memory="1GiB"))
    alice.release(a.id)
    alice.release(a.id)
    assert "deepnex_grants_total 1" in admin.metrics()
    [n] = admin.nodes()
    assert (n.name, n.mode, n.gpus_free) == ("n1", "shared", 2)


def run_cli(*args, central, token="admintok"):
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "deepnex", *args], env=env, text=True,
                          capture_output=True, timeout=60)


def test_cli_against_central(central):
    out = run_cli("alloc", "--gpus", "2", "--mode", "shared", "--gpu-memory", "10GiB",
                  central=central, token="alicetok")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("a1 user=alice node=n1 gpus=[0:10GiB shared, 1:10GiB shared]")
    assert "CUDA_VISIBLE_DEVICES=0,1" in out.stdout
    table = run_cli("nodes", central=central)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "MODE", "STATE"]
    assert lines[1].split()[:4] == ["n1", "shared", "ready", "2/2"]
    denied = run_cli("release", "a1", central=central, token="bobtok")
    assert denied.returncode == 1 and "cannot release a1" in denied.stderr
    assert run_cli("release", "a1", central=central, token="alicetok").returncode == 0
    out = run_cli("quota", "alice", "--gpus", "4", central=central)
    assert out.returncode == 0 and "quota of alice set" in out.stdout
    assert run_cli("node", "mode", "n1", "exclusive", central=central).returncode == 0
    assert run_cli("node", "cordon", "n1", central=central).returncode == 0
    assert "cordoned" in run_cli("nodes", central=central).stdout
    metrics = run_cli("metrics", central=central)
    assert "deepnex_queue_length 0" in metrics.stdout


def test_central_gang_and_lease(central):
    alice = gpu.CentralClient(central, token="alicetok")
    parts = alice.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="1GiB",
                                       replicas=2))
    assert [p.replica for p in parts] == [0, 1] and parts[0].gang == parts[1].gang
    alice.release(parts[0].gang)
    assert alice.allocations() == []
    a = alice.allocate(gpu.Request(user="alice", gpus=1, mode="shared", gpu_memory="1GiB",
                                   lease=30))
    renewed = alice.renew(a.id)
    assert renewed.expires_at >= a.expires_at
    with pytest.raises(TimeoutError):
        alice.allocate(gpu.Request(user="alice", gpus=2, mode="shared", gpu_memory="80GiB"),
                       timeout=0.1)
