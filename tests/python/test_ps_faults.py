"""The parameter server under faults: dead and rejoining workers, bounded
staleness, lost replies, server crashes with checkpoints, and metrics."""

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest

import deepnex
import _prometheus as prometheus
from _wait import run_threads, wait_for
from deepnex import ps

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
PS_BIN = os.path.join(BUILD_DIR, "bin", "deepnex-ps")
N = 64  # elements per tensor


def g(worker, step):
    """Integer-valued gradients: sums of them are exact in float32."""
    return np.full(N, (worker + 1) * (step % 7 + 1), np.float32)


def run_fns(fns, timeout=120):
    """Runs each of `fns` on its own thread; re-raises the first failure."""
    run_threads(len(fns), lambda i: fns[i](), timeout=timeout, what="a worker thread")


# ---- a worker process that can die, and one that rejoins

WORKER = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, deepnex
    addr, w, steps, die_after, gate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    def g(worker, step):
        return np.full(64, (worker + 1) * (step % 7 + 1), np.float32)
    c = deepnex.ps.Client([addr], worker_id=w, timeout=60)
    c.init({"w": np.zeros(64, np.float32)})
    first = c.version("w") + 1           # a rejoining worker catches up
    print(f"joined {first} {time.time()}", flush=True)
    if gate != "-" and w == 2:
        open(gate, "w").close()          # tell the others it is registered
    for t in range(first, steps + 1):
        try:
            out = c.push_pull({"w": g(w, t)})["w"]
        except deepnex.AbortedError as e:
            print(f"aborted {t} {time.time()} {e}", flush=True)
            sys.exit(3)
        print(f"step {t} {time.time()}", flush=True)
        if t == die_after:
            print(f"dying {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if gate != "-" and w != 2 and t == int(os.environ.get("GATE_AFTER", "0")):
            deadline = time.time() + 60
            while not os.path.exists(gate) and time.time() < deadline:
                time.sleep(0.01)
    c.close()
    print("final " + " ".join(str(x) for x in out[:4]), flush=True)
""")


def spawn(addr, w, steps, die_after=-1, gate="-", env=None):
    return subprocess.Popen([sys.executable, "-c", WORKER, addr, str(w), str(steps),
                             str(die_after), gate],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail("worker hung:\n" + out)
    return proc.returncode, out


def times(out, word):
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(rf"^{word} (\d+) ([\d.]+)", out, re.M)}


def test_dead_worker_shrinks_the_round_and_rejoins_with_exact_values(tmp_path):
    lease, k, steps = 1.5, 3, 8
    gate = str(tmp_path / "rejoined")
    with ps.Server(mode="sync", num_workers=3, optimizer=ps.SGD(lr=0.5), reduction="sum",
                   lease_timeout=lease, lease_policy="shrink") as server:
        env = {"GATE_AFTER": str(k + 1)}
        others = [spawn(server.address, w, steps, gate=gate, env=env) for w in (0, 1)]
        victim = spawn(server.address, 2, steps, die_after=k)
        code, vout = finish(victim)
        assert code == -signal.SIGKILL, vout
        died = float(re.search(r"^dying ([\d.]+)", vout, re.M).group(1))
        # The others complete round k+1 without worker 2 once its lease expires.
        wait_for(lambda: server_version(server) >= k + 1, f"round {k + 1} without worker 2")
        rejoined = spawn(server.address, 2, steps, gate=gate)
        results = [finish(p) for p in others + [rejoined]]
        for code, out in results:
            assert code == 0, out
        step_times = times(results[0][1], "step")
        assert step_times[k + 1] - died < lease + 1.0, (step_times, died)
        first = int(re.search(r"^joined (\d+)", results[2][1], re.M).group(1))
        assert first > k + 1
        stats = ps.Client([server.address], worker_id=-1).stats()[0]
        assert stats["lease_expiries"] >= 1
    # Rounds 1..steps from workers 0 and 1, 1..k and first..steps from worker 2.
    total = sum(g(w, t) for w in (0, 1) for t in range(1, steps + 1))
    total += sum(g(2, t) for t in list(range(1, k + 1)) + list(range(first, steps + 1)))
    expected = -0.5 * total
    for code, out in results:
        final = np.array(re.search(r"^final (.*)$", out, re.M).group(1).split(), np.float32)
        np.testing.assert_array_equal(final, expected[:4])


def server_version(server):
    with ps.Client([server.address], worker_id=-1) as c:
        return c.stats()[0]["min_version"]


def test_dead_worker_aborts_the_round_under_abort_policy():
    lease, k = 1.0, 2
    with ps.Server(mode="sync", num_workers=3, optimizer=ps.SGD(lr=0.5),
                   lease_timeout=lease, heartbeat_interval=0.1,
                   lease_policy="abort") as server:
        others = [spawn(server.address, w, 10) for w in (0, 1)]
        victim = spawn(server.address, 2, 10, die_after=k)
        code, vout = finish(victim)
        died = float(re.search(r"^dying ([\d.]+)", vout, re.M).group(1))
        for p in others:
            code, out = finish(p)
            assert code == 3, out
            m = re.search(r"^aborted (\d+) ([\d.]+) (.*)$", out, re.M)
            assert int(m.group(1)) == k + 1
            assert "worker 2" in m.group(3)
            assert float(m.group(2)) - died < lease + 1.0


def test_calls_after_an_aborted_round_fail_at_once_naming_the_dead_worker():
    """Under lease_policy="abort" a probe's next push after the round was
    aborted waited out the client's whole timeout (60 s), then named no one;
    so did every later call. They now fail at once, naming the worker."""
    with ps.Server(mode="sync", num_workers=2, lease_timeout=1.0, heartbeat_interval=0.1,
                   lease_policy="abort") as server, \
            ps.Client([server.address], worker_id=0, timeout=30) as c:
        c.init({"w": np.zeros(N, np.float32)})
        victim = spawn(server.address, 1, 10, die_after=1)
        round1 = c.push_pull({"w": g(0, 1)})["w"]  # with the victim
        code, out = finish(victim)
        assert code == -signal.SIGKILL, out
        with pytest.raises(deepnex.AbortedError, match="worker 1's lease expired"):
            c.push_pull({"w": g(0, 2)})
        for call in (lambda: c.push({"w": g(0, 3)}), lambda: c.push_pull({"w": g(0, 3)})):
            start = time.monotonic()
            with pytest.raises(deepnex.AbortedError, match="worker 1's lease expired"):
                call()
            assert time.monotonic() - start < 10
        # A pull reads the last round that completed.
        np.testing.assert_array_equal(c.pull("w")["w"], round1)


def test_a_sync_pull_that_times_out_names_the_workers_the_round_waits_for():
    """A probe's pull waiting on a worker that never pushed said only
    "pull to ADDR: Deadline Exceeded"."""
    with ps.Server(mode="sync", num_workers=3) as server, \
            ps.Client([server.address], worker_id=0, timeout=1) as c0, \
            ps.Client([server.address], worker_id=2, timeout=1) as c2:
        for c in (c0, c2):
            c.init({"w": np.zeros(4, np.float32)})
            c.push({"w": np.ones(4, np.float32)})
        with pytest.raises(deepnex.DeadlineExceededError) as e:
            c0.pull(["w"])
        assert str(e.value) == (f"pull to {server.address}: Deadline Exceeded; the round waits "
                                "for worker 1 (not pushed to it yet)")
        # Once it comes, the round completes.
        with ps.Client([server.address], worker_id=1) as c1:
            c1.push({"w": np.ones(4, np.float32)})
        np.testing.assert_array_equal(c0.pull(["w"])["w"], np.full(4, -0.01, np.float32))


@pytest.mark.parametrize("mode, staleness, pushes, pull, awaited", [
    # Worker 1 pushed "b" only, worker 2 both: the round of "a" waits for
    # worker 1 alone, though it pushed as often as worker 0 (named nobody).
    ("sync", 0, [(0, "a"), (1, "b"), (2, "a"), (2, "b")], ["a"], "1"),
    # Staleness 1: worker 0's pull after 3 rounds needs round 2, which
    # worker 2 has pushed (it was named, being behind worker 0). Pushed in
    # an order in which no push waits for a round.
    ("ssp", 1, [(1, "a"), (2, "a"), (2, "a"), (0, "a"), (0, "a"), (0, "a")], ["a"], "1"),
    # "b"'s round is complete: it waits for nobody (it named worker 1 too,
    # the next round of "b" lacking everyone; probe of 0ca5721).
    ("sync", 0, [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "b")], ["a", "b"], "2"),
])
def test_a_timed_out_pull_names_only_the_workers_its_keys_round_waits_for(mode, staleness,
                                                                          pushes, pull, awaited):
    """Counting each worker's pushes over all keys named the wrong workers
    (probe)."""
    with ps.Server(mode=mode, staleness=staleness, num_workers=3) as server:
        clients = [ps.Client([server.address], worker_id=w, timeout=1) for w in range(3)]
        try:
            clients[0].init({k: np.zeros(4, np.float32) for k in "ab"})
            for w, k in pushes:
                clients[w].push({k: np.ones(4, np.float32)})
            with pytest.raises(deepnex.DeadlineExceededError) as e:
                clients[0].pull(pull)
            assert str(e.value) == (f"pull to {server.address}: Deadline Exceeded; the round "
                                    f"waits for worker {awaited} (not pushed to it yet)")
        finally:
            for c in clients:
                c.close()


@pytest.mark.parametrize("mode, staleness, ahead", [("sync", 0, 1), ("ssp", 1, 2)])
def test_a_timed_out_push_names_the_workers_its_round_waits_for(mode, staleness, ahead):
    """A push past the rounds the mode lets a worker lead by waits for the
    others; its timeout named nobody, and a pull after it did not count
    the round that push waits on (its seq not yet taken)."""
    with ps.Server(mode=mode, staleness=staleness, num_workers=3) as server:
        clients = [ps.Client([server.address], worker_id=w, timeout=1) for w in range(3)]
        try:
            clients[0].init({"w": np.zeros(4, np.float32)})
            clients[1].push({"w": np.ones(4, np.float32)})  # worker 2 pushes nothing
            for _ in range(ahead):
                clients[0].push({"w": np.ones(4, np.float32)})
            with pytest.raises(deepnex.DeadlineExceededError) as e:
                clients[0].push({"w": np.ones(4, np.float32)})
            assert str(e.value).startswith(f"push to {server.address}: Deadline Exceeded; ")
            assert str(e.value).endswith("; the round waits for worker 2 (not pushed to it yet)")
            # Once worker 2 pushes, the push that timed out goes again and is taken.
            clients[2].push({"w": np.ones(4, np.float32)})
            clients[0].close()
        finally:
            for c in clients:
                c.close()


def test_ssp_bounds_the_lead_of_fast_workers_and_values_stay_exact():
    workers, steps, s = 3, 24, 2
    with ps.Server(mode="ssp", staleness=s, num_workers=workers, optimizer=ps.SGD(lr=0.25),
                   reduction="sum") as server:
        finals = [None] * workers
        pulled = [0] * workers  # the last round each worker pulled
        progress = threading.Condition()

        def worker(w):
            def run():
                with ps.Client([server.address], worker_id=w) as c:
                    c.init({"w": np.zeros(N, np.float32)})
                    for t in range(1, steps + 1):
                        if w == 0:
                            # The slow one: it pushes round t once the others pulled
                            # theirs, a round ahead of it (a sleep would not say so).
                            with progress:
                                assert progress.wait_for(lambda: min(pulled[1:]) >= t, 60), \
                                    f"workers 1 and 2 did not pull round {t}: {pulled}"
                        c.push({"w": g(w, t)})
                        finals[w] = c.pull("w")["w"]
                        with progress:
                            pulled[w] = t
                            progress.notify_all()
                    # Bounded staleness: only the slowest sees the last round.
            return run

        run_fns([worker(w) for w in range(workers)])
        with ps.Client([server.address], worker_id=-1) as c:
            stats = c.stats()[0]
            final = c.pull("w")["w"]
    leads = {ws["worker"]: ws["max_lead"] for ws in stats["workers"]}
    assert all(lead <= s for lead in leads.values()), leads
    assert leads[1] >= 1 and leads[2] >= 1, leads  # the fast ones ran ahead
    total = sum(g(w, t) for w in range(workers) for t in range(1, steps + 1))
    np.testing.assert_array_equal(final, -0.25 * total)
    np.testing.assert_array_equal(finals[0], -0.25 * total)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_push_whose_reply_is_lost_is_applied_once(mode):
    with ps.Server(mode=mode, optimizer=ps.SGD(lr=1.0), _drop_push_replies=1) as server, \
            ps.Client([server.address]) as c:
        c.init({"w": np.zeros(N, np.float32)})
        c.push({"w": g(0, 1)})          # applied; the reply is lost; the retry is a no-op
        np.testing.assert_array_equal(c.pull("w")["w"], -g(0, 1))
        c.push({"w": g(0, 2)})
        np.testing.assert_array_equal(c.pull("w")["w"], -g(0, 1) - g(0, 2))
        assert c.stats()[0]["pushes"] == 3  # the lost one, its retry, the next


def test_a_push_retried_across_a_server_restart_is_applied_once(tmp_path):
    """The push is applied and checkpointed, its reply is lost and the server
    restarts from the checkpoint; the client's retry is recognised."""
    opts = dict(mode="async", optimizer=ps.SGD(lr=1.0))
    server = ps.Server(_drop_push_replies=1, **opts)
    address = server.address
    try:
        c = ps.Client([address], retry_backoff=2.0, timeout=30)
        c.init({"w": np.zeros(N, np.float32)})
        pending = c.push_async({"w": g(0, 1)})
        with ps.Client([address], worker_id=-1) as observer:
            wait_for(lambda: observer.stats()[0]["pushes"] >= 1, "the push to reach the server")
        server.checkpoint(tmp_path)  # holds the push, whose reply was lost
        server.stop()
        server = ps.Server(address=address, restore=tmp_path, **opts)
        pending.wait(timeout=30)     # the retry, to the restored server
        np.testing.assert_array_equal(c.pull("w")["w"], -g(0, 1))
        c.close()
    finally:
        server.stop()


def test_a_client_reconnects_at_once_to_a_server_back_after_an_outage(tmp_path):
    """After a server was down a few seconds, gRPC waited up to 2.4 s before
    it tried to connect again, and every call until then failed at once
    with "failed to connect": a client with a 1 s timeout failed against a
    server already back (about half the time; CI's 2 s client, once). Its
    retries now connect at once."""
    opts = dict(mode="async", optimizer=ps.Sum(), reduction="sum")
    server = ps.Server(**opts)
    address = server.address
    c = ps.Client([address], timeout=1)
    try:
        c.init({"w": np.zeros(4, np.float32)})
        server.checkpoint(tmp_path)
        for outage in range(4):
            server.stop()
            down = time.monotonic()
            while time.monotonic() - down < 3:  # gRPC's backoff grows to its 2 s cap
                with pytest.raises(deepnex.UnavailableError):
                    c.pull("w")
            server = ps.Server(address=address, restore=tmp_path, **opts)
            c.push({"w": np.ones(4, np.float32)})
            np.testing.assert_array_equal(c.pull("w")["w"], np.full(4, outage + 1, np.float32))
            server.checkpoint(tmp_path)
    finally:
        try:
            c.close()
        finally:
            server.stop()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_that_failed_on_one_server_is_finished_before_the_next_call(tmp_path, mode):
    """A push over two servers reached one and timed out on the other (a
    probe cut a host off mid-push): the client then registered anew and
    every later pull held two different steps, the part that took the
    failed push one push ahead for good, with no error. The part that is
    unsure now goes again, exactly once, before the client's next call."""
    opts = dict(mode=mode, optimizer=ps.Sum(), reduction="sum")
    first, second = ps.Server(name="a", **opts), ps.Server(name="b", **opts)
    address = second.address
    try:
        c = ps.Client([first.address, address], partition_bytes=64, timeout=2)
        c.init({"w": np.zeros(64, np.float32)})  # 4 partitions, 2 on each server
        second.checkpoint(tmp_path)  # the tensor and this client's registration
        second.stop()
        with pytest.raises(deepnex.UnavailableError,
                           match=r"what is unsure goes again, exactly once, before this "
                                 r"client's next call \(do not push it again\)"):
            c.push({"w": np.ones(64, np.float32)})
        second = ps.Server(address=address, name="b", restore=tmp_path, **opts)
        np.testing.assert_array_equal(c.push_pull({"w": np.full(64, 2, np.float32)})["w"],
                                      np.full(64, 3, np.float32))
        assert c.version("w") == 2
        # close() finishes it too: there is no next call (a probe's close
        # left the tensor half-applied without a word).
        second.checkpoint(tmp_path)
        second.stop()
        with pytest.raises(deepnex.UnavailableError):
            c.push({"w": np.ones(64, np.float32)})
        second = ps.Server(address=address, name="b", restore=tmp_path, **opts)
        c.close()
        with ps.Client([first.address, address], worker_id=-1, partition_bytes=64) as look:
            np.testing.assert_array_equal(look.pull("w")["w"], np.full(64, 4, np.float32))
    finally:
        first.stop()
        second.stop()


def test_a_server_restarted_without_a_checkpoint_is_named_and_init_recovers():
    """A probe's server, killed and restarted on its port with nothing,
    answered "no such tensor" without saying which of the servers."""
    server = ps.Server(mode="async", optimizer=ps.SGD(lr=1.0))
    address = server.address
    try:
        c = ps.Client([address], timeout=5)
        c.init({"w": np.zeros(4, np.float32)})
        c.push({"w": np.ones(4, np.float32)})
        server.stop()
        server = ps.Server(address=address, mode="async", optimizer=ps.SGD(lr=1.0))
        with pytest.raises(deepnex.NotFoundError) as e:
            c.push({"w": np.ones(4, np.float32)})
        assert str(e.value) == (f'push to {address}: push of "w": no such tensor (part 0 is not '
                                "on this server: init it first, or again if the server "
                                "restarted without a checkpoint)")
        c.init({"w": np.zeros(4, np.float32)})
        c.push({"w": np.ones(4, np.float32)})
        np.testing.assert_array_equal(c.pull("w")["w"], -np.ones(4, np.float32))
        c.close()
    finally:
        server.stop()


def test_checkpoint_restore_continues_exactly(tmp_path):
    """Sync Adam with 2 workers: a restored server continues bit for bit."""
    steps, cut = 12, 5
    rng = np.random.default_rng(3)
    grads = [[rng.standard_normal(N).astype(np.float32) for _ in range(steps + 1)]
             for _ in range(2)]
    init = rng.standard_normal(N).astype(np.float32)
    opt = ps.Adam(lr=0.01)

    def train(server, first, last, seen):
        def worker(w):
            def run():
                with ps.Client([server.address], worker_id=w) as c:
                    c.init({"w": init})
                    for t in range(first, last + 1):
                        seen[(w, t)] = c.push_pull({"w": grads[w][t]})["w"]
            return run
        run_fns([worker(0), worker(1)])

    reference = {}
    with ps.Server(mode="sync", num_workers=2, optimizer=opt) as server:
        train(server, 1, steps, reference)

    seen = {}
    with ps.Server(mode="sync", num_workers=2, optimizer=opt) as server:
        train(server, 1, cut, seen)
        assert server.checkpoint(tmp_path) == cut
    with ps.Server(mode="sync", num_workers=2, optimizer=opt, restore=tmp_path) as server:
        with ps.Client([server.address], worker_id=-1) as c:
            assert c.version("w") == cut
            np.testing.assert_array_equal(c.pull("w")["w"], reference[(0, cut)])
        train(server, cut + 1, steps, seen)
    for w in range(2):
        np.testing.assert_array_equal(seen[(w, steps)], reference[(w, steps)])


def test_servers_each_restore_their_part_of_a_tensor_split_over_them(tmp_path):
    """A tensor over partition_bytes is split over the job's servers; the
    servers not holding its part 0 checkpointed their parts without its
    description, and restoring them failed with '"w" part 1: no such
    tensor' (found by a probe): a restarted multi-server job could not
    come back."""
    opt = ps.SGD(lr=0.5)
    init = np.arange(64, dtype=np.float32)
    grad = np.full(64, 2.0, np.float32)
    servers = [ps.Server(mode="sync", num_workers=1, optimizer=opt, name=f"ps{j}")
               for j in range(2)]
    try:
        with ps.Client([s.address for s in servers], worker_id=0, partition_bytes=64) as c:
            c.init({"w": init})
            after = c.push_pull({"w": grad})["w"]
        np.testing.assert_array_equal(after, init - 1.0)
        assert [s.checkpoint(tmp_path) for s in servers] == [1, 1]
    finally:
        for s in servers:
            s.stop()
    servers = [ps.Server(mode="sync", num_workers=1, optimizer=opt, name=f"ps{j}",
                         restore=tmp_path) for j in range(2)]
    try:
        with ps.Client([s.address for s in servers], worker_id=0, partition_bytes=64) as c:
            c.init({"w": init})  # described already: a no-op
            np.testing.assert_array_equal(c.pull("w")["w"], init - 1.0)
            np.testing.assert_array_equal(c.push_pull({"w": grad})["w"], init - 2.0)
    finally:
        for s in servers:
            s.stop()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(*args):
    if not os.path.exists(PS_BIN):
        pytest.skip(f"{PS_BIN} not built")
    proc = subprocess.Popen([PS_BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    assert line.startswith("deepnex-ps listening on "), line + proc.stderr.read()
    proc.address = line.split()[3]  # the port bound, also for --listen HOST:0
    return proc


def test_server_killed_mid_training_restarts_from_its_checkpoint(tmp_path):
    """kill -9 of deepnex-ps; restarted with --restore, the workers see the
    round counter, values and optimizer state of the last checkpoint and
    train on to exactly the uninterrupted result."""
    steps, pause = 14, 9
    rng = np.random.default_rng(5)
    grads = [[rng.standard_normal(N).astype(np.float32) for _ in range(steps + 1)]
             for _ in range(2)]
    init = rng.standard_normal(N).astype(np.float32)
    reference = {}
    with ps.Server(mode="sync", num_workers=2, optimizer=ps.Adam(lr=0.01)) as server:
        def ref(w):
            def run():
                with ps.Client([server.address], worker_id=w) as c:
                    c.init({"w": init})
                    for t in range(1, steps + 1):
                        reference[(w, t)] = c.push_pull({"w": grads[w][t]})["w"]
            return run
        run_fns([ref(0), ref(1)])

    address = f"127.0.0.1:{free_port()}"
    flags = ["--listen", address, "--mode", "sync", "--workers", "2", "--optimizer", "adam",
             "--lr", "0.01", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4"]
    daemon = start_daemon(*flags)
    paused = threading.Barrier(3)
    resume = threading.Event()
    final, resumed_at = {}, {}

    def worker(w):
        def run():
            with ps.Client([address], worker_id=w, timeout=30) as c:
                c.init({"w": init})
                t = 1
                while t <= steps:
                    if t == pause + 1 and not resume.is_set():
                        paused.wait(timeout=60)
                        resume.wait(timeout=60)
                    try:
                        final[w] = c.push_pull({"w": grads[w][t]})["w"]
                        t += 1
                    except deepnex.AbortedError:
                        # The server came back from a checkpoint: go on from there.
                        t = c.version("w") + 1
                        resumed_at[w] = t
        return run

    threads = threading.Thread(target=run_fns, args=([worker(0), worker(1)],))
    threads.start()
    try:
        paused.wait(timeout=60)  # both workers finished round `pause`
        with ps.Client([address], worker_id=-1) as c:
            # The periodic checkpoints cut at rounds 4 and 8, written in the background.
            wait_for(lambda: c.stats()[0]["checkpoint_round"] >= 8, "the checkpoint of round 8")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        daemon = start_daemon(*flags, "--restore", str(tmp_path))
        with ps.Client([address], worker_id=-1) as c:
            round_ = c.version("w")
            assert round_ == 8  # the last periodic checkpoint
            np.testing.assert_array_equal(c.pull("w")["w"], reference[(0, round_)])
        resume.set()
        threads.join(120)
        assert not threads.is_alive()
    finally:
        resume.set()
        daemon.kill()
        daemon.wait()
    assert resumed_at == {0: round_ + 1, 1: round_ + 1}
    for w in range(2):
        np.testing.assert_array_equal(final[w], reference[(w, steps)])


def test_damaged_checkpoints_are_refused(tmp_path):
    with ps.Server(mode="async", optimizer=ps.Adam()) as server, \
            ps.Client([server.address]) as c:
        c.init({"w": np.arange(N, dtype=np.float32)})
        c.push({"w": g(0, 1)})
        server.checkpoint(tmp_path)
    path = tmp_path / "ps.ckpt"
    good = path.read_bytes()
    with ps.Server(mode="async", optimizer=ps.Adam(), restore=tmp_path) as server:
        with ps.Client([server.address], worker_id=-1) as c:
            assert c.version("w") == 1
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(deepnex.DataLossError, match="truncated"):
        ps.Server(mode="async", optimizer=ps.Adam(), restore=tmp_path)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    path.write_bytes(bytes(flipped))
    with pytest.raises(deepnex.DataLossError, match="checksum"):
        ps.Server(mode="async", optimizer=ps.Adam(), restore=tmp_path)
    path.write_bytes(good)
    with pytest.raises(deepnex.FailedPreconditionError, match="async server with 1 workers"):
        ps.Server(mode="sync", optimizer=ps.Adam(), restore=tmp_path)
    # Adam's moments are not SGD's momentum.
    with pytest.raises(deepnex.FailedPreconditionError,
                       match="optimizer is adam, this one's is sgd; restore it with the same kind"):
        ps.Server(mode="async", optimizer=ps.SGD(momentum=0.9), restore=tmp_path)


def test_a_failed_checkpoint_keeps_the_previous_one(tmp_path):
    with ps.Server(mode="async") as server, ps.Client([server.address]) as c:
        c.init({"w": np.ones(N, np.float32)})
        server.checkpoint(tmp_path)
        good = (tmp_path / "ps.ckpt").read_bytes()
        # The job's parameters are its owner's alone (they were 0644).
        assert (tmp_path / "ps.ckpt").stat().st_mode & 0o777 == 0o600
        (tmp_path / "ps.ckpt.tmp").mkdir()  # the next write cannot create its temp file
        c.push({"w": g(0, 1)})
        with pytest.raises(deepnex.DeepnexError):
            server.checkpoint(tmp_path)
        assert (tmp_path / "ps.ckpt").read_bytes() == good


def test_a_checkpoint_that_is_not_a_file_is_refused_at_once(tmp_path):
    """A FIFO planted where the checkpoint goes (a shared directory) held
    the restoring server forever, a link to /dev/zero read until memory ran
    out."""
    if not os.path.exists(PS_BIN):
        pytest.skip(f"{PS_BIN} not built")
    fifo, zero = tmp_path / "fifo", tmp_path / "zero"
    fifo.mkdir()
    os.mkfifo(fifo / "ps.ckpt")
    zero.mkdir()
    (zero / "ps.ckpt").symlink_to("/dev/zero")
    for d in (fifo, zero):
        try:
            out = subprocess.run([PS_BIN, "--listen", "127.0.0.1:0", "--restore", str(d)],
                                 capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"restoring from {d / 'ps.ckpt'} hung")
        assert out.returncode == 1, out
        assert (f'checkpoint "{d}/ps.ckpt" is not a regular file (a FIFO, socket or device)'
                in out.stderr), out.stderr


def test_a_checkpoint_another_user_may_have_written_is_not_restored(tmp_path):
    """A checkpoint planted in a shared directory (another user's file, or
    one the group may write) was restored, its parameters served."""
    if not os.path.exists(PS_BIN):
        pytest.skip(f"{PS_BIN} not built")
    planted = tmp_path / "ps.ckpt"
    planted.write_bytes(b"not yours")
    planted.chmod(0o664)
    cases = [("is writable by others than its owner (mode 0664)", None)]
    if os.geteuid() == 0:
        cases.append(("belongs to uid 65534, not to this process's 0", 65534))
    for message, owner in cases:
        if owner is not None:
            planted.chmod(0o600)
            os.chown(planted, owner, owner)
        out = subprocess.run([PS_BIN, "--listen", "127.0.0.1:0", "--restore", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out
        assert f'checkpoint "{planted}" {message}: another user may have written it' \
            in out.stderr, out.stderr


def test_a_checkpoint_that_fills_the_disk_keeps_the_previous_one(tmp_path):
    """On a full disk (here a file size limit) a failed checkpoint left its
    half file, ps.ckpt.tmp, taking the space, and the periodic ones printed
    a line every try. The last good checkpoint stays, the server serves on,
    says it once and counts the failures."""
    if not os.path.exists(PS_BIN):
        pytest.skip(f"{PS_BIN} not built")

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    daemon = subprocess.Popen([PS_BIN, "--listen", "127.0.0.1:0", "--checkpoint-dir",
                               str(tmp_path), "--checkpoint-interval", "0.05", "--metrics-port",
                               "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=limited)
    try:
        line = daemon.stdout.readline()
        assert line.startswith("deepnex-ps listening on "), line + daemon.stderr.read()
        metrics = re.search(r"metrics on (http://[\d.]+:\d+/metrics)", daemon.stdout.readline())

        def counter(name):
            text = urllib.request.urlopen(metrics.group(1), timeout=10).read().decode()
            return prometheus.parse(text)[0].get((name, ()), 0)

        with ps.Client([line.split()[3]], worker_id=0) as c:
            c.init({"small": np.ones(N, np.float32)})
            assert c.checkpoint() == [0]
            c.init({"big": np.zeros(1 << 20, np.float32)})  # 4 MiB
            with pytest.raises(deepnex.InternalError,
                               match=r'cannot write ".*/ps\.ckpt\.tmp": File too large'):
                c.checkpoint()
            wait_for(lambda: counter("deepnex_ps_checkpoint_failures_total") >= 5,
                     "5 failed periodic checkpoints")
            c.push({"small": np.ones(N, np.float32)})
            assert c.version("small") == 1
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    finally:
        daemon.kill()
        daemon.wait()
    assert err.count("periodic checkpoint failed") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["ps.ckpt", "ps.lock"]
    with ps.Server(restore=tmp_path) as server, \
            ps.Client([server.address], worker_id=-1) as c:
        np.testing.assert_array_equal(c.pull("small")["small"], np.ones(N, np.float32))


def test_client_checkpoints_by_name_inside_the_daemons_checkpoint_dir(tmp_path):
    """A checkpoint call from the wire names a directory inside the server's
    --checkpoint-dir, never a path, and takes an admin or the job's token."""
    ckpt = tmp_path / "ckpt"
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-admin root admin\ntok-alice alice user\ntok-a runner user job-a\n")
    daemon = start_daemon("--listen", "127.0.0.1:0", "--token-file", str(tokens),
                          "--job", "job-a", "--checkpoint-dir", str(ckpt))
    try:
        with ps.Client([daemon.address], token="tok-a") as c:
            c.init({"w": np.ones(N, np.float32)})
            for bad in (str(tmp_path / "elsewhere"), "../elsewhere", "a/b", ".."):
                with pytest.raises(deepnex.InvalidArgumentError, match="not a plain name"):
                    c.checkpoint(bad)
            assert not (tmp_path / "elsewhere").exists()
            assert c.checkpoint("before-upgrade") == [0]
            assert (ckpt / "before-upgrade" / "ps.ckpt").is_file()
            assert c.checkpoint() == [0]
            assert (ckpt / "ps.ckpt").is_file()
        with ps.Client([daemon.address], worker_id=-1, token="tok-alice") as c:
            with pytest.raises(deepnex.PermissionDeniedError, match="neither an admin"):
                c.checkpoint("mine")
        assert not (ckpt / "mine").exists()
        with ps.Client([daemon.address], worker_id=-1, token="tok-admin") as c:
            assert c.checkpoint("mine") == [0]
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


def test_a_pull_reply_over_the_cap_is_refused():
    with ps.Server(mode="async", max_pull_reply_bytes="1KiB") as server, \
            ps.Client([server.address], partition_bytes="4KiB") as c:
        c.init({"small": np.zeros(N, np.float32), "big": np.zeros(1024, np.float32)})
        assert c.pull(["small"])["small"].shape == (N,)
        with pytest.raises(deepnex.ResourceExhaustedError, match="max_pull_reply_bytes"):
            c.pull(["big"])


def test_metrics_endpoint_serves_prometheus_text():
    with ps.Server(mode="sync", num_workers=1, metrics_address="127.0.0.1:0") as server, \
            ps.Client([server.address]) as c:
        c.init({"w": np.zeros(N, np.float32)})
        for t in range(1, 4):
            c.push_pull({"w": g(0, t)})
        assert server.metrics_port > 0
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    samples, types = prometheus.parse(text)
    assert types["deepnex_ps_pushes_total"] == "counter"
    assert types["deepnex_ps_round_latency_seconds"] == "histogram"
    assert samples[("deepnex_ps_pushes_total", ())] == 3
    assert samples[("deepnex_ps_rounds_total", ())] == 3
    assert samples[("deepnex_ps_live_workers", ())] == 1
    assert samples[("deepnex_ps_round_latency_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("deepnex_ps_bytes_in_total", ())] == 3 * N * 4


def test_daemon_metrics_port_and_fault_flags(tmp_path):
    daemon = start_daemon("--listen", "127.0.0.1:0", "--mode", "ssp", "--staleness", "2",
                          "--workers", "2", "--lease-timeout", "2", "--lease-policy", "abort",
                          "--metrics-port", "0", "--checkpoint-dir", str(tmp_path),
                          "--checkpoint-interval", "0.2", "--name", "ps0")
    try:
        line = daemon.stdout.readline()
        m = re.search(r"metrics on http://([\d.]+:\d+)/metrics", line)
        assert m, line
        text = urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10).read().decode()
        prometheus.parse(text)
        wait_for((tmp_path / "ps0.ckpt").exists, "the periodic checkpoint ps0.ckpt")
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
    bad = subprocess.run([PS_BIN, "--mode", "sync", "--staleness", "2"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "staleness" in bad.stderr
    bad = subprocess.run([PS_BIN, "--lease-timeout", "1", "--heartbeat-interval", "2"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "heartbeat_interval" in bad.stderr
