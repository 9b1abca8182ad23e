"""deepnex.ps from Python: servers and workers as threads and as processes."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import deepnex
from _wait import run_threads
from deepnex import collective, ps

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
PS_BIN = os.path.join(BUILD_DIR, "bin", "deepnex-ps")


def run_workers(n, fn):
    """Runs fn(worker) on n threads; re-raises the first failure."""
    run_threads(n, fn, timeout=120, what="worker thread")


def grad(worker, step, shape):
    """Integer-valued gradients, exact in float32."""
    return ((worker + 1) * step * (np.arange(np.prod(shape)) % 5 - 2)).reshape(shape).astype(np.float32)


# ---- numpy references of torch.optim's rules

def adam_reference(w, grads, lr, b1, b2, eps, wd=0.0, decoupled=False):
    w = w.astype(np.float64).copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        if decoupled:
            w *= 1 - lr * wd
        else:
            g = g + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat = m / (1 - b1 ** t)
        vhat = v / (1 - b2 ** t)
        w -= lr * mhat / (np.sqrt(vhat) + eps)
    return w


def adagrad_reference(w, grads, lr, eps):
    w = w.astype(np.float64).copy()
    s = np.zeros_like(w)
    for g in grads:
        g = g.astype(np.float64)
        s += g * g
        w -= lr * g / (np.sqrt(s) + eps)
    return w


@pytest.mark.parametrize("workers", [2, 4])
def test_sync_sgd_exact_with_two_servers(workers):
    shape, steps, lr = (37, 11), 4, 0.5
    init = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    servers = [ps.Server(mode="sync", num_workers=workers, optimizer=ps.SGD(lr=lr),
                         reduction="sum") for _ in range(2)]
    try:
        addrs = [s.address for s in servers]
        expected = [init.copy()]
        for t in range(1, steps + 1):
            total = sum(grad(w, t, shape) for w in range(workers))
            expected.append(expected[-1] - lr * total)

        def worker(w):
            with ps.Client(addrs, worker_id=w, partition_bytes=256) as c:
                c.init({"w": init})
                np.testing.assert_array_equal(c.pull(["w"])["w"], init)
                for t in range(1, steps + 1):
                    got = c.push_pull({"w": grad(w, t, shape)})["w"]
                    np.testing.assert_array_equal(got, expected[t])

        run_workers(workers, worker)
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("opt,reference", [
    (ps.Adam(lr=0.01, betas=(0.9, 0.99), eps=1e-8),
     lambda w, gs: adam_reference(w, gs, 0.01, 0.9, 0.99, 1e-8)),
    (ps.AdamW(lr=0.01, weight_decay=0.1),
     lambda w, gs: adam_reference(w, gs, 0.01, 0.9, 0.999, 1e-8, 0.1, decoupled=True)),
    (ps.Adam(lr=0.01, weight_decay=0.05),
     lambda w, gs: adam_reference(w, gs, 0.01, 0.9, 0.999, 1e-8, 0.05)),
    (ps.Adagrad(lr=0.1), lambda w, gs: adagrad_reference(w, gs, 0.1, 1e-10)),
])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sync_optimizers_match_numpy(opt, reference, dtype):
    workers, steps, shape = 2, 6, (300,)
    rng = np.random.default_rng(7)
    init = rng.standard_normal(shape).astype(dtype)
    grads = [[rng.standard_normal(shape).astype(dtype) for _ in range(steps)]
             for _ in range(workers)]
    means = [(grads[0][t].astype(np.float64) + grads[1][t]) / 2 for t in range(steps)]
    expected = reference(init, means)
    # float64 parameters are updated in float64 and match to 1e-6 relative
    # (in fact to ~1e-12); float32 ones are rounded to float32 every step, so
    # they match to float32's resolution, about 1e-6 absolute at these values.
    tolerance = dict(rtol=1e-6, atol=0) if dtype == np.float64 else dict(rtol=1e-6, atol=1e-6)
    with ps.Server(mode="sync", num_workers=workers, optimizer=opt) as server:
        results = [None] * workers

        def worker(w):
            with ps.Client([server.address], worker_id=w) as c:
                c.init({"p": init})
                for t in range(steps):
                    results[w] = c.push_pull({"p": grads[w][t]})["p"]

        run_workers(workers, worker)
    for r in results:
        assert r.dtype == dtype
        np.testing.assert_allclose(r, expected, **tolerance)


def test_async_final_values_exact():
    workers, steps, lr, shape = 3, 8, 0.25, (1000,)
    init = np.full(shape, 10.0, np.float32)
    with ps.Server(mode="async", num_workers=workers, optimizer=ps.SGD(lr=lr)) as server:
        def worker(w):
            with ps.Client([server.address], worker_id=w, partition_bytes="1KiB") as c:
                c.init({"w": init})
                handles = [c.push_async({"w": grad(w, t, shape)}) for t in range(1, steps + 1)]
                for h in handles:
                    h.wait(timeout=30)

        run_workers(workers, worker)
        with ps.Client([server.address], worker_id=0) as c:
            got = c.pull("w")["w"]
    total = sum(grad(w, t, shape) for w in range(workers) for t in range(1, steps + 1))
    np.testing.assert_array_equal(got, init - lr * total)


def test_large_tensor_round_trips_across_three_servers():
    servers = [ps.Server(mode="async") for _ in range(3)]
    try:
        x = (np.arange(3 * 2**20 // 4 + 5, dtype=np.float32) * 0.5).reshape(-1)
        with ps.Client([s.address for s in servers], partition_bytes="256KiB") as c:
            c.init({"x": x})
            out = np.empty_like(x)
            c.pull_into({"x": out})
            np.testing.assert_array_equal(out, x)
            assert c.describe(["x"]) == {"x": ("float32", x.shape)}
    finally:
        for s in servers:
            s.stop()


def test_pull_into_writes_the_callers_array_and_torch_tensors_work():
    torch = pytest.importorskip("torch")
    with ps.Server(mode="async", optimizer=ps.Sum()) as server, \
            ps.Client([server.address]) as c:
        c.init({"t": torch.ones(2, 3)})
        c.push({"t": torch.full((2, 3), 2.0)})
        out = torch.zeros(2, 3)
        c.pull_into({"t": out})
        assert torch.equal(out, torch.full((2, 3), 3.0))


def test_bfloat16_tensors_pulled_as_float32_and_pushed_as_uint16_bits():
    torch = pytest.importorskip("torch")
    with ps.Server(mode="async", optimizer=ps.Sum()) as server, \
            ps.Client([server.address]) as c:
        c.init({"b": torch.tensor([1.0, 2.0, -0.5, 4.0], dtype=torch.bfloat16)})
        assert c.describe(["b"]) == {"b": ("bfloat16", (4,))}
        c.push({"b": torch.ones(4, dtype=torch.bfloat16)})
        out = torch.zeros(4, dtype=torch.bfloat16)
        c.pull_into({"b": out})
        assert out.tolist() == [2.0, 3.0, 0.5, 5.0]
        # numpy has no bfloat16: a pull gives the values as float32 (a
        # probe's gave the bits, [16384, ...] for [2.0, ...]), and a push
        # takes uint16 bits for a key the client knows is bfloat16.
        values = c.pull(["b"])["b"]
        assert values.dtype == np.float32 and values.tolist() == [2.0, 3.0, 0.5, 5.0]
        op = c.pull_async(["b"])
        for _ in range(2):  # the same values each wait
            assert op.wait()["b"].tolist() == [2.0, 3.0, 0.5, 5.0]
        assert c.push_pull_async({"b": torch.zeros(4, dtype=torch.bfloat16)}).wait()[
            "b"].tolist() == [2.0, 3.0, 0.5, 5.0]
        assert c.push_pull({"b": out})["b"].tolist() == [4.0, 6.0, 1.0, 10.0]
        c.push({"b": (values.view(np.uint32) >> 16).astype(np.uint16)})
        c.pull_into({"b": out})
        assert out.tolist() == [6.0, 9.0, 1.5, 15.0]
        with pytest.raises(TypeError) as e:
            c.push({"b": [1.0, 2.0]})
        assert str(e.value) == "'b': expected a numpy array or a torch tensor, got list"


def test_a_dtype_the_ps_does_not_take_is_refused_naming_the_ones_it_takes():
    """The message of every binding told a probe to use int32, int64 or
    uint8; an int32 parameter was then refused in turn."""
    takes = ("parameters are float32, float64, float16 or bfloat16 (bfloat16 as uint16 bits "
             "with an explicit bfloat16 dtype)")
    with ps.Server(mode="async") as server, ps.Client([server.address]) as c:
        for dtype, fmt, size in ((np.int8, "b", 1), (np.bool_, "?", 1), (np.complex64, "Zf", 8)):
            with pytest.raises(deepnex.InvalidArgumentError) as e:
                c.init({"w": np.zeros(4, dtype)})
            assert str(e.value) == (f'init of "w": buffer format "{fmt}" ({size}-byte items) '
                                    f"is not supported; {takes}")
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            c.init({"w": np.zeros(4, np.int32)})
        assert "parameters must be float32, float64, float16 or bfloat16" in str(e.value)


def test_bad_arrays_raise_without_copying():
    with ps.Server(mode="async") as server, ps.Client([server.address]) as c:
        c.init({"w": np.zeros((4, 4), np.float32)})
        with pytest.raises(deepnex.InvalidArgumentError, match="float64 values, the tensor is float32"):
            c.push({"w": np.zeros((4, 4), np.float64)})
        with pytest.raises(ValueError, match="contiguous"):
            c.push({"w": np.zeros((4, 8), np.float32)[:, ::2]})
        ro = np.zeros((4, 4), np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            c.pull_into({"w": ro})
        with pytest.raises(deepnex.InvalidArgumentError, match="got 8 float32 values, the tensor has 16"):
            c.pull_into({"w": np.zeros(8, np.float32)})
        with pytest.raises(KeyError):
            c.pull(["missing"])
        np.testing.assert_array_equal(c.pull("w")["w"], np.zeros((4, 4), np.float32))


def test_a_bool_is_not_taken_for_a_number():
    """pybind11 took True as 1: a probe's worker_id=True was worker 1, and
    num_workers=True and staleness=True made servers."""
    for make, name in ((lambda: ps.Server(num_workers=True), "num_workers"),
                       (lambda: ps.Server(mode="ssp", staleness=True), "staleness"),
                       (lambda: ps.Client(["127.0.0.1:1"], worker_id=True), "worker_id"),
                       # float() took these (probe of b01f49f): SGD(lr=True) was lr 1.
                       (lambda: ps.Server(lease_timeout=True), "lease_timeout"),
                       (lambda: ps.Client(["127.0.0.1:1"], timeout=True), "timeout"),
                       (lambda: ps.SGD(lr=True), r"SGD\.lr"),
                       (lambda: ps.SGD(lr=np.bool_(True)), r"SGD\.lr"),
                       (lambda: ps.Adam(betas=(0.9, True)), r"Adam\.betas")):
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=rf"^{name}=True: a bool, where a number is expected$"):
            make()
    # float() takes these too, dropping an imaginary part or a duration's
    # unit (probe of dc821b2).
    for make, name, bad in ((lambda v: ps.SGD(lr=v), r"SGD\.lr", np.complex128(0.5 + 1j)),
                            (lambda v: ps.Server(lease_timeout=v), "lease_timeout", b"0.5"),
                            (lambda v: ps.Client(["127.0.0.1:1"], timeout=v), "timeout",
                             np.timedelta64(5, "ns")),
                            (lambda v: collective.StoreClient("127.0.0.1:1", timeout=v),
                             "timeout", "0.5"),
                            (lambda v: collective.StoreClient("127.0.0.1:1", timeout=v),
                             "timeout", True)):
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=rf"^{name}={re.escape(repr(bad))}: (not a number|a bool)"):
            make(bad)
    # float() takes its item (probe).
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^SGD\.lr=array\(True, dtype=object\): a bool, where a number is "
                             r"expected$"):
        ps.SGD(lr=np.array(True, dtype=object))
    # A bool option still takes one.
    with ps.Server(reject_nonfinite=False) as server:
        assert server.address


def test_a_request_over_the_servers_limit_names_the_limits():
    """A probe's init over max_message_bytes said only gRPC's 'Received
    message larger than max (400032 vs. 4096)'."""
    with ps.Server(max_message_bytes=4096) as server, ps.Client([server.address]) as c:
        with pytest.raises(deepnex.ResourceExhaustedError) as e:
            c.init({"w": np.zeros(100000, np.float32)})
        assert str(e.value) == (
            f"init to {server.address}: Received message larger than max (400032 vs. 4096): a "
            "request over the server's max_message_bytes; give the client partition_bytes and "
            "request_bytes below it, or the server a larger max_message_bytes")
    with ps.Server(max_message_bytes=4096) as server, \
            ps.Client([server.address], partition_bytes=1024, request_bytes=2048) as c:
        c.init({"w": np.zeros(100000, np.float32)})  # as it says


