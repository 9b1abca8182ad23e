"""fork() after deepnex started gRPC: the child gets a clear error at its
first deepnex call instead of hanging, and the parent goes on.

Each case runs a script in a fresh interpreter (so that what this pytest
process did with deepnex does not count) which forks with multiprocessing
and prints what happened as JSON; the children run with timeouts.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

deepnex = pytest.importorskip("deepnex")

WHY = ("this process (pid {child}) was forked from pid {parent} after that process had "
       "started gRPC, which does not survive fork(); start the processes that use deepnex "
       "with multiprocessing.get_context(\"spawn\") or multiprocessing.set_start_method"
       "(\"spawn\"), or fork before creating any deepnex server or client")

# Helpers every script starts with: run(ctx, target, *args) runs target in a
# child of context ctx and returns what it put on the queue, its pid and its
# exit code; attempt(fn) is [error class, message], or ["ok", result].
PRELUDE = textwrap.dedent("""
    import json, multiprocessing, os, sys
    import numpy as np
    import deepnex
    from deepnex import collective, ps

    def attempt(fn):
        try:
            return ["ok", fn()]
        except deepnex.DeepnexError as e:
            return [type(e).__name__, str(e)]

    def child_main(q, target, args):
        q.put(target(*args))

    def run(ctx, target, *args):
        q = ctx.Queue()
        p = ctx.Process(target=child_main, args=(q, target, args))
        p.start()
        out = q.get(timeout=60)
        p.join(60)
        if p.is_alive():
            p.kill()
        return {"out": out, "pid": p.pid, "exitcode": p.exitcode}
