"""The parameter server's same-host shared-memory path across processes: a
worker killed -9 in the middle of a push leaves no segment behind and the
server keeps serving the other worker; forcing TCP by the environment; the
transport and shm_bytes keywords."""

import gc
import os
import signal
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import _prometheus as prometheus
from _wait import wait_for
from deepnex import ps
from deepnex.errors import InvalidArgumentError
from test_ps_faults import start_daemon

N = 1 << 20  # 4 MiB of float32: a push spans several requests and regions


def segments(pid):
    """The server's shared-memory segments: (fd path, mode) of each memfd."""
    found = []
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        path = os.path.join(fd_dir, fd)
        try:
            if os.readlink(path).startswith("/memfd:deepnex-ps"):
                found.append((path, stat.S_IMODE(os.stat(path).st_mode)))
        except FileNotFoundError:  # closed while listing
            pass
    return found


def mapped_segments(pid):
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:deepnex-ps" in line for line in f)


def dev_shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


PUSHER = textwrap.dedent("""
    import sys, numpy as np
    from deepnex import ps
    c = ps.Client([sys.argv[1]], worker_id=1, timeout=120)
    c.init({"w": np.zeros(int(sys.argv[2]), np.float32)})
    print("pushing", flush=True)
    # Round 1 waits for worker 0, which is not pushing: killed in the call.
    c.push_pull({"w": np.ones(int(sys.argv[2]), np.float32)})
    print("returned", flush=True)
""")


def test_worker_killed_mid_push_leaves_no_segment_and_the_other_keeps_training():
    shm_before = dev_shm()
    server = start_daemon("--listen", "127.0.0.1:0", "--mode", "sync", "--workers", "2",
                          "--lease-timeout", "1", "--optimizer", "sgd", "--lr", "1",
                          "--reduction", "sum")
    pusher = None
    client = None
    try:
        pusher = subprocess.Popen([sys.executable, "-c", PUSHER, server.address, str(N)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={k: v for k, v in os.environ.items()
                                       if k != "DEEPNEX_PS_TRANSPORT"})
        assert pusher.stdout.readline().strip() == "pushing"
        client = ps.Client([server.address], worker_id=0, timeout=120)
        client.init({"w": np.zeros(N, np.float32)})
        # One segment per worker, readable by the server's uid only.
        segs = wait_for(lambda: len(segments(server.pid)) == 2 and segments(server.pid),
                        "a segment for each worker")
        assert [mode for _, mode in segs] == [0o600, 0o600]
        # Worker 1's push is applied (round 1 waits for worker 0's).
        wait_for(lambda: client.stats()[0]["pushes"] == 1, "worker 1's push")
        pusher.send_signal(signal.SIGKILL)
        pusher.wait(timeout=30)
        # Its lease expires; its segment goes with it.
        wait_for(lambda: len(segments(server.pid)) == 1, "worker 1's segment to go")
        # The server still serves worker 0: round 1 (worker 1's push kept)
        # and rounds without it.
        out = client.push_pull({"w": np.full(N, 2, np.float32)})["w"]
        np.testing.assert_array_equal(out, np.full(N, -3, np.float32))
        for step in range(2, 4):
            out = client.push_pull({"w": np.full(N, step, np.float32)})["w"]
        np.testing.assert_array_equal(out, np.full(N, -8, np.float32))
        client.close()
        client = None
        wait_for(lambda: not segments(server.pid) and mapped_segments(server.pid) == 0,
                 "the server to let go of every segment")
        assert dev_shm() == shm_before
    finally:
        if client is not None:
            client.close()
        if pusher is not None and pusher.poll() is None:
            pusher.kill()
            pusher.wait()
        server.kill()
        server.wait()


def test_forcing_tcp_by_the_environment_maps_no_segment():
    server = start_daemon("--listen", "127.0.0.1:0", "--mode", "async", "--workers", "1",
                          "--lr", "0.5")
    try:
        code = textwrap.dedent("""
            import sys, numpy as np
            from deepnex import ps
            c = ps.Client([sys.argv[1]], worker_id=0)
            c.init({"v": np.zeros(1024, np.float32)})
            out = c.push_pull({"v": np.ones(1024, np.float32)})["v"]
            print(float(out[0]), flush=True)
            input()  # holds the client open while the test looks
            c.close()
        """)
        proc = subprocess.Popen([sys.executable, "-c", code, server.address],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "DEEPNEX_PS_TRANSPORT": "tcp"})
        assert proc.stdout.readline().strip() == "-0.5"  # sgd, lr 0.5
        assert segments(server.pid) == []
        proc.communicate("\n", timeout=60)
        assert proc.returncode == 0
    finally:
        server.kill()
        server.wait()