def test_the_same_count_in_another_shape_is_refused():
    """A probe's (3, 4) gradient of a (4, 3) weight, and a flat one, were
    applied element by element without an error; pull_into filled them."""
    with ps.Server(mode="async", optimizer=ps.Sum()) as server, ps.Client([server.address]) as c:
        c.init({"w": np.arange(12, dtype=np.float32).reshape(4, 3)})
        for shape in ((3, 4), (12,), (4, 3, 1)):
            with pytest.raises(deepnex.InvalidArgumentError,
                               match=re.escape(f'push of "w": got shape [{", ".join(map(str, shape))}] '
                                               'float32, the tensor is [4, 3] float32 (reshape it '
                                               'to match)')):
                c.push({"w": np.ones(shape, np.float32)})
            with pytest.raises(deepnex.InvalidArgumentError, match="got shape"):
                c.pull_into({"w": np.empty(shape, np.float32)})
        np.testing.assert_array_equal(c.pull("w")["w"], np.arange(12, dtype=np.float32).reshape(4, 3))


def test_nonfinite_refused_or_accepted_by_option():
    g = np.array([1.0, np.nan], np.float32)
    with ps.Server(mode="async") as server, ps.Client([server.address]) as c:
        c.init({"w": np.zeros(2, np.float32)})
        with pytest.raises(deepnex.InvalidArgumentError, match="NaN or Inf"):
            c.push({"w": g})
        np.testing.assert_array_equal(c.pull("w")["w"], [0, 0])
    with ps.Server(mode="async", reject_nonfinite=False, optimizer=ps.Sum()) as server, \
            ps.Client([server.address]) as c:
        c.init({"w": np.zeros(2, np.float32)})
        c.push({"w": g})
        assert np.isnan(c.pull("w")["w"][1])


