"""Elastic training: ``deepnex.elastic``, for jobs started with
``deepnex run --workers MIN:MAX`` (Horovod's ``hvd.elastic`` API)::

    import deepnex.elastic, deepnex.torch

    sharder = deepnex.data.Sharder(len(dataset), ctx.world_size, ctx.rank)
    state = deepnex.torch.TorchState(model, optimizer, sharder=sharder, step=0)

    @deepnex.elastic.run
    def train(state):
        while state.sharder.epoch < epochs:
            for batch in state.sharder.batches(32):
                loss = loss_fn(state.model(x[batch]), y[batch])   # a DDP model
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                state.step += 1
                state.commit()            # a step boundary

    train(state)

The runner publishes each membership in the job's store ("elastic/members/<G>",
then "elastic/generation"). ``state.commit()`` keeps a copy of the state and
reads the generation key: a newer generation there is a
``HostsUpdatedInterrupt``, and ``run`` resizes to it. When a collective fails
(a peer died or stalled; the state is restored to its last commit), ``run``
tells the runner (WAITING_KEY) and waits for the next membership (up to twice
DEEPNEX_ELASTIC_TIMEOUT seconds, default 120; DeadlineExceededError naming
the generation it waited for): the runner publishes one without the members
that died or that reported nothing within DEEPNEX_ELASTIC_TIMEOUT of the
first report (stalled: stopped, hung; it stops them), or, when every member
reported, the same members again. ``run`` then re-forms the
communicator with the new rank and world size under a prefix of that
generation (``state.communicator``; the same timeout bounds each collective),
and rank 0 (a survivor) broadcasts the parameters, the optimizer state, the
counters and the data position; every sharder re-shards the epoch's
remaining items over the new world, and train is called again. A worker that
is not in the new membership exits with status 0, and so does one that
would join after a worker's train returned (DONE_KEY: the training is over,
and the runner grows the job no more). Each resize prints one line on
stderr: the worker's id, rank, world size and generation.

A peer partitioned away fails nothing (its connections stay open): a thread
of each allreduce worker aborts the communicator as soon as the runner
publishes a membership without it, so a collective blocked on it ends then,
not at its timeout; the step goes back to its last commit.

Parameter-server jobs (DEEPNEX_PS_ADDRS set) keep their parameters on the
servers, which let workers join and shrink the rounds of lost ones; only the
counters and the data position follow the membership (rank 0's, through the
store; a worker a step apart from rank 0 at the resize repeats or skips at
most that step's batch), and ``ps_worker_id()`` gives each worker a server
slot of its own.

Without DEEPNEX_ELASTIC, ``run`` calls the function once and ``commit`` only
keeps the copy: the same script runs unchanged under a fixed world.
"""

import atexit
import copy
import functools
import math
import os
import pickle
import re
import sys
import threading
import time

import numpy as np

import deepnex
from . import collective as _collective
from .errors import (AbortedError, DeadlineExceededError, DeepnexError, InvalidArgumentError,
                     ResourceExhaustedError, UnavailableError)

__all__ = ["run", "State", "HostsUpdatedInterrupt", "ps_worker_id", "enabled"]

# Runner-written keys (the contract with `deepnex run --workers MIN:MAX`).
GENERATION_KEY = "elastic/generation"
MEMBERS_KEY = "elastic/members/{}"
# Written by a worker whose collective failed in generation G before it waits
# for G + 1: the runner drops the members that report nothing within
# DEEPNEX_ELASTIC_TIMEOUT of the first report (stalled: alive, deaf), and
# re-forms the same members when all report.
WAITING_KEY = "elastic/waiting/{}/{}"
# Written by a worker whose training function returned: the job grows no
# more, and a worker that has not joined yet exits 0 (its peers are done).
DONE_KEY = "elastic/done"

# A failed collective: a peer died (the transport broke) or stalled.
_PEER_ERRORS = (UnavailableError, AbortedError, DeadlineExceededError)


class HostsUpdatedInterrupt(DeepnexError):
    """Raised by ``State.commit()`` / ``check_host_updates()`` when the
    runner published a newer membership; ``run`` catches it and resizes."""


def _positive_seconds(text, name):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:  # nan and inf too
        raise InvalidArgumentError(f"{name}={text!r} is not a positive number of seconds")
    return value


def _decimal(text):
    """A decimal integer as the C++ side reads one (int() also takes "1_0",
    " 1 " and "+1"); ValueError otherwise."""
    if not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(text)
    return int(text)


