"""deepnex.collective: the rendezvous store and communicators, with ranks as
threads and as processes on 127.0.0.1. Inputs are integer-valued so results
are exact."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import deepnex
from _exact import DTYPES, OPS, allreduce_case
from _wait import run_threads, wait_for
from deepnex import collective


_prefix_counter = [0]


def run_ranks(store, n, body, **kwargs):
    """Runs body(rank, comm) on n threads; re-raises the first failure."""
    _prefix_counter[0] += 1
    prefix = f"py{os.getpid()}-{_prefix_counter[0]}"

    def rank_main(r):
        comm = collective.Communicator(r, n, store=store.address, prefix=prefix, timeout=20.0,
                                       **kwargs)
        body(r, comm)

    run_threads(n, rank_main, what="a rank")


def test_store_operations(store):
    c = collective.StoreClient(store.address, prefix="job", timeout=5.0)
    c.set("a", b"x\x00y")
    assert c.get("a") == b"x\x00y"
    c.set("s", "text")
    assert c.get("s") == b"text"
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5
    # Past int64 is refused, not wrapped: the counter keeps its value.
    with pytest.raises(deepnex.OutOfRangeError, match="the value stays 5$"):
        c.add("n", 2**63 - 1)
    with pytest.raises(deepnex.InvalidArgumentError, match="^store add: delta=18446744073709551616: "
                                                           "must fit int64$"):
        c.add("n", 2**64)
    assert c.add("n", 0) == 5
    assert c.compare_set("k", b"", b"first") == b"first"
    assert c.compare_set("k", b"nope", b"second") == b"first"
    assert c.check(["a", "missing"]) == [True, False]
    assert c.delete("a") and not c.delete("a")
    with pytest.raises(TimeoutError, match="job/missing"):
        c.get("missing", timeout=0.2)
    with pytest.raises(deepnex.DeadlineExceededError, match="job/m2"):
        c.wait(["s", "m2"], timeout=0.1)
    raw = collective.StoreClient(store.address)
    assert raw.get("job/s") == b"text"


def test_store_get_waits_for_a_later_set(store):
    c = collective.StoreClient(store.address)
    t = threading.Timer(0.1, lambda: collective.StoreClient(store.address).set("late", b"v"))
    t.start()
    assert c.get("late", timeout=60) == b"v"
    t.join()


def test_store_token():
    with collective.Store("127.0.0.1:0", token="s3cret") as s:
        with pytest.raises(PermissionError):
            collective.StoreClient(s.address).set("k", b"v")
        collective.StoreClient(s.address, token="s3cret").set("k", b"v")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_allreduce_every_dtype_and_op(store, n):
    def body(r, comm):
        for dtype in DTYPES:
            for op in OPS:
                for size in (0, 1, 7, 1001):
                    inputs, want = allreduce_case(op, dtype, size, n)
                    x = inputs[r]
                    out = comm.allreduce(x, op=op)
                    assert out is x
                    np.testing.assert_array_equal(x, want, err_msg=f"{dtype} {op} {size}")
    run_ranks(store, n, body)


def test_broadcast_allgather_reduce_scatter_async(store):
    n = 3

    def body(r, comm):
        x = np.full((4, 5), r, np.float32)
        comm.broadcast(x, root=2)
        assert (x == 2).all()
        g = comm.allgather(np.full(7, r + 1, np.int64))
        assert g.shape == (3, 7)
        np.testing.assert_array_equal(g[:, 0], [1, 2, 3])
        y = np.arange(6 * 2, dtype=np.float64).reshape(6, 2) + r
        out = comm.reduce_scatter(y)
        assert out.shape == (2, 2)
        np.testing.assert_array_equal(out, 3 * np.arange(12).reshape(6, 2)[2 * r:2 * r + 2] + 3)
        works = [comm.allreduce_async(np.full(1000, r + k, np.float32)) for k in range(5)]
        for k, w in enumerate(works):
            assert (w.wait(timeout=20) == 3 * k + 3).all()
        comm.barrier()
        assert comm.rank == r and comm.world_size == 3
    run_ranks(store, n, body)


def test_torch_tensors_without_copies(store):
    torch = pytest.importorskip("torch")

    def body(r, comm):
        t = torch.full((3, 1000), float(r + 1))
        ptr = t.data_ptr()
        assert comm.allreduce(t) is t
        assert t.data_ptr() == ptr and (t == 3).all()
        b = torch.full((513,), float(r + 2), dtype=torch.bfloat16)
        comm.allreduce(b, op="max")
        assert (b == 3).all()
        g = comm.allgather(torch.tensor([r, r], dtype=torch.int32))
        assert isinstance(g, torch.Tensor) and g.tolist() == [[0, 0], [1, 1]]
    run_ranks(store, 2, body)


def test_bad_input_and_mismatch_raise_on_every_rank(store):
    def body(r, comm):
        with pytest.raises(ValueError, match="contiguous"):
            comm.allreduce(np.zeros((4, 4), np.float32)[:, 1])
        with pytest.raises(ValueError, match="read-only"):
            a = np.zeros(4, np.float32)
            a.setflags(write=False)
            comm.allreduce(a)
        with pytest.raises(deepnex.InvalidArgumentError, match="disagree"):
            comm.allreduce(np.zeros(10 + r, np.float32))
        with pytest.raises(ValueError, match="multiple of world_size"):
            comm.reduce_scatter(np.zeros(3, np.float32))
        # Named, not a pybind signature or an AttributeError on .shape.
        with pytest.raises(deepnex.InvalidArgumentError, match=r"root 1099511627776 is outside 0..1"):
            comm.broadcast(np.zeros(3, np.float32), root=2**40)
        for op in (comm.allgather, comm.reduce_scatter):
            with pytest.raises(TypeError, match="expected a numpy array or a torch tensor"):
                op([1.0, 2.0])
        # Named on every rank, not a pybind signature dump.
        for reduce in (comm.allreduce, comm.reduce_scatter):
            with pytest.raises(deepnex.InvalidArgumentError,
                               match=r"op: None is not a name \(one of sum, mean, max, min, prod\)"):
                reduce(np.zeros(2, np.float32), op=None)
        x = np.ones(3, np.float32)
        comm.allreduce(x)
        assert (x == 2).all()
    run_ranks(store, 2, body)


def test_arguments_refused_on_one_rank_fail_every_rank_and_keep_them_in_step(store):
    """An argument refused in Python or the binding on one rank (before the
    communicator saw the call) left that rank out of the collective: a
    probe's rank 1 then met rank 0's next call, and its sum of 1 + 2 came
    back as 12 with no error, rank 0's next sums wrong too. The refused
    call now takes its part: the other rank fails with InvalidArgument
    naming rank 0, and the next call of both is exact."""
    bad = [
        ("allreduce", lambda c: c.allreduce(np.zeros((4, 4), np.float32)[:, 1])),
        ("allreduce", lambda c: c.allreduce(np.zeros(4, np.float32), op="Sum")),
        ("allreduce", lambda c: c.allreduce(np.zeros(4, np.float32), op=None)),
        ("allreduce", lambda c: c.allreduce([1.0, 2.0])),
        ("broadcast", lambda c: c.broadcast(np.zeros(4, np.float32), root=2**40)),
        ("allgather", lambda c: c.allgather(np.zeros(4, np.float32)[::2])),
        ("reduce_scatter", lambda c: c.reduce_scatter(np.zeros(3, np.float32))),
    ]
    good = {
        "allreduce": lambda c: c.allreduce(np.zeros(4, np.float32)),
        "broadcast": lambda c: c.broadcast(np.zeros(4, np.float32)),
        "allgather": lambda c: c.allgather(np.zeros(2, np.float32)),
        "reduce_scatter": lambda c: c.reduce_scatter(np.zeros(4, np.float32)),
    }

    def body(r, comm):
        for step, (kind, call) in enumerate(bad):
            if r == 0:
                with pytest.raises((ValueError, TypeError)):
                    call(comm)
            else:
                with pytest.raises(deepnex.InvalidArgumentError,
                                   match=rf"^{kind}: invalid arguments on rank 0; nothing was "
                                         r"done$"):
                    good[kind](comm)
            x = np.full(3, step + r + 1, np.float32)
            comm.allreduce(x)
            np.testing.assert_array_equal(x, np.full(3, 2 * step + 3, np.float32))
    run_ranks(store, 2, body)
    # Both transports between the ranks: the pair path and the ring.
    run_ranks(store, 2, body, transport="tcp")


def test_missing_rank_is_timeout_naming_it(store):
    with pytest.raises(TimeoutError, match="rank 1"):
        collective.Communicator(0, 2, store=store.address, prefix="lonely", timeout=0.5)


def test_ranks_that_retry_together_after_a_lone_failed_start_meet_again(store):
    """A probe's rank 0 timed out alone at start; every later try of both
    ranks on that prefix failed, rank 1 reading rank 0's entry from the
    failed try and rank 0 waiting one generation ahead. A failed start now
    takes its join back, and a rank apart from the others says so."""
    def pair():
        comms = {}

        def rank_main(r):
            comms[r] = collective.Communicator(r, 2, store=store.address, prefix="retry",
                                               timeout=20.0)
        run_threads(2, rank_main, what="a rank")
        out = [np.full(4, r + 1, np.float32) for r in range(2)]
        run_threads(2, lambda r: comms[r].allreduce(out[r]), what="a rank")
        np.testing.assert_array_equal(out[1], np.full(4, 3, np.float32))

    pair()
    with pytest.raises(TimeoutError) as e:
        collective.Communicator(0, 2, store=store.address, prefix="retry", timeout=1.0)
    assert str(e.value).endswith(
        'rank 1 did not arrive at the store ' + store.address + ' within 1000 ms (it has '
        'joined "retry" 1 time(s) and this rank 2: they wait under different generations, as '
        'after a rank was killed while starting or a start that failed on some ranks only; '
        'start every rank with a new prefix)'), e.value
    pair()


def test_ranks_given_different_world_sizes_are_told_so(store):
    """A probe's ranks given world sizes 2 and 3 both timed out, naming a
    rank that did not connect or arrive and neither world_size."""
    errors = {}

    def rank_main(r):
        try:
            collective.Communicator(r, 2 + r, store=store.address, prefix="sizes", timeout=3.0)
        except deepnex.DeepnexError as e:
            errors[r] = e
    run_threads(2, rank_main, what="a rank")
    assert isinstance(errors[0], deepnex.InvalidArgumentError)
    assert str(errors[0]) == ('world_size: this rank (0) was given 2, rank 1 3; every rank of '
                              'communicator "sizes" must be given the same')
    assert isinstance(errors[1], TimeoutError)  # it waits for a rank 2 that never comes


def _listening_ports():
    """TCP ports this process listens on (its sockets among the netns')."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # LISTEN
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_silent_connection_to_a_ranks_port_does_not_hold_up_its_neighbour(store, transport):
    """A co-tenant's idle connection to a rank's listening port held the
    rank's accept loop on its hello until the timeout: every communicator
    started 20 s late (found by a probe, across simulated hosts); then
    connections that sent one byte were read in turn, 1 s each."""
    before = _listening_ports()
    comms, silent = {}, []

    def rank_main(r):
        comms[r] = collective.Communicator(r, 2, store=store.address, prefix=f"silent-{transport}",
                                           timeout=20.0, transport=transport)
    first = threading.Thread(target=rank_main, args=(0,))
    first.start()
    try:
        wait_for(lambda: _listening_ports() - before, "rank 0 to listen")
        for port in _listening_ports() - before:
            for i in range(13):
                silent.append(socket.create_connection(("127.0.0.1", port)))
                if i >= 3:  # part of a hello: read in turn, these held 1 s each
                    silent[-1].send(b"\x01")
        start = time.monotonic()
        rank_main(1)
        first.join(timeout=30)
        assert not first.is_alive()
        assert time.monotonic() - start < 8, "the silent connections held the rendezvous"
        out = [np.arange(4, dtype=np.float32) * (r + 1) for r in range(2)]
        run_threads(2, lambda r: comms[r].allreduce(out[r]), what="a rank")
        np.testing.assert_array_equal(out[0], np.arange(4, dtype=np.float32) * 3)
    finally:
        for s in silent:
            s.close()
        first.join(timeout=30)


def test_nccl_without_a_device_is_failed_precondition(store):
    try:
        collective.Communicator(0, 1, store=store.address, backend="nccl")
    except deepnex.FailedPreconditionError:
        return
    pytest.skip("a GPU is present")


NO_CUDA_SCRIPT = r"""
import numpy as np, deepnex
from deepnex import collective
store = collective.Store("127.0.0.1:0")
x = np.arange(4, dtype=np.float32)
collective.Communicator(0, 1, store=store.address, prefix="cpu").allreduce(x)
try:
    collective.Communicator(0, 1, store=store.address, prefix="gpu", backend="nccl")
except deepnex.FailedPreconditionError as e:
    print("refused:", e)
store.stop()
print("cpu:", x.tolist())
"""


def test_without_the_cuda_runtime_and_nccl_deepnex_loads_and_nccl_says_no_device():
    """libdeepnex linked libcudart.so.13 and libnccl.so.2, so `import
    deepnex` failed on a host without them (a CPU-only node, central's).
    Here they are hidden in a mount namespace of the process's own."""
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                           timeout=60).stdout
    dirs = {os.path.dirname(os.path.realpath(line.split("=>")[1].strip()))
            for line in found.splitlines()
            if "=>" in line and line.split()[0] in ("libcudart.so.13", "libnccl.so.2")}
    if not dirs:
        pytest.skip("the CUDA runtime and NCCL are not installed: nothing to hide")
    if os.geteuid() != 0:
        pytest.skip("hiding them takes a mount namespace (root)")
    hide = " && ".join(f"mount -t tmpfs none {d}" for d in sorted(dirs))
    out = subprocess.run(["unshare", "--mount", "sh", "-c",
                          f'{hide} && exec "$0" -c "$1"', sys.executable, NO_CUDA_SCRIPT],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "refused: backend nccl: no CUDA runtime or NCCL here (libcudart.so.13: cannot open "
        "shared object file: No such file or directory)",
        "cpu: [0.0, 1.0, 2.0, 3.0]"]