@pytest.mark.parametrize("servers,request_bytes", [(2, 4 << 20), (1, 64)])
def test_a_push_refused_for_a_nan_applies_nothing_whatever_requests_carry_it(servers, request_bytes):
    """A push goes to the servers in one request per server (and per
    request_bytes); each refused its own bad part whole, but the others were
    applied, and the message said "nothing applied" (found by a probe). A
    sync worker pushing again then stood a round ahead on some partitions
    and its pull hung."""
    running = [ps.Server(mode="sync", num_workers=2, optimizer=ps.Sum(), reduction="sum")
               for _ in range(servers)]
    addresses = [s.address for s in running]
    try:
        clients = [ps.Client(addresses, worker_id=w, partition_bytes=64,
                             request_bytes=request_bytes, timeout=20) for w in range(2)]
        clients[0].init({"a": np.zeros(64, np.float32), "b": np.zeros(4, np.float32)})
        bad = np.ones(64, np.float32)
        bad[63] = np.nan  # in the last of a's four partitions
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=r'push of "a": the gradient holds NaN or Inf \(element 63 is NaN '
                                 r'or Inf\); refused, nothing applied'):
            clients[0].push({"a": bad, "b": np.ones(4, np.float32)})
        with ps.Client(addresses, worker_id=-1, partition_bytes=64) as observer:
            values = observer.pull(["a", "b"])
            assert not values["a"].any() and not values["b"].any()
            assert observer.version("a") == observer.version("b") == 0
        # The step again, clean, with the other worker: one whole round.
        both = [np.full(64, 1 + w, np.float32) for w in range(2)]
        results = [None, None]

        def step(w):
            results[w] = clients[w].push_pull({"a": both[w]})["a"]
        run_threads(2, step, timeout=60, what="a worker's step")
        for w in range(2):
            np.testing.assert_array_equal(results[w], np.full(64, 3, np.float32))
        for c in clients:
            c.close()
    finally:
        for s in running:
            s.stop()