def _integer(environ, name):
    text = environ.get(name)
    if text is None:
        raise InvalidArgumentError(f"{name} is not set; an elastic worker needs it "
                                   f"(deepnex run --workers MIN:MAX sets it)")
    try:
        return _decimal(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={text!r} is not an integer") from None


class _Job:
    """This worker's place in the elastic job: its id, the generation it is
    in, its rank and world there, and the communicator of that generation
    (allreduce mode). One per process."""

    def __init__(self, environ):
        spec = environ["DEEPNEX_ELASTIC"]
        try:
            self.min_workers, self.max_workers = (_decimal(x) for x in spec.split(":"))
        except ValueError:
            raise InvalidArgumentError(f"DEEPNEX_ELASTIC={spec!r} is not MIN:MAX") from None
        if not 1 <= self.min_workers <= self.max_workers:
            raise InvalidArgumentError(f"DEEPNEX_ELASTIC={spec!r}: needs 1 <= MIN <= MAX")
        self.worker_id = environ.get("DEEPNEX_WORKER_ID", "")
        if not self.worker_id:
            raise InvalidArgumentError("DEEPNEX_WORKER_ID is not set; an elastic worker needs "
                                       "it (deepnex run --workers MIN:MAX sets it)")
        self.generation = _integer(environ, "DEEPNEX_ELASTIC_GENERATION")
        ctx = deepnex.init(environ)
        if not ctx.store_addr:
            raise InvalidArgumentError("DEEPNEX_STORE_ADDR is not set; an elastic job "
                                       "publishes its membership in its store")
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.store_addr, self.token = ctx.store_addr, ctx.token or None
        self.ps_addrs = list(ctx.ps_addrs)
        self.ps_mode = bool(self.ps_addrs)
        self.base = f"{ctx.job_id or 'deepnex'}/elastic"
        self.timeout = _positive_seconds(environ.get("DEEPNEX_ELASTIC_TIMEOUT", "120"),
                                         "DEEPNEX_ELASTIC_TIMEOUT")
        self.store = _collective.StoreClient(self.store_addr, timeout=self.timeout,
                                             token=self.token)
        self.comm = None
        # Guards generation and comm against the watcher thread (see watch()).
        self._lock = threading.Condition()
        self._watcher = None
        self._stopping = False
        self.members = []  # of the generation adopted last
        self.previous = []  # of the one before
        self.formed = False  # a membership adopted (communicator, state synced)

    def latest_generation(self):
        value = self.store.get(GENERATION_KEY)
        try:
            return _decimal(value.decode())
        except (UnicodeDecodeError, ValueError):
            raise InvalidArgumentError(f"the store's {GENERATION_KEY!r} is {value!r}, not a "
                                       f"generation number") from None

    def wait_for(self, generation, why, timeout=None):
        """Waits until membership `generation` is published, up to `timeout`
        seconds (the job's timeout by default); returns the newest
        generation then."""
        timeout = timeout or self.timeout
        try:
            self.store.wait([MEMBERS_KEY.format(generation)], timeout=timeout)
        except DeadlineExceededError:
            raise DeadlineExceededError(
                f"elastic worker {self.worker_id}: waited {timeout:g} s ({why}) for "
                f"generation {generation}, which never came ({GENERATION_KEY} is "
                f"{self.store.get(GENERATION_KEY).decode()}); DEEPNEX_ELASTIC_TIMEOUT sets "
                f"the wait") from None
        return max(generation, self.latest_generation())

    def wait_keys(self, keys, what):
        """Waits until `keys` are set, up to the timeout (DeadlineExceededError
        saying `what` it waited for); HostsUpdatedInterrupt as soon as a newer
        generation is published, since the awaited peers may be there."""
        if not keys:
            return
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"elastic worker {self.worker_id}: waited {self.timeout:g} s for {what} "
                    f"in generation {self.generation}")
            try:
                self.store.wait(keys, timeout=min(left, 1.0))
                return
            except DeadlineExceededError:
                latest = self.latest_generation()
                if latest > self.generation:
                    raise HostsUpdatedInterrupt(
                        f"elastic worker {self.worker_id}: generation {latest} is published "
                        f"while waiting for {what} in generation {self.generation}") from None

    def adopt(self, generation):
        """Takes membership `generation`: rank and world size, and (allreduce)
        a communicator of it; SystemExit(0) if this worker is not a member.
        A newer generation published while forming is taken instead."""
        while True:
            members = self.store.get(MEMBERS_KEY.format(generation)).decode().split(",")
            if self.worker_id not in members:
                print(f"deepnex.elastic: worker {self.worker_id} is not in generation "
                      f"{generation} ({','.join(members)}); it is done", file=sys.stderr,
                      flush=True)
                raise SystemExit(0)
            with self._lock:
                self.generation = generation
                self._lock.notify_all()
            self.previous, self.members = self.members, members
            self.rank, self.world_size = members.index(self.worker_id), len(members)
            if self.ps_mode:
                return
            try:
                comm = _collective.Communicator(
                    self.rank, self.world_size, store=self.store_addr,
                    prefix=f"{self.base}/{generation}", timeout=self.timeout, token=self.token)
                with self._lock:
                    self.comm = comm
                return
            except _PEER_ERRORS:
                # Peers that read a newer generation went there instead.
                newer = self.latest_generation()
                if newer == generation:
                    raise
                generation = newer

    def report_failure(self, error):
        """After a failed collective: ends this worker's part in it (its
        peers blocked on it fail now, and report too, instead of at their
        timeout) and tells the runner (WAITING_KEY); returns how long to wait
        for the next generation: the runner's wait for the other members'
        reports, then the job's timeout for itself."""
        self.abort()
        self.store.set(WAITING_KEY.format(self.generation, self.worker_id), str(error)[:1024])
        return 2 * self.timeout

    def abort(self):
        with self._lock:
            if self.comm is not None:
                self.comm.abort()
                self.comm = None

    def watch(self):
        """Allreduce mode: from now on a thread aborts the communicator as
        soon as a newer generation is published, so that a collective blocked
        on a peer partitioned away (its connections stay open, nothing fails)
        ends at once instead of at its timeout, and run() resizes."""
        if self._watcher is not None or self.ps_mode:
            return
        self._watcher = threading.Thread(target=self._watch, name="deepnex-elastic",
                                         daemon=True)
        self._watcher.start()
        atexit.register(self._stop_watching)

    def _watch(self):
        while not self._stopping:
            with self._lock:
                generation = self.generation
            try:
                # Short waits: the thread ends within one at exit.
                self.store.wait([MEMBERS_KEY.format(generation + 1)], timeout=0.5)
            except DeepnexError:
                continue
            with self._lock:
                if self.generation == generation and self.comm is not None:
                    self.comm.abort()
                self._lock.wait_for(lambda: self.generation != generation or self._stopping)

    def _stop_watching(self):
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._watcher.join()