def test_auto_backend_sends_host_arrays_through_cpu_and_cuda_tensors_through_nccl(store):
    comm = collective.Communicator(0, 1, store=store.address, prefix="auto1")
    assert comm.backend == "cpu"
    x = np.arange(4, dtype=np.float32)
    comm.allreduce(x)
    assert (x == np.arange(4)).all()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        # The nccl communicator is made lazily: without a device the first
        # CUDA collective would be where it fails, and no host call got there.
        assert comm._nccl is None
        return
    y = torch.ones(4, device="cuda")
    comm.allreduce(y)
    assert comm._nccl is not None and comm._nccl.backend == "nccl"
    assert y.tolist() == [1.0] * 4


RANK_SCRIPT = r"""
import sys, numpy as np
from deepnex import collective
addr, rank, n, transport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
comm = collective.Communicator(rank, n, store=addr, prefix=f"procs-{transport}-{n}", timeout=20,
                               transport=transport)
x = np.arange(1 << 20, dtype=np.float32) % 97 + rank
comm.allreduce(x)
want = n * (np.arange(1 << 20, dtype=np.float32) % 97) + n * (n - 1) / 2
assert (x == want).all(), "wrong sum"
g = comm.allgather(np.array([rank], np.int64))
assert g.ravel().tolist() == list(range(n))
for dtype in (np.float16, np.float64, np.int32, np.int64):
    b = np.full(1001, rank, dtype)
    comm.broadcast(b, root=n - 1)
    assert (b == n - 1).all(), "broadcast"
    y = np.tile(np.arange(n, dtype=dtype)[:, None], (1, 33)) + rank
    out = comm.reduce_scatter(y, op="max")
    assert (out == rank + n - 1).all(), "reduce_scatter"
    m = np.full(77, rank + 1, dtype)
    comm.allreduce(m, op="min")
    assert (m == 1).all(), "allreduce min"
print("ok", comm.transport)
"""