""")


def run_script(tmp_path, body):
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    # In a session of its own: a child that hung is killed with its parent
    # (it would hold the output pipes open).
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the script did not finish in 180 s:\n{out}{err}")
    assert proc.returncode == 0, out + err
    return json.loads(out.strip().splitlines()[-1])


def test_child_forked_after_a_store_is_refused_and_the_parent_goes_on(tmp_path):
    r = run_script(tmp_path, """
        def child(address, client, store):
            return {
                "new_client": attempt(lambda: collective.StoreClient(address, timeout=5)),
                "inherited_client": attempt(lambda: client.get("k", timeout=1).decode()),
                "new_store": attempt(lambda: collective.Store("127.0.0.1:0").address),
                # The parent's: nothing to stop here (it crashed the child).
                "inherited_store_stop": attempt(store.stop),
            }

        if __name__ == "__main__":
            store = collective.Store("127.0.0.1:0")
            client = collective.StoreClient(store.address, timeout=5)
            client.set("k", "parent")
            r = run(multiprocessing.get_context("fork"), child, store.address, client, store)
            # The parent's store, client and new clients keep working.
            client.set("k2", "after")
            r["parent"] = [client.get("k").decode(),
                           collective.StoreClient(store.address).get("k2").decode()]
            r["parent_pid"] = os.getpid()
            r["address"] = store.address
            print(json.dumps(r))
    """)
    why = WHY.format(child=r["pid"], parent=r["parent_pid"])
    assert r["exitcode"] == 0
    assert r["out"] == {
        "new_client": ["FailedPreconditionError", f"dialing store at {r['address']}: {why}"],
        "inherited_client": ["FailedPreconditionError", f"store client: {why}"],
        "new_store": ["FailedPreconditionError", f"store server: {why}"],
        "inherited_store_stop": ["ok", None],
    }
    assert r["parent"] == ["parent", "after"]


def test_child_forked_after_a_ps_client_is_refused_and_the_parent_goes_on(tmp_path):
    r = run_script(tmp_path, """
        def child(address, client, server):
            out = {
                "inherited_pull": attempt(lambda: client.pull("w")["w"].tolist()),
                "new_client": attempt(lambda: ps.Client([address], worker_id=1)),
                "new_server": attempt(lambda: ps.Server(address="127.0.0.1:0").address),
                # It wrote the child's copy of the tensors, under the name's lock.
                "inherited_checkpoint": attempt(lambda: server.checkpoint("ckpt")),
            }
            # The parent's server: nothing of it runs here to stop or wait for
            # (stop crashed the child, joining a thread that was not forked).
            with server:
                out["inherited_wait"] = attempt(server.wait)
            return out

        if __name__ == "__main__":
            server = ps.Server(address="127.0.0.1:0", mode="async", optimizer=ps.Sum())
            client = ps.Client([server.address], worker_id=0)
            client.init({"w": np.ones(4, np.float32)})
            r = run(multiprocessing.get_context("fork"), child, server.address, client, server)
            client.push({"w": np.full(4, 2, np.float32)})
            with ps.Client([server.address], worker_id=-1) as observer:
                r["parent"] = [client.pull("w")["w"].tolist(), observer.pull("w")["w"].tolist()]
            r["parent_pid"] = os.getpid()
            r["address"] = server.address
            print(json.dumps(r))
    """)
    why = WHY.format(child=r["pid"], parent=r["parent_pid"])
    assert r["exitcode"] == 0
    assert r["out"] == {
        "inherited_pull": ["FailedPreconditionError", f"ps client: {why}"],
        "new_client": ["FailedPreconditionError", f"dialing ps server at {r['address']}: {why}"],
        "new_server": ["FailedPreconditionError", f"ps server: {why}"],
        "inherited_checkpoint": ["FailedPreconditionError", f"ps server: {why}"],
        "inherited_wait": ["ok", None],
    }
    assert r["parent"] == [[3.0] * 4, [3.0] * 4]
    assert not (tmp_path / "ckpt").exists()


def test_child_forked_after_a_communicator_is_refused_and_the_parent_goes_on(tmp_path):
    r = run_script(tmp_path, """
        def child(comm):
            return {"inherited_allreduce": attempt(lambda: comm.allreduce(np.ones(4, np.float32)))}

        if __name__ == "__main__":
            store = collective.Store("127.0.0.1:0")
            comm = collective.Communicator(0, 1, store=store.address, timeout=10)
            r = run(multiprocessing.get_context("fork"), child, comm)
            x = np.ones(4, np.float32)
            comm.allreduce(x, op="sum")
            r["parent"] = x.tolist()
            r["parent_pid"] = os.getpid()
            print(json.dumps(r))
    """)
    why = WHY.format(child=r["pid"], parent=r["parent_pid"])
    assert r["exitcode"] == 0
    assert r["out"] == {"inherited_allreduce": ["FailedPreconditionError", f"communicator: {why}"]}
    assert r["parent"] == [1.0] * 4


def test_spawned_child_works_as_the_error_advises(tmp_path):
    r = run_script(tmp_path, """
        def child(address):
            c = collective.StoreClient(address, timeout=10)
            c.set("from_child", "spawned")
            return attempt(lambda: c.get("k").decode())

        if __name__ == "__main__":
            store = collective.Store("127.0.0.1:0")
            client = collective.StoreClient(store.address, timeout=5)
            client.set("k", "parent")
            r = run(multiprocessing.get_context("spawn"), child, store.address)
            r["parent"] = client.get("from_child").decode()
            print(json.dumps(r))
    """)
    assert r["exitcode"] == 0
    assert r["out"] == ["ok", "parent"]
    assert r["parent"] == "spawned"


def test_child_forked_before_any_grpc_use_may_use_deepnex(tmp_path):
    r = run_script(tmp_path, """
        def child():
            with collective.Store("127.0.0.1:0") as store:
                c = collective.StoreClient(store.address, timeout=5)
                c.set("k", "child")
                return attempt(lambda: c.get("k").decode())

        if __name__ == "__main__":
            r = run(multiprocessing.get_context("fork"), child)
            with collective.Store("127.0.0.1:0") as store:  # and the parent after it
                c = collective.StoreClient(store.address, timeout=5)
                c.set("k", "parent")
                r["parent"] = c.get("k").decode()
            print(json.dumps(r))
    """)
    assert r["exitcode"] == 0
    assert r["out"] == ["ok", "child"]
    assert r["parent"] == "parent"


def test_a_child_that_drops_what_it_inherited_and_exits_normally_ends_with_its_code(tmp_path):
    """os.fork, then `del` and a normal exit, which run destructors (a
    multiprocessing child ends with os._exit and runs none): a probe's child
    hung for ever in `del client` (a condition variable the parent's threads
    waited on) and crashed at exit. Inherited objects are kept instead."""
    r = run_script(tmp_path, """
        import signal
        if __name__ == "__main__":
            server = ps.Server(address="127.0.0.1:0", mode="async", optimizer=ps.Sum())
            client = ps.Client([server.address], worker_id=0)
            client.init({"w": np.ones(4, np.float32)})
            store = collective.Store("127.0.0.1:0")
            comm = collective.Communicator(0, 1, store=store.address)
            statuses = []
            for drop in (True, False):
                pid = os.fork()
                if pid == 0:
                    signal.alarm(30)  # a hang ends the child (SIGALRM), not the test
                    attempt(lambda: client.pull("w"))
                    if drop:
                        del client, comm, server, store
                    sys.exit(3)
                statuses.append(os.waitpid(pid, 0)[1])
            client.push({"w": np.full(4, 2, np.float32)})
            print(json.dumps({"statuses": statuses, "w": client.pull("w")["w"].tolist()}))
    """)
    assert r == {"statuses": [3 << 8, 3 << 8], "w": [3.0, 3.0, 3.0, 3.0]}