_job = {"job": None}


def __getattr__(name):
    """deepnex.elastic.TorchState, where Horovod users look for it (it lives
    in deepnex.torch, which imports torch)."""
    if name == "TorchState":
        from .torch import TorchState
        return TorchState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def enabled():
    """True in a worker of an elastic job (DEEPNEX_ELASTIC is set)."""
    return bool(os.environ.get("DEEPNEX_ELASTIC"))


def _current_job():
    """This process's _Job, or None outside an elastic job."""
    if _job["job"] is None and enabled():
        _job["job"] = _Job(os.environ)
    return _job["job"]


def ps_worker_id():
    """This worker's parameter-server worker id in an elastic PS job: a slot
    in [0, MAX) held by no other current member (its rank at its start when
    that one is free), claimed in the store, so that a joiner never takes the
    id of a live worker. Outside an elastic job: deepnex.init()'s rank.

    The servers wait in every round for each of their MAX workers that never
    registered; so rank 0 of generation 1 first releases the slots that
    generation leaves empty (registers and leaves as each), and a joiner
    registering there later is waited for again."""
    job = _current_job()
    if job is None:
        return deepnex.init().rank
    members = job.store.get(MEMBERS_KEY.format(job.generation)).decode().split(",")
    if job.generation == 1 and job.rank == 0:
        for slot in range(len(members), job.max_workers):
            _release_slot(job, slot)
    me = job.worker_id.encode()
    for slot in sorted(range(job.max_workers), key=lambda s: s != job.rank):
        key = f"{job.base}/ps_slot/{slot}"
        owner = job.store.compare_set(key, "", me)  # a free slot: ours
        if owner == me:
            return slot
        # "<id>" or "<id>:releasing": held while that worker is a member.
        if owner.decode().split(":")[0] in members:
            continue
        if job.store.compare_set(key, owner, me) == me:  # a departed worker's
            return slot
    raise ResourceExhaustedError(
        f"elastic worker {job.worker_id}: all {job.max_workers} parameter-server worker "
        f"slots are held by members of generation {job.generation}")