@pytest.mark.parametrize("transport,n", [("tcp", 3), ("shm", 3), ("tcp", 2), ("shm", 4)])
def test_ranks_as_processes(store, transport, n):
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, store.address, str(r), str(n),
                               transport],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert out.strip() == f"ok {transport}", out
    leftovers = [f for f in os.listdir("/dev/shm")
                 if any(f.startswith(f"deepnex-coll-{p.pid}-") for p in procs)]
    assert leftovers == []


DYING_SCRIPT = r"""
import os, sys, numpy as np
from deepnex import collective
addr, rank = sys.argv[1], int(sys.argv[2])
comm = collective.Communicator(rank, 3, store=addr, prefix="dying", timeout=30)
x = np.ones(8 << 20, np.float32)
if rank == 2:
    comm.barrier()
    os._exit(3)          # dies without a word, mid-job
comm.barrier()
try:
    comm.allreduce(x)
    comm.allreduce(x)
except (ConnectionError, deepnex_errors) as e:
    print("failed", type(e).__name__)
    sys.exit(0)
print("no error")
""".replace("deepnex_errors", "__import__('deepnex').AbortedError")


def test_dead_process_fails_the_others_within_the_timeout(store):
    procs = [subprocess.Popen([sys.executable, "-c", DYING_SCRIPT, store.address, str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    try:
        outs = [p.communicate(timeout=25)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[2].returncode == 3
    for out in outs[:2]:
        assert out.startswith("failed"), out


def test_a_segment_left_by_a_rank_killed_at_rendezvous_goes_with_the_next_one(store):
    # A rank's segment is named in /dev/shm until its neighbours map it; a
    # rank killed (SIGTERM, as a cancelled job's) while it waits for them
    # leaves the name. The next communicator formed on the host removes it
    # once it is 10 s old, as nothing holds it locked any more.
    waiting = subprocess.Popen(
        [sys.executable, "-c", "import sys; from deepnex import collective; "
         "collective.Communicator(0, 2, store=sys.argv[1], prefix='killed', timeout=60, "
         "transport='shm')", store.address])
    try:
        left = wait_for(lambda: [f for f in os.listdir("/dev/shm")
                                 if f.startswith(f"deepnex-coll-{waiting.pid}-")],
                        "the waiting rank's segment")
        waiting.terminate()
        assert waiting.wait(timeout=30) == -signal.SIGTERM
    finally:
        if waiting.poll() is None:
            waiting.kill()
    path = os.path.join("/dev/shm", left[0])
    assert os.path.exists(path)
    old = time.time() - 60
    os.utime(path, (old, old))
    run_ranks(store, 2, lambda r, comm: comm.barrier(), transport="shm")
    assert not os.path.exists(path)


def test_gradient_bucketer(store):
    def body(r, comm):
        grads = [np.full(100 + 13 * k, float(r + k), np.float32) for k in range(20)]
        grads += [np.full(50, r, np.int64)]
        b = collective.GradientBucketer(comm, grads, bucket_bytes="2KiB", op="mean")
        assert b.num_buckets > 3
        for k in reversed(range(len(grads))):
            b.mark_ready(k)
        b.wait()
        for k in range(20):
            assert (grads[k] == 0.5 + k).all(), k
        assert (grads[20] == 0).all()      # int mean truncates: (0 + 1) // 2
        with pytest.raises(ValueError, match="already marked"):
            b.mark_ready(0)
            b.mark_ready(0)
        with pytest.raises(deepnex.InvalidArgumentError, match=r"mark_ready\(-1\): an index is 0"):
            b.mark_ready(-1)
        b.mark_all_ready()
        b.wait()
    run_ranks(store, 2, body)


def test_communicator_from_the_job_context(store, job_env):
    job_env.setenv("DEEPNEX_STORE_ADDR", store.address)
    job_env.setenv("DEEPNEX_RANK", "0")
    job_env.setenv("DEEPNEX_WORLD_SIZE", "1")
    comm = collective.Communicator.from_context()
    assert comm.world_size == 1 and comm.rank == 0
    x = np.arange(4, dtype=np.float64)
    comm.allreduce(x)
    np.testing.assert_array_equal(x, np.arange(4))


def test_host_is_the_address_other_ranks_reach_this_one_at(store):
    def body(r, comm):
        x = np.full(1000, r + 1, np.int64)
        comm.allreduce(x)
        assert (x == 3).all()
        assert comm.transport == "tcp"

    # An address, and a name from /etc/hosts (the system resolver).
    run_ranks(store, 2, body, transport="tcp", host="127.0.0.1")
    run_ranks(store, 2, body, transport="tcp", host="localhost")
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        collective.Communicator(0, 2, store=store.address, prefix="badhost", timeout=5,
                                host="deepnex-no-such-host.invalid")
    assert 'cannot resolve host "deepnex-no-such-host.invalid"' in str(e.value)
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        collective.Communicator(0, 2, store=store.address, prefix="badhost", timeout=5,
                                host="0.0.0.0")
    assert str(e.value) == 'host "0.0.0.0": peers cannot dial a wildcard address'


def _private_dev_shm_prefix():
    """The argv prefix that runs a command with a /dev/shm of its own (a mount
    namespace with a fresh tmpfs there), or None where that is not allowed."""
    prefix = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    try:
        ok = subprocess.run(prefix + ["true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else None


def test_shm_falls_back_to_tcp_for_a_rank_with_its_own_dev_shm(store):
    prefix = _private_dev_shm_prefix()
    if prefix is None:
        pytest.skip("cannot give a process its own /dev/shm here (needs root and unshare -m)")
    # Rank 1 has the same hostname as 0 and 2 but cannot open their segments,
    # nor they its: 0 <-> 1 and 1 <-> 2 go over TCP, 2 -> 0 over shared memory.
    n = 3
    procs = []
    for r in range(n):
        argv = [sys.executable, "-c", RANK_SCRIPT, store.address, str(r), str(n), "auto"]
        procs.append(subprocess.Popen(prefix + argv if r == 1 else argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    assert [out.strip() for out, _ in outs] == ["ok shm+tcp", "ok tcp", "ok shm+tcp"]
    said = [err for _, err in outs]
    assert 'deepnex collective "procs-auto-3": rank 1 cannot map rank 2\'s shared memory' in said[1]
    assert 'deepnex collective "procs-auto-3": rank 1 cannot map rank 0\'s shared memory' in said[1]
    assert "rank 0 cannot map rank 1's shared memory" in said[0]
    assert "rank 2 cannot map rank 1's shared memory" in said[2]
    assert "rank 0's" not in said[2] and "rank 2's" not in said[0]
    assert "); using TCP between them" in said[0]