def test_a_client_that_never_pushed_leaves_its_worker_awaited():
    """A probe made a client to `describe` before training and closed it:
    its Leave marked worker 0 as gone, worker 1's first round completed
    alone, and the real worker 0's pull timed out. A worker that pushed and
    left is gone for good, as before."""
    with ps.Server(mode="sync", num_workers=2, optimizer=ps.Sum(), reduction="sum") as server:
        def state(w):
            with ps.Client([server.address], worker_id=-1) as observer:
                return observer.stats()[0]["workers"][w]["state"]

        with ps.Client([server.address], worker_id=0) as look:
            look.init({"w": np.zeros(4, np.float32)})
            assert look.describe(["w"])["w"] == ("float32", (4,))
        assert state(0) == "expected"
        # leave(): gone for good though it pushed nothing (an elastic job's
        # rank 0 releasing a slot its generation leaves empty); the join
        # after it takes the slot again.
        ps.Client([server.address], worker_id=1).leave()
        assert state(1) == "left"
        clients = [ps.Client([server.address], worker_id=w, timeout=20) for w in range(2)]
        results = [None, None]

        def step(w):
            results[w] = clients[w].push_pull({"w": np.full(4, 1 + w, np.float32)})["w"]
        run_threads(2, step, timeout=60, what="a worker's step")
        for w in range(2):
            np.testing.assert_array_equal(results[w], np.full(4, 3, np.float32))
        clients[0].close()
        assert state(0) == "left"
        clients[1].close()


