"""deepnex across simulated hosts (tests/python/_hosts.py): network and UTS
namespaces on a bridge in 10.77.0.0/24, on this one machine. The harness
itself, collectives and the parameter server between hosts, and partitions.
Everything skips without root (the make_hosts fixture says why).

Each test's processes run on its hosts through the harness and die with
them, whether the test passes or fails. There is no delay emulation (no
netem in this kernel): partitions drop packets, so peers see timeouts."""

import os
import re
import select
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import _hosts
from _wait import wait_for

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
PS_BIN = os.path.abspath(os.path.join(BUILD_DIR, "bin", "deepnex-ps"))
STORE_BIN = os.path.abspath(os.path.join(BUILD_DIR, "bin", "deepnex-store"))
PY = sys.executable


def read_line(proc, timeout=30):
    """The next line of proc's stdout, failing the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    line = ""
    while not line.endswith("\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            pytest.fail(f"waited {timeout} s for a line from {proc.args}; got {line!r}")
        chunk = proc.stdout.readline()
        if not chunk:
            pytest.fail(f"{proc.args} exited {proc.wait()} before a line; got {line!r}")
        line += chunk
    return line


def start_daemon(hosts, host, binary, *args, listen=None, advertised=None):
    """binary --listen LISTEN args on host (LISTEN: the host's address, port
    0); (Popen, the address it says it listens on, which starts with
    `advertised`, by default the host's address)."""
    if not os.path.exists(binary):
        pytest.skip(f"{binary} not built")
    listen = listen or f"{hosts.address(host)}:0"
    proc = hosts.popen(host, [binary, "--listen", listen, *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = read_line(proc)
    name = os.path.basename(binary)
    assert line.startswith(f"{name} listening on {advertised or hosts.address(host)}:"), line
    return proc, line.split()[3]


def finish(proc, timeout=90):
    """(exit code, output) of proc; kills it and fails after `timeout` s."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} hung; output:\n{out}")
    return proc.returncode, out


def partition_at_gate(hosts, procs, gate, host):
    """Once every process of procs waits at the gate (process i made
    gate.i) or has exited, cuts `host` off, then opens the gate."""
    wait_for(lambda: all(os.path.exists(f"{gate}.{i}") or p.poll() is not None
                         for i, p in enumerate(procs)), f"every process at the gate {gate}")
    hosts.partition(host)
    open(gate, "w").close()


# ---- the harness

TCP_ECHO = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.bind((sys.argv[1], 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    while True:
        c, peer = s.accept()
        c.sendall(f"{socket.gethostname()} saw {peer[0]}\\n".encode())
        c.close()
""")

DIAL = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
        print(c.makefile().readline().strip())
    except OSError as e:
        print(type(e).__name__)
""")


def dial(hosts, host, target, port, timeout=5.0):
    """What host `host` gets when it dials target:port: the peer's greeting,
    or the name of the error."""
    return hosts.run(host, [PY, "-c", DIAL, target, str(port), str(timeout)],
                     timeout=timeout + 30).stdout.strip()


def test_hosts_have_their_own_names_and_addresses_and_talk_over_tcp(make_hosts):
    hosts = make_hosts({"h1": 11, "h2": 12})
    assert hosts.run("h1", ["hostname"]).stdout == "h1\n"
    assert hosts.run("h2", ["hostname"]).stdout == "h2\n"
    assert hosts.run("h1", ["hostname", "-I"]).stdout.split() == ["10.77.0.11"]
    # Each host's /etc/hosts names every simulated host; the machine's is untouched.
    assert hosts.run("h2", ["getent", "hosts", "h1"]).stdout.split() == ["10.77.0.11", "h1"]
    assert subprocess.run(["getent", "hosts", "h1"], capture_output=True).returncode != 0
    echo = hosts.popen("h2", [PY, "-c", TCP_ECHO, "0.0.0.0"], stdout=subprocess.PIPE, text=True)
    port = int(read_line(echo))
    assert dial(hosts, "h1", "h2", port) == "h2 saw 10.77.0.11"
    assert dial(hosts, "h1", "10.77.0.12", port) == "h2 saw 10.77.0.11"


def test_partition_and_heal_one_host_or_one_link(make_hosts):
    hosts = make_hosts({"h1": 11, "h2": 12, "h3": 13})
    echo = hosts.popen("h2", [PY, "-c", TCP_ECHO, "10.77.0.12"], stdout=subprocess.PIPE,
                       text=True)
    port = int(read_line(echo))
    hosts.partition("h2")
    # Dropped, not refused: the dialer times out.
    assert dial(hosts, "h1", "h2", port, timeout=1) == "TimeoutError"
    assert dial(hosts, "h3", "h2", port, timeout=1) == "TimeoutError"
    # h2's own loopback and its own address still work.
    assert dial(hosts, "h2", "10.77.0.12", port) == "h2 saw 10.77.0.12"
    hosts.heal()
    assert dial(hosts, "h1", "h2", port) == "h2 saw 10.77.0.11"
    hosts.partition("h2", "h1")
    assert dial(hosts, "h1", "h2", port, timeout=1) == "TimeoutError"
    assert dial(hosts, "h3", "h2", port) == "h2 saw 10.77.0.13"
    hosts.heal("h2")
    assert dial(hosts, "h1", "h2", port) == "h2 saw 10.77.0.11"


SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket()
    s.bind((sys.argv[1], 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    n, start = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        start = start or time.monotonic()
        n += len(b)
    print(n / (time.monotonic() - start), flush=True)
""")

SOURCE = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
    buf = b"x" * (1 << 20)
    for _ in range(int(sys.argv[3])):
        c.sendall(buf)
    c.close()
""")


def test_bandwidth_cap_holds_a_link_to_its_rate(make_hosts):
    hosts = make_hosts({"h1": 11, "h2": 12})
    hosts.cap("h1", "200mbit")
    sink = hosts.popen("h2", [PY, "-c", SINK, "10.77.0.12"], stdout=subprocess.PIPE, text=True)
    port = read_line(sink).strip()
    hosts.run("h1", [PY, "-c", SOURCE, "10.77.0.12", port, "12"])
    rate = float(read_line(sink))
    # 200 Mbit/s is 25 MB/s; uncapped, the link moves 600+ MB/s here.
    assert 15e6 < rate < 30e6, rate
    hosts.cap("h1", None)


def test_leftovers_of_a_killed_run_are_removed_and_live_ones_kept(make_hosts):
    live = make_hosts({"h1": 11})
    # `_hosts.py up` hands its hosts to its parent, a shell that then exits:
    # exactly what a killed test run leaves.
    out = subprocess.run(["sh", "-c", f"{PY} {_hosts.__file__} up a=21"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    tag = os.path.basename(out)
    assert os.path.exists(f"/run/netns/{tag}-a")
    removed = _hosts.cleanup_leftovers()
    assert tag in removed and live.tag not in removed
    assert not os.path.exists(f"/run/netns/{tag}-a") and not os.path.exists(out)
    assert subprocess.run(["ip", "link", "show", f"{tag}b"], capture_output=True).returncode != 0
    assert live.run("h1", ["hostname"]).stdout == "h1\n"


# ---- collectives across hosts

RANK = textwrap.dedent("""
    import sys, time, numpy as np, deepnex
    from deepnex import collective
    sys.path.insert(0, TESTS)
    from _exact import DTYPES, OPS, allreduce_case
    store, r, n, prefix, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    comm = collective.Communicator(r, n, store=store, prefix=prefix, timeout=timeout)
    print("transport", comm.transport, flush=True)
    for dtype in DTYPES:
        for op in OPS:
            for size in (0, 1, 7, 1001, 300007):
                inputs, want = allreduce_case(op, dtype, size, n)
                x = inputs[r]
                comm.allreduce(x, op=op)
                np.testing.assert_array_equal(x, want, err_msg=f"{dtype} {op} {size}")
    x = np.full((4, 5), r, np.float32)
    comm.broadcast(x, root=n - 1)
    assert (x == n - 1).all()
    g = comm.allgather(np.full(7, r + 1, np.int64))
    np.testing.assert_array_equal(g[:, 0], np.arange(1, n + 1))
    y = np.arange(2 * n * 2, dtype=np.float64).reshape(2 * n, 2) + r
    out = comm.reduce_scatter(y)
    np.testing.assert_array_equal(out, n * np.arange(4 * n).reshape(2 * n, 2)[2 * r:2 * r + 2] + n * (n - 1) / 2)
    comm.barrier()
    if len(sys.argv) > 6:            # then wait for a partition, and time the failure
        open(sys.argv[6] + f".{r}", "w").close()
        while not __import__("os").path.exists(sys.argv[6]):
            time.sleep(0.01)
        start = time.monotonic()
        try:
            comm.allreduce(np.ones(1 << 20, np.float32))
            print("no error", flush=True)
        except (deepnex.DeadlineExceededError, deepnex.UnavailableError) as e:
            print(f"failed {type(e).__name__} {time.monotonic() - start:.1f} {e}", flush=True)
            sys.exit(3)
    print("ok", flush=True)
""").replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__))))


def start_ranks(hosts, placement, store, prefix, timeout=30, extra=(), private_shm=False):
    """One rank process per entry of placement (the host of rank r)."""
    n = len(placement)
    return [hosts.popen(host, [PY, "-c", RANK, store, str(r), str(n), prefix, str(timeout),
                               *extra],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        private_shm=private_shm)
            for r, host in enumerate(placement)]


def test_collectives_across_three_hosts_are_exact_over_shm_and_tcp(make_hosts):
    """Ranks 0 and 1 on h1 (shared memory between them), rank 2 on h2 (TCP),
    the store on h3."""
    hosts = make_hosts({"h1": 11, "h2": 12, "h3": 13})
    store, store_addr = start_daemon(hosts, "h3", STORE_BIN)
    ranks = start_ranks(hosts, ["h1", "h1", "h2"], store_addr, "x3")
    results = [finish(p) for p in ranks]
    for code, out in results:
        assert code == 0 and out.endswith("ok\n"), out
    transports = [re.search(r"^transport (\S+)", out, re.M).group(1) for _, out in results]
    # The ring 0 -> 1 -> 2 -> 0: only the edge inside h1 is shared memory.
    assert transports == ["shm+tcp", "shm+tcp", "tcp"]


def test_ranks_that_cannot_share_memory_fall_back_to_tcp(make_hosts):
    """Two ranks on one host name whose /dev/shm are private to each (as two
    containers with the same hostname): the shm probe fails and they use
    TCP, with exact results."""
    hosts = make_hosts({"h1": 11, "h2": 12})
    store, store_addr = start_daemon(hosts, "h2", STORE_BIN)
    ranks = start_ranks(hosts, ["h1", "h1"], store_addr, "private", private_shm=True)
    results = [finish(p) for p in ranks]
    for code, out in results:
        assert code == 0 and out.endswith("ok\n"), out
        assert re.search(r"^transport tcp$", out, re.M), out


def test_a_partitioned_rank_fails_every_rank_within_the_timeout(make_hosts, tmp_path):
    hosts = make_hosts({"h1": 11, "h2": 12, "h3": 13})
    store, store_addr = start_daemon(hosts, "h3", STORE_BIN)
    gate = str(tmp_path / "partitioned")
    timeout = 5
    ranks = start_ranks(hosts, ["h1", "h2"], store_addr, "part", timeout=timeout,
                        extra=[gate])
    partition_at_gate(hosts, ranks, gate, "h2")
    for p in ranks:
        code, out = finish(p, timeout=timeout + 30)
        assert code == 3, out
        m = re.search(r"^failed (\S+) ([\d.]+)", out, re.M)
        # Within the collective's timeout (and a margin for a loaded machine).
        assert float(m.group(2)) <= timeout + 3, out


# ---- the parameter server across hosts

WORKER = textwrap.dedent("""
    import os, sys, time, numpy as np, deepnex
    addrs, w, steps, timeout = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    gate, pause_before = (sys.argv[5], int(sys.argv[6])) if len(sys.argv) > 6 else ("", 0)
    c = deepnex.ps.Client(addrs, worker_id=w, partition_bytes=512, timeout=timeout)
    c.init({"w": np.zeros(1000, np.float32)})
    for t in range(1, steps + 1):
        if t == pause_before:        # the test partitions a host here
            open(f"{gate}.{w}", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.01)
        start = time.monotonic()
        try:
            out = c.push_pull({"w": np.full(1000, (w + 1) * t, np.float32)})["w"]
        except deepnex.DeepnexError as e:
            print(f"failed {t} {type(e).__name__} {time.monotonic() - start:.1f} {e}", flush=True)
            sys.exit(3)
        print(f"step {t} {time.monotonic() - start:.1f}", flush=True)
    print("final " + " ".join(str(x) for x in np.unique(out)), flush=True)
    # Bytes each server moved over bulk TCP connections rather than gRPC.
    print("bulk " + " ".join(
        line.split()[1] for st in c.stats() for line in st["prometheus"].splitlines()
        if line.startswith("deepnex_ps_bulk_bytes_total ")), flush=True)
""")


def start_workers(hosts, placement, addrs, steps, timeout=60, gate=None, pause_before=0):
    extra = [gate, str(pause_before)] if gate else []
    return [hosts.popen(host, [PY, "-c", WORKER, ",".join(addrs), str(w), str(steps),
                               str(timeout), *extra],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for w, host in enumerate(placement)]


def final(out):
    return [float(v) for v in re.search(r"^final (.*)$", out, re.M).group(1).split()]


def step_seconds(out, t):
    return float(re.search(rf"^step {t} ([\d.]+)$", out, re.M).group(1))


def failed_in_time(proc, step, timeout):
    """Asserts that the worker proc failed at `step` with DeadlineExceeded or
    Unavailable within its `timeout` (and a margin for a loaded machine);
    returns the error's message."""
    code, out = finish(proc, timeout=timeout + 30)
    assert code == 3, out
    m = re.search(r"^failed (\d+) (\S+) ([\d.]+) (.*)$", out, re.M)
    assert int(m.group(1)) == step, out
    assert m.group(2) in ("DeadlineExceededError", "UnavailableError"), out
    assert float(m.group(3)) <= timeout + 3, out
    return m.group(4)


def test_two_servers_on_two_hosts_and_workers_on_a_third_are_exact(make_hosts):
    hosts = make_hosts({"h1": 11, "h2": 12, "h3": 13})
    servers = [start_daemon(hosts, h, PS_BIN, "--mode", "sync", "--workers", "2",
                            "--optimizer", "sgd", "--lr", "0.5", "--reduction", "sum")
               for h in ("h1", "h2")]
    addrs = [a for _, a in servers]
    assert [a.rsplit(":", 1)[0] for a in addrs] == ["10.77.0.11", "10.77.0.12"]
    steps = 6
    results = [finish(p) for p in start_workers(hosts, ["h3", "h3"], addrs, steps)]
    for code, out in results:
        assert code == 0, out
        # 1000 float32 in 512-byte partitions: 8 of them, over both servers.
        assert final(out) == [-0.5 * sum(3 * t for t in range(1, steps + 1))], out
        # Another host's workers push and pull over each server's bulk port.
        bulk = [float(b) for b in re.search(r"^bulk (.*)$", out, re.M).group(1).split()]
        assert len(bulk) == 2 and all(b > 0 for b in bulk), out


@pytest.mark.parametrize("policy", ["shrink", "abort"])
def test_a_partitioned_worker_host_expires_its_lease_and_never_hangs_the_round(
        make_hosts, tmp_path, policy):
    """Worker 0 on h2, worker 1 on h3, the server on h1; h3 is cut off
    before round k+1. Shrink: the round completes without worker 1 once its
    lease expires, and worker 0 finishes with exact values. Abort: worker 0's
    round fails naming worker 1. Worker 1 fails within its own deadline."""
    hosts = make_hosts({"h1": 11, "h2": 12, "h3": 13})
    lease, k, steps, timeout = 2.0, 3, 6, 8
    _, addr = start_daemon(hosts, "h1", PS_BIN, "--mode", "sync", "--workers", "2",
                           "--optimizer", "sgd", "--lr", "0.5", "--reduction", "sum",
                           "--lease-timeout", str(lease), "--lease-policy", policy)
    gate = str(tmp_path / "partitioned")
    workers = start_workers(hosts, ["h2", "h3"], [addr], steps, timeout=timeout, gate=gate,
                            pause_before=k + 1)
    partition_at_gate(hosts, workers, gate, "h3")
    code, out = finish(workers[0], timeout=timeout + 30)
    # Round k+1 ends once the lease expires (a margin for a loaded machine),
    # well before worker 0's own call deadline.
    if policy == "shrink":
        assert code == 0, out
        # Rounds 1..k from both (1 + 2), k+1.. from worker 0 alone.
        expected = -0.5 * (sum(3 * t for t in range(1, k + 1)) + sum(range(k + 1, steps + 1)))
        assert final(out) == [expected], out
        assert step_seconds(out, k + 1) <= lease + 4, out
    else:
        assert code == 3, out
        m = re.search(r"^failed (\d+) (\S+) ([\d.]+) (.*)$", out, re.M)
        assert (int(m.group(1)), m.group(2)) == (k + 1, "AbortedError"), out
        assert "worker 1" in m.group(4) and float(m.group(3)) <= lease + 4, out
    failed_in_time(workers[1], k + 1, timeout)


def test_workers_of_a_partitioned_server_host_fail_in_time_naming_it(make_hosts, tmp_path):
    hosts = make_hosts({"h1": 11, "h2": 12})
    k, steps, timeout = 2, 5, 5
    _, addr = start_daemon(hosts, "h1", PS_BIN, "--mode", "sync", "--workers", "2",
                           "--optimizer", "sgd", "--lr", "0.5", "--reduction", "sum")
    gate = str(tmp_path / "partitioned")
    workers = start_workers(hosts, ["h2", "h2"], [addr], steps, timeout=timeout, gate=gate,
                            pause_before=k + 1)
    partition_at_gate(hosts, workers, gate, "h1")
    for p in workers:
        message = failed_in_time(p, k + 1, timeout)
        assert addr in message, message


# ---- advertised addresses

STORE_CLIENT = textwrap.dedent("""
    import sys
    from deepnex import collective
    c = collective.StoreClient(sys.argv[1], timeout=10)
    c.set("k", sys.argv[2])
    print(c.get("k").decode())
""")

IN_PROCESS_SERVER = textwrap.dedent("""
    import sys, time
    from deepnex import ps
    s = ps.Server(sys.argv[1], mode="sync", num_workers=1, optimizer=ps.SGD(lr=0.5),
                  reduction="sum", advertise=sys.argv[2] or None)
    print(s.address, flush=True)
    time.sleep(3600)
""")


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0"])
def test_a_daemon_on_the_wildcard_advertises_an_address_other_hosts_dial(make_hosts, listen):
    hosts = make_hosts({"h1": 11, "h2": 12})
    # Its only non-loopback address, not the wildcard.
    _, addr = start_daemon(hosts, "h1", PS_BIN, "--mode", "sync", "--workers", "1",
                           "--optimizer", "sgd", "--lr", "0.5", "--reduction", "sum",
                           listen=listen, advertised="10.77.0.11")
    code, out = finish(start_workers(hosts, ["h2"], [addr], 3)[0])
    assert code == 0 and final(out) == [-0.5 * (1 + 2 + 3)], out
    # Or by name, resolved on the dialing host from its /etc/hosts.
    _, addr = start_daemon(hosts, "h1", STORE_BIN, "--advertise", "h1", listen=listen,
                           advertised="h1")
    assert hosts.run("h2", [PY, "-c", STORE_CLIENT, addr, "v1"]).stdout == "v1\n"


def test_in_process_servers_and_ranks_advertise_what_they_are_told(make_hosts):
    hosts = make_hosts({"h1": 11, "h2": 12, "h3": 13})
    server = hosts.popen("h1", [PY, "-c", IN_PROCESS_SERVER, "0.0.0.0:0", ""],
                         stdout=subprocess.PIPE, text=True)
    addr = read_line(server).strip()
    assert addr.startswith("10.77.0.11:"), addr
    named = hosts.popen("h1", [PY, "-c", IN_PROCESS_SERVER, "0.0.0.0:0", "h1"],
                        stdout=subprocess.PIPE, text=True)
    named_addr = read_line(named).strip()
    assert named_addr.startswith("h1:"), named_addr
    for a in (addr, named_addr):
        code, out = finish(start_workers(hosts, ["h2"], [a], 2)[0])
        assert code == 0 and final(out) == [-0.5 * (1 + 2)], out
    # A rank told its host by name: the others dial it there.
    store, store_addr = start_daemon(hosts, "h3", STORE_BIN)
    ranks = [hosts.popen(h, [PY, "-c", RANK_WITH_HOST, store_addr, str(r), h],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, h in enumerate(["h1", "h2"])]
    for p in ranks:
        code, out = finish(p)
        assert code == 0 and out == "3.0\n", out


RANK_WITH_HOST = textwrap.dedent("""
    import sys, numpy as np
    from deepnex import collective
    comm = collective.Communicator(int(sys.argv[2]), 2, store=sys.argv[1], prefix="named",
                                   timeout=20, host=sys.argv[3])
    x = np.full(1000, comm.rank + 1, np.float32)
    comm.allreduce(x)
    print(np.unique(x)[0])
""")