def _release_slot(job, slot):
    """Registers and leaves as worker `slot` on the servers, holding the slot
    meanwhile so that no joiner registers there before the leave."""
    from . import ps
    key = f"{job.base}/ps_slot/{slot}"
    releasing = f"{job.worker_id}:releasing".encode()
    if job.store.compare_set(key, "", releasing) != releasing:
        return  # a joiner holds it already
    ps.Client(job.ps_addrs, worker_id=slot, token=job.token).leave()
    job.store.compare_set(key, releasing, "")


def _stateful(value):
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


def _state_of(value):
    return value.state_dict() if _stateful(value) else value


class State:
    """What a worker keeps across resizes: a deepnex.data.Sharder (optional)
    and user counters given as keywords (``State(sharder=s, epoch=0,
    step=0)``, then ``state.epoch``). A counter with state_dict() and
    load_state_dict(), such as an LR scheduler, is restored in place, so
    that it keeps acting on its optimizer. deepnex.torch.TorchState adds a
    model and an optimizer.

    commit(): at a step boundary, keeps a copy and checks for a newer
    membership (the copy costs a model's size: with a large model commit
    every few steps; after a failed collective the steps since are redone).
    restore(): back to the last commit. sync(): rank 0's state to every
    worker (run() calls it after each resize). The properties
    rank, world_size, generation and communicator describe the current
    membership (outside an elastic job: deepnex.init()'s rank and world and
    no communicator).
    """

    def __init__(self, sharder=None, **counters):
        for name in counters:
            # State(sync=0) replaced the method, and a resize failed later.
            if name.startswith("_") or hasattr(type(self), name) or name in vars(self):
                raise InvalidArgumentError(
                    f"State({name}=...): {name!r} is a name of the state itself; "
                    "give the counter another name")
        self.sharder = sharder
        self._counters = sorted(counters)
        for name, value in counters.items():
            setattr(self, name, value)
        self._callbacks = []
        self._saved = None
        self.save()

    # What a subclass adds to the state: picklable (full: also what the
    # parameter servers keep in PS mode). A counter with state_dict() and
    # load_state_dict() (an LR scheduler, a GradScaler) is kept as its
    # state_dict and restored into the same object, which the training loop
    # and, for a scheduler, the optimizer still hold (as Horovod's state
    # handlers do); a copy put in its place would step nothing.
    def _capture(self, full=True):
        values = {n: getattr(self, n) for n in self._counters}
        out = {"counters": {n: copy.deepcopy(_state_of(v)) for n, v in values.items()},
               "stateful": sorted(n for n, v in values.items() if _stateful(v))}
        if self.sharder is not None:
            out["sharder"] = self.sharder.state_dict()
        return out

    def _apply(self, snapshot, world=None):
        for name, value in snapshot["counters"].items():
            if name not in snapshot["stateful"]:
                setattr(self, name, copy.deepcopy(value))
                continue
            # Saved as a state_dict: only the object it came from takes it
            # (a plain value put in its place would become that dict).
            target = getattr(self, name)
            if not _stateful(target):
                raise InvalidArgumentError(
                    f"State.{name}: saved as the state_dict of an object, and it now holds "
                    f"a {type(target).__name__}, which cannot load it: keep the object in "
                    f"the counter and change its state instead")
            try:
                target.load_state_dict(copy.deepcopy(value))
            except Exception as e:
                raise InvalidArgumentError(
                    f"State.{name}: its load_state_dict() failed: {e!r}") from e
        if self.sharder is not None:
            num_shards, shard = world or (self.sharder.num_shards, self.sharder.shard)
            self.sharder.reshard(num_shards, shard, snapshot["sharder"])

    def _dumps(self, snapshot):
        return pickle.dumps(snapshot)

    def _loads(self, payload):
        return pickle.loads(payload)

    def _on_communicator(self, comm):
        """A subclass re-binds what holds the old communicator."""

    def save(self):
        """Keeps a copy of the state (commit() without the membership check)."""
        self._saved = self._capture()

    def restore(self):
        """Back to the last save() / commit()."""
        self._apply(self._saved)

    def commit(self):
        """At a step boundary: save(), then check_host_updates()."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt when the runner has published a
        newer membership than this worker's (one store read)."""
        job = _current_job()
        if job is None or not job.formed:
            return
        latest = job.latest_generation()
        if latest > job.generation:
            raise HostsUpdatedInterrupt(
                f"elastic worker {job.worker_id}: generation {latest} is published "
                f"(this worker is in {job.generation})")

    def register_reset_callbacks(self, callbacks):
        """Functions called with no argument after each resize, once the
        state is synced (e.g. to scale the learning rate with world_size)."""
        self._callbacks.extend(callbacks)

    def sync(self):
        """Every worker takes rank 0's state; sharders re-shard it over the
        current world."""
        job = _current_job()
        if job is None:
            return
        if job.ps_mode:
            # No communicator to meet at: rank 0 waits until the members
            # new to it are up (else it would go on alone with the new
            # world's share of the data), then hands out its state.
            key = f"{job.base}/{job.generation}/state"
            if job.rank == 0:
                new = [m for m in job.members if m not in job.previous and m != job.worker_id]
                job.wait_keys([f"{job.base}/ready/{m}" for m in new],
                              f"new members {', '.join(new)} to start")
                job.store.set(key, self._dumps(self._capture(full=False)))
            else:
                job.store.set(f"{job.base}/ready/{job.worker_id}", "1")
                job.wait_keys([key], "rank 0's state")
            payload = job.store.get(key)
        else:
            payload = _broadcast_bytes(job.comm, self._dumps(self._capture())
                                       if job.rank == 0 else None)
        self._apply(self._loads(payload), world=(job.world_size, job.rank))
        self.save()

    @property
    def rank(self):
        job = _current_job()
        return job.rank if job is not None else deepnex.init().rank

    @property
    def world_size(self):
        job = _current_job()
        return job.world_size if job is not None else deepnex.init().world_size

    @property
    def generation(self):
        job = _current_job()
        return job.generation if job is not None else 0

    @property
    def communicator(self):
        """The current membership's communicator (allreduce mode; None in
        PS mode and outside an elastic job)."""
        job = _current_job()
        return job.comm if job is not None else None

    def _resize(self, job, generation):
        """Joins `generation` (or a newer one) and takes rank 0's state;
        SystemExit(0) when the training is over (DONE_KEY)."""
        job.abort()
        if job.store.check([DONE_KEY])[0]:
            print(f"deepnex.elastic: worker {job.worker_id}: the training is over "
                  f"({job.store.get(DONE_KEY).decode()} finished it); it is done",
                  file=sys.stderr, flush=True)
            raise SystemExit(0)
        job.adopt(generation)
        job.formed = True
        job.watch()
        print(f"deepnex.elastic: worker {job.worker_id} is rank {job.rank} of {job.world_size} "
              f"in generation {job.generation}", file=sys.stderr, flush=True)
        self._on_communicator(job.comm)
        self.sync()
        for callback in self._callbacks:
            callback()