def test_a_key_that_is_not_utf8_is_refused_naming_it():
    """A probe's bytes key b"\\xff\\xfe" gave an empty UnimplementedError and
    protobuf's log lines: keys travel as protobuf strings."""
    with ps.Server(mode="async") as server, ps.Client([server.address]) as c:
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=r'init: key "\\xff\\xfe" is not UTF-8 text'):
            c.init({b"\xff\xfe": np.zeros(2, np.float32)})
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=r'describe: key "\\xc3" is not UTF-8 text'):
            c.pull([b"\xc3"])
        c.init({"é/ok": np.zeros(2, np.float32)})  # UTF-8 beyond ASCII is a key
        np.testing.assert_array_equal(c.pull("é/ok")["é/ok"], [0, 0])


def test_a_key_with_a_lone_surrogate_is_refused_naming_it():
    """A str key, checkpoint name or directory with a lone surrogate
    (os.fsdecode of a file name that is not UTF-8) raised pybind11's
    TypeError "incompatible function arguments" from every call; it is
    refused naming it, and the server serves on."""
    bad = "w\udc80"
    a = np.zeros(2, np.float32)
    with ps.Server(mode="async", optimizer=ps.Sum()) as server, \
            ps.Client([server.address]) as c:
        c.init({"w": a})
        calls = {"init": lambda: c.init({bad: a}),
                 "push": lambda: c.push({bad: a}),
                 "pull": lambda: c.pull_into({bad: np.empty(2, np.float32)}),
                 "describe": lambda: c.pull([bad])}
        calls_too = [lambda: c.push_pull({bad: a}), lambda: c.push_async({bad: a}),
                     lambda: c.pull_async(bad), lambda: c.version(bad),
                     lambda: c.describe([bad]),
                     lambda: c.push_pull_into({"w": a}, {bad: np.empty(2, np.float32)})]
        for op, call in calls.items():
            with pytest.raises(deepnex.InvalidArgumentError) as e:
                call()
            assert str(e.value) == f"{op}: key 'w\\udc80' is not UTF-8 text"
        for call in calls_too:
            with pytest.raises(deepnex.InvalidArgumentError, match=r"key 'w\\udc80' is not UTF-8"):
                call()
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=r"^checkpoint: name 'w\\udc80' is not UTF-8 text$"):
            c.checkpoint(bad)
        with pytest.raises(deepnex.InvalidArgumentError, match=r"^checkpoint: dir '/tmp/w\\udc80'"):
            server.checkpoint("/tmp/" + bad)
        c.push({"w": np.ones(2, np.float32)})
        np.testing.assert_array_equal(c.pull("w")["w"], [1, 1])