def test_transport_keyword_chooses_tcp_or_shared_memory(monkeypatch):
    monkeypatch.delenv("DEEPNEX_PS_TRANSPORT", raising=False)
    # Earlier tests' clients that only the garbage collector frees (held in
    # a traceback's frames) still map their segments in this process.
    gc.collect()
    mapped = mapped_segments(os.getpid())
    server = start_daemon("--listen", "127.0.0.1:0", "--mode", "async", "--workers", "1",
                          "--lr", "0.5")
    try:
        with ps.Client([server.address], worker_id=0, transport="tcp") as c:
            c.init({"v": np.zeros(1024, np.float32)})
            out = c.push_pull({"v": np.ones(1024, np.float32)})["v"]
            np.testing.assert_array_equal(out, np.full(1024, -0.5, np.float32))
            assert segments(server.pid) == []
            assert mapped_segments(os.getpid()) == mapped
        with ps.Client([server.address], worker_id=0, transport="shm",
                       shm_bytes="64KiB") as c:
            out = c.push_pull({"v": np.ones(1024, np.float32)})["v"]
            np.testing.assert_array_equal(out, np.full(1024, -1.0, np.float32))
            assert [mode for _, mode in segments(server.pid)] == [0o600]
            assert mapped_segments(os.getpid()) == mapped + 1
        wait_for(lambda: not segments(server.pid), "the server to let go of the segment")
        # The environment still wins over the keyword.
        monkeypatch.setenv("DEEPNEX_PS_TRANSPORT", "tcp")
        with ps.Client([server.address], worker_id=0, transport="shm") as c:
            c.pull(["v"])
            assert segments(server.pid) == []
            assert mapped_segments(os.getpid()) == mapped
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("bulk_tcp", [True, False])
def test_tcp_clients_move_values_on_the_bulk_connection_unless_it_is_off(bulk_tcp):
    server = ps.Server("127.0.0.1:0", mode="async", num_workers=1, optimizer=ps.SGD(lr=0.5),
                       bulk_tcp=bulk_tcp)
    try:
        with ps.Client([server.address], worker_id=0, transport="tcp") as c:
            c.init({"v": np.zeros(N, np.float32)})
            out = c.push_pull({"v": np.full(N, 2.0, np.float32)})["v"]
            # 4 MiB: several requests, each reply read straight into `out`.
            np.testing.assert_array_equal(out, np.full(N, -1.0, np.float32))
            text = server.metrics_text()
            assert prometheus.value(text, "deepnex_ps_bulk_connections") == (1 if bulk_tcp else 0)
            moved = prometheus.value(text, "deepnex_ps_bulk_bytes_total")
            assert (moved >= 2 * 4 * N) if bulk_tcp else (moved == 0), moved
    finally:
        server.stop()


@pytest.mark.parametrize("kwargs, message", [
    ({"transport": "carrier-pigeon"},
     'transport "carrier-pigeon": must be auto, tcp or shm'),
    ({"transport": None}, 'transport "None": must be auto, tcp or shm'),
    ({"shm_bytes": -1}, "shm_bytes=-1: must be >= 0"),
    ({"shm_bytes": "lots"}, "shm_bytes"),
    ({"transport": "shm", "shm_bytes": 32},
     "shm_bytes=32: transport=shm needs a segment of at least 64 bytes"),
    ({"transport": "shm", "shm_bytes": 0},
     "shm_bytes=0: transport=shm needs a segment of at least 64 bytes"),
])
def test_bad_transport_or_shm_bytes_raise_naming_them(kwargs, message):
    with pytest.raises(InvalidArgumentError) as e:
        ps.Client(["127.0.0.1:1"], **kwargs)
    assert message in str(e.value)