def _broadcast_bytes(comm, payload):
    """Root 0's bytes on every rank: the length, then the bytes padded to
    whole int64s (the collectives carry no byte dtype)."""
    size = np.array([len(payload) if payload is not None else 0], dtype=np.int64)
    comm.broadcast(size, root=0)
    words = np.zeros((int(size[0]) + 7) // 8, dtype=np.int64)
    if payload is not None:
        words.view(np.uint8)[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    comm.broadcast(words, root=0)
    return words.view(np.uint8)[:int(size[0])].tobytes()


def run(func):
    """Decorator: ``func(state, ...)`` runs elastically. It first joins the
    newest membership and syncs rank 0's state; each HostsUpdatedInterrupt
    (the state is at its commit) or collective failure (the state is
    restored to its last commit) is followed by a resize (see the module's
    documentation) and a new call of func from that state. Returns func's
    result. Outside an elastic job: a plain call."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        job = _current_job()
        if job is None:
            return func(state, *args, **kwargs)
        generation = max(job.generation, job.latest_generation())
        while True:
            try:
                state._resize(job, generation)
                result = func(state, *args, **kwargs)
                job.store.set(DONE_KEY, job.worker_id)
                return result
            except HostsUpdatedInterrupt:
                generation = job.latest_generation()
            except _PEER_ERRORS as e:
                if job.ps_mode:
                    raise
                state.restore()
                following = job.generation + 1
                # The watcher broke the step for it (it reacts to the members
                # key, which the runner writes before the generation key).
                if job.store.check([MEMBERS_KEY.format(following)])[0]:
                    generation = max(following, job.latest_generation())
                    continue
                print(f"deepnex.elastic: worker {job.worker_id}: a collective failed in "
                      f"generation {job.generation} ({e}); back to the last commit, waiting "
                      f"for generation {following}", file=sys.stderr, flush=True)
                generation = job.wait_for(following, "a collective failed: a peer left or "
                                          "stalled", timeout=job.report_failure(e))

    return wrapper