def test_worker_id_outside_range():
    with ps.Server(num_workers=2) as server:
        with pytest.raises(deepnex.InvalidArgumentError, match="worker_id 2 is outside 0..1"):
            ps.Client([server.address], worker_id=2)


def test_a_server_listed_twice_or_in_another_order_is_refused():
    # Parts are placed by a server's position in the client's list: a server
    # listed twice, or clients that disagree on the order, would mix
    # different parts under one key (a pull then read other elements).
    a, b = ps.Server(num_workers=2, optimizer=ps.Sum()), ps.Server(num_workers=2, optimizer=ps.Sum())
    try:
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=rf'servers\[1\] "{a.address}": listed twice \(also servers\[0\]\)'):
            ps.Client([a.address, a.address], worker_id=0)
        port = a.address.rsplit(":", 1)[1]
        with pytest.raises(deepnex.FailedPreconditionError,
                           match=rf'servers\[1\] "localhost:{port}": register: worker 0 lists this '
                                 r"server as servers\[1\] of 2, but worker 0 listed it as "
                                 r"servers\[0\] of 2"):
            ps.Client([a.address, f"localhost:{port}"], worker_id=0)
        with ps.Client([a.address, b.address], worker_id=0, partition_bytes=64) as c0:
            with pytest.raises(deepnex.FailedPreconditionError,
                               match=rf'servers\[0\] "{b.address}": register: worker 1 lists this '
                                     r"server as servers\[0\] of 2, but worker 0 listed it as "
                                     r"servers\[1\] of 2: every client must list the same servers"):
                ps.Client([b.address, a.address], worker_id=1, partition_bytes=64)
            with pytest.raises(deepnex.FailedPreconditionError, match=r"servers\[0\] of 1"):
                ps.Client([a.address], worker_id=1, partition_bytes=64)
            # The servers still serve the clients that list them alike.
            with ps.Client([a.address, b.address], worker_id=1, partition_bytes=64) as c1:
                x = np.arange(64, dtype=np.float32)
                c0.init({"x": x})
                run_workers(2, lambda w: [c0, c1][w].push({"x": np.full(64, w + 1, np.float32)}))
                np.testing.assert_array_equal(c1.pull(["x"])["x"], x + 1.5)  # the mean of 1 and 2
    finally:
        a.stop()
        b.stop()


def test_tokens_string_and_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with ps.Server(token_file=str(token_file)) as server:
        with pytest.raises(deepnex.UnauthenticatedError):
            ps.Client([server.address])
        with pytest.raises(PermissionError):
            ps.Client([server.address], token="wrong")
        with ps.Client([server.address], token="s3cret") as c:
            c.init({"w": np.zeros(1, np.float32)})
        with ps.Client([server.address], token_file=str(token_file)) as c:
            assert c.describe(["w"]) == {"w": ("float32", (1,))}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with ps.Server(tls_cert_file=str(cert), tls_key_file=str(key)) as server:
        with ps.Client([server.address], tls_ca_file=str(cert)) as c:
            c.init({"w": np.ones(3, np.float32)})
            np.testing.assert_array_equal(c.pull("w")["w"], np.ones(3))
        with pytest.raises(deepnex.UnavailableError):
            ps.Client([server.address], timeout=1.0)  # plaintext to a TLS server
    # A key of another certificate, or files that hold none, are refused at
    # the start: the server came up, served no one and leaked each
    # connection (probe of c282610).
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-out", str(other)], check=True,
                   capture_output=True)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem\n")
    for c, k, message in (
            (cert, other, rf"^tls_key_file: {other} is not the private key of {cert}'s "
                          r"certificate \(.*\)$"),
            (junk, key, rf"^tls_cert_file: {junk} holds no PEM certificate \(.*\)$"),
            (cert, junk, rf"^tls_key_file: {junk} holds no PEM private key \(.*\)$")):
        with pytest.raises(deepnex.InvalidArgumentError, match=message):
            ps.Server(tls_cert_file=str(c), tls_key_file=str(k))


