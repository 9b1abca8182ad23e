"""Runs a job on this machine without a launcher: a rendezvous store and the
parameter servers in this process, the workers as child processes with the
job environment (ARCHITECTURE.md), their output prefixed with their rank.

    codes = run_local([sys.executable, "train.py", "--epochs", "5"],
                      workers=2, ps=1, mode="sync", optimizer=deepnex.ps.SGD(lr=0.1))

The examples start themselves through it when no launcher gave them a job
environment; ``deepnex run`` is the full launcher (allocation, containers,
restarts).
"""

import os
import subprocess
import sys
import threading
import time
import uuid

from . import _C

__all__ = ["run_local", "parse_mode"]


def parse_mode(mode):
    """("sync"|"ssp"|"async"|"allreduce", staleness) from "sync", "async",
    "allreduce" or "ssp:S"."""
    name, _, staleness = str(mode).partition(":")
    if name == "ssp" and staleness.isdigit():
        return name, int(staleness)
    if name in ("sync", "async", "allreduce") and not staleness:
        return name, 0
    from .errors import InvalidArgumentError
    raise InvalidArgumentError(f'mode: "{mode}" is not one of sync, ssp:S, async, allreduce')


def _pump(stream, prefix, out, lock):
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()
    stream.close()


def run_local(command, workers=2, ps=1, mode="sync", optimizer=None, job_id=None,
              env=None, timeout=None, out=None):
    """Runs ``command`` (an argv list) as ``workers`` processes of one job and
    returns their exit codes, in rank order.

    ps: parameter servers to start (mode "allreduce" starts none); optimizer:
    theirs (deepnex.ps.SGD(...), ...). env: extra variables for the workers.
    timeout: seconds; the workers still running then are killed (exit code
    -9). out: where the prefixed lines go (default sys.stdout). Ctrl-C kills
    the workers and stops the servers before it propagates.
    """
    from .collective import Store
    from .ps import Server

    name, staleness = parse_mode(mode)
    out = out or sys.stdout
    job_id = job_id or f"local-{uuid.uuid4().hex[:8]}"
    store = Store("127.0.0.1:0")
    servers = []
    procs = []
    try:
        if name != "allreduce":
            servers = [Server("127.0.0.1:0", mode=name, num_workers=workers,
                              optimizer=optimizer, staleness=staleness, name=f"ps{i}")
                       for i in range(ps)]
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        base = dict(os.environ)
        base["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, base.get("PYTHONPATH")) if p)
        base["PYTHONUNBUFFERED"] = "1"
        base.update(env or {})
        lock = threading.Lock()
        pumps = []
        for rank in range(workers):
            job = {"DEEPNEX_JOB_ID": job_id, "DEEPNEX_ROLE": "worker",
                   "DEEPNEX_RANK": str(rank), "DEEPNEX_WORLD_SIZE": str(workers),
                   "DEEPNEX_LOCAL_RANK": str(rank), "DEEPNEX_STORE_ADDR": store.address}
            if servers:
                job["DEEPNEX_PS_ADDRS"] = ",".join(s.address for s in servers)
            proc_env = dict(base)
            proc_env.update(_C.Context.from_env(job).to_env())
            p = subprocess.Popen(command, env=proc_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[{rank}] ", out, lock),
                                 daemon=True)
            t.start()
            pumps.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                codes.append(p.wait(left))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        for t in pumps:
            t.join(5)
        return codes
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in servers:
            s.stop()
        store.stop()
