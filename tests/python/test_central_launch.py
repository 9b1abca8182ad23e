"""deepnex-central's launcher from Python and the CLI, on the process backend:
containers on the caller's own allocations, released when they end for good."""

import os
import subprocess
import sys
import time

import pytest

import deepnex
from deepnex import gpu, launch

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
CENTRAL_BIN = os.path.join(BUILD_DIR, "bin", "deepnex-central")


@pytest.fixture
def central_process(tmp_path):
    """deepnex-central as a subprocess: (its address, its Popen)."""
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    tokens = tmp_path / "tokens"
    tokens.write_text("admintok root admin\nalicetok alice user\nbobtok bob user\n")
    nodes = tmp_path / "nodes.json"
    nodes.write_text('{"nodes": [{"name": "n1", "cpus": 16, "memory": "64GiB",'
                     ' "mode": "exclusive", "gpus": {"count": 2, "memory": "80GiB"}}]}')
    proc = subprocess.Popen([CENTRAL_BIN, "--listen", "127.0.0.1:0", "--token-file", str(tokens),
                             "--nodes", str(nodes), "--launch-backend", "process",
                             "--launch-state-dir", str(tmp_path / "launch")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("deepnex-central listening on "), line + proc.stderr.read()
    yield line.split()[3], proc
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def central(central_process):
    return central_process[0]


def clients(address):
    return (gpu.CentralClient(address, token="alicetok", timeout=10),
            gpu.CentralClient(address, token="bobtok", timeout=10))


def await_container(client, name, done, timeout=20):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = next((c for c in client.containers() if c["name"] == name), None)
        if last is not None and done(last):
            return last
        time.sleep(0.02)
    pytest.fail(f"container {name}: {last}")


def test_start_list_logs_and_release_at_the_end(central, tmp_path):
    alice, _ = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=1))
    gate = tmp_path / "gate"
    c = alice.start_container(launch.ContainerSpec(
        name="w0", command=["sh", "-c", f"echo hi $CUDA_VISIBLE_DEVICES; "
                                        f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 2"]),
        a)
    assert (c["name"], c["user"], c["allocation"], c["backend"]) == ("w0", "alice", a.id,
                                                                      "process")
    running = await_container(alice, "w0", lambda c: c["state"] == "running")
    assert running["gpus"] == [a.gpus[0].index] and running["restarts"] == 0
    assert [x.id for x in alice.allocations()] == [a.id]
    gate.write_text("")
    ended = await_container(alice, "w0", lambda c: c["allocation_released"])
    assert (ended["state"], ended["last_exit"]) == ("exited", "exited(2)")
    assert alice.container_logs("w0") == f"hi {a.env['CUDA_VISIBLE_DEVICES']}\n"
    assert alice.allocations() == []


def test_stop_releases_and_follow_reads_to_the_end(central):
    alice, _ = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=1))
    alice.start_container(launch.ContainerSpec(name="ps", command=["sleep", "60"]), a.id)
    await_container(alice, "ps", lambda c: c["state"] == "running")
    stopped = alice.stop_container("ps", grace=10)
    assert (stopped["state"], stopped["last_exit"], stopped["allocation_released"]) == (
        "stopped", "signaled(SIGTERM)", True)
    assert alice.allocations() == []
    b = alice.allocate(gpu.Request(user="", gpus=1))
    alice.start_container(launch.ContainerSpec(
        name="w1", command=["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"]), b)
    assert "".join(alice.container_logs("w1", follow=True)) == "1\n2\n3\n"


def test_other_users_allocations_and_containers(central):
    alice, bob = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=1))
    spec = launch.ContainerSpec(name="w0", command=["sleep", "60"])
    with pytest.raises(PermissionError, match=f"user bob cannot start a container on "
                                              f"allocation {a.id}: it belongs to alice"):
        bob.start_container(spec, a.id)
    with pytest.raises(deepnex.NotFoundError, match='"a999" does not exist'):
        alice.start_container(spec, "a999")
    with pytest.raises(deepnex.InvalidArgumentError, match="spec.allocation"):
        alice.start_container(launch.ContainerSpec(name="w0", command=["true"], allocation=a), a)
    alice.start_container(spec, a)
    assert bob.containers() == []
    with pytest.raises(deepnex.NotFoundError, match='no container "w0" of user bob'):
        bob.stop_container("w0")
    with pytest.raises(deepnex.NotFoundError):
        bob.container_logs("w0")
    with pytest.raises(PermissionError):
        bob.containers(user="alice")
    assert [c["state"] for c in alice.containers()] in (["starting"], ["running"])
    alice.stop_container("w0", grace=1)