def test_optimizer_arguments_are_validated():
    with pytest.raises(deepnex.InvalidArgumentError, match="lr=-1"):
        ps.Server(optimizer=ps.SGD(lr=-1))
    with pytest.raises(deepnex.InvalidArgumentError, match="mode"):
        ps.Server(mode="bulk")
    with pytest.raises(deepnex.InvalidArgumentError, match="optimizer"):
        ps.Server(optimizer="lbfgs")


# ---- processes: the deepnex-ps daemon and worker processes

WORKER = textwrap.dedent("""
    import sys, numpy as np, deepnex
    addrs, w, workers, steps = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    c = deepnex.ps.Client(addrs, worker_id=w, partition_bytes=512, timeout=60)
    c.init({"w": np.zeros(1000, np.float32)})
    for t in range(1, steps + 1):
        g = np.full(1000, (w + 1) * t, np.float32)
        out = c.push_pull({"w": g})["w"]
    expected = -0.5 * sum((v + 1) * t for v in range(workers) for t in range(1, steps + 1))
    assert (out == expected).all(), (out[:4], expected)
    print("ok", w)
""")


def start_daemon(*args):
    if not os.path.exists(PS_BIN):
        pytest.skip(f"{PS_BIN} not built")
    proc = subprocess.Popen([PS_BIN, "--listen", "127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("deepnex-ps listening on "), line + proc.stderr.read()
    return proc, line.split()[3]


def stop_daemon(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0


@pytest.mark.parametrize("workers,servers", [(2, 1), (4, 2)])
def test_sync_workers_as_processes_against_daemons(workers, servers):
    daemons = [start_daemon("--mode", "sync", "--workers", str(workers), "--optimizer", "sgd",
                            "--lr", "0.5", "--reduction", "sum") for _ in range(servers)]
    try:
        addrs = ",".join(a for _, a in daemons)
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, addrs, str(w), str(workers), "5"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for w in range(workers)]
        for p in procs:
            try:
                out, _ = p.communicate(timeout=120)
            finally:
                p.kill()
            assert p.returncode == 0, out
    finally:
        for proc, _ in daemons:
            stop_daemon(proc)


def test_daemon_help_and_bad_flags():
    if not os.path.exists(PS_BIN):
        pytest.skip(f"{PS_BIN} not built")
    out = subprocess.run([PS_BIN, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    for flag in ["--listen", "--mode", "--workers", "--optimizer", "--lr", "--token-file",
                 "--momentum", "--reduction", "--accept-nonfinite", "--max-message", "--tls-cert"]:
        assert flag in out.stdout
    for argv, needle in [(["--bogus"], "unknown flag"), (["--workers", "x"], "--workers"),
                         (["--mode", "bulk"], "mode"), (["--optimizer", "lbfgs"], "lbfgs"),
                         (["--lr", "-1"], "lr"), (["--max-message", "12XB"], "12XB"),
                         (["--workers", "0"], "num_workers=0: must be 1..65536"),
                         # A probe's 1M workers took 1 GB and a 755 MB /metrics.
                         (["--workers", "1000000"], "num_workers=1000000: must be 1..65536"),
                         (["--metrics-port", "-1"], "--metrics-port -1: not a port (0-65535)"),
                         (["--metrics-port", "70000"], "--metrics-port 70000: not a port"),
                         (["--lr"], "needs a value")]:
        bad = subprocess.run([PS_BIN, *argv], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2, (argv, bad.stderr)
        assert needle in bad.stderr and bad.stderr.count("\n") == 1, (argv, bad.stderr)


def test_daemon_with_token_file(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("tok-a alice user\n")
    proc, addr = start_daemon("--token-file", str(token_file), "--mode", "async")
    try:
        with pytest.raises(deepnex.UnauthenticatedError):
            ps.Client([addr], timeout=5)
        with ps.Client([addr], token="tok-a") as c:
            c.init({"w": np.zeros(2, np.float32)})
    finally:
        stop_daemon(proc)