def run_cli(*args, token="alicetok"):
    env = dict(os.environ, DEEPNEX_TOKEN=token)
    env.pop("DEEPNEX_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "deepnex", *args], env=env, text=True,
                          capture_output=True, timeout=60)


def test_cli_launch_ps_logs_stop(central):
    alice, _ = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=1))
    out = run_cli("launch", "--central", central, "--alloc", a.id, "--name", "w0",
                  "--memory", "64MiB", "--restart", "on-failure:2", "--",
                  "sh", "-c", "echo hello; sleep 60")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"w0 running on {a.id} (process ")
    await_container(alice, "w0", lambda c: c["usage"]["memory"] > 0)
    table = run_cli("ps", "--central", central).stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "BACKEND", "STATE", "RESTARTS"]
    row = table[1].split()
    assert row[:5] == ["w0", "process", "running", "0", str(a.gpus[0].index)]
    assert row[6] == "64MiB"
    assert len(table) == 2
    assert run_cli("ps", "--central", central, token="bobtok").stdout.splitlines()[1:] == []
    logs = run_cli("logs", "w0", "--central", central)
    assert (logs.returncode, logs.stdout) == (0, "hello\n")
    denied = run_cli("stop", "w0", "--central", central, token="bobtok")
    assert denied.returncode == 1 and 'no container "w0" of user bob' in denied.stderr
    out = run_cli("stop", "w0", "--grace", "10", "--central", central)
    assert (out.returncode, out.stdout) == (0, "w0 stopped signaled(SIGTERM), allocation released\n")
    follow = run_cli("logs", "w0", "--follow", "--central", central)
    assert (follow.returncode, follow.stdout) == (0, "hello\n")
    assert alice.allocations() == []
    missing = run_cli("launch", "--central", central, "--alloc", "a999", "--", "true")
    assert missing.returncode == 1 and '"a999" does not exist' in missing.stderr


def memory_bytes(pid, field):
    """VmRSS (now) or VmHWM (the peak since the last reset_peak)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib * 1024


def reset_peak(pid):
    # A whole-log read that is freed again would not show in VmRSS after it.
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def test_a_200mb_log_is_read_by_offset_and_central_stays_small(central_process):
    address, proc = central_process
    alice, _ = clients(address)
    a = alice.allocate(gpu.Request(user="", gpus=1))
    mib = 1 << 20
    written = 200 * mib + len("\nEND\n")
    alice.start_container(launch.ContainerSpec(
        name="big", command=["sh", "-c", "head -c 209715200 /dev/zero | tr '\\0' x; "
                                         "echo; echo END"]), a)
    await_container(alice, "big", lambda c: c["state"] == "exited", timeout=120)
    reset_peak(proc.pid)
    before = memory_bytes(proc.pid, "VmRSS")
    # The default 64 MiB limit keeps the last rotated file and the current
    # one: from 128 MiB on.
    offset, first, sizes, tail, ended = 0, None, [], b"", False
    while not ended:
        data, next_offset, ended = alice._c.logs("big", offset, "")
        if first is None:
            first = next_offset - len(data)
        sizes.append(len(data))
        tail = (tail + data)[-8:]
        offset = next_offset
    growth = memory_bytes(proc.pid, "VmHWM") - before
    assert first == 128 * mib
    assert offset == written
    assert sum(sizes) == written - 128 * mib
    assert max(sizes) == mib
    assert tail == b"xxx\nEND\n"
    assert growth < 64 * mib, f"central grew by {growth} bytes reading the log"


def test_ps_shows_the_restarts_of_a_crash_loop(central):
    alice, _ = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=1))
    out = run_cli("launch", "--central", central, "--alloc", a.id, "--name", "w0",
                  "--restart", "on-failure:1", "--", "sh", "-c", "exit 3")
    assert out.returncode == 0, out.stderr
    # The crash-loop floor: 1 s before the restart.
    ended = await_container(alice, "w0", lambda c: c["state"] == "exited")
    assert (ended["restarts"], ended["last_exit"]) == (1, "exited(3) after 1 restart")
    row = run_cli("ps", "--central", central).stdout.splitlines()[1].split()
    assert row[:4] == ["w0", "process", "exited", "1"]
