"""Data sharding: ``deepnex.data.Sharder``.

Each worker of a job reads its own equal share of a dataset's indices,
reshuffled every epoch the same way on every rank::

    ctx = deepnex.init()
    sharder = deepnex.data.Sharder(len(dataset), ctx.world_size, ctx.rank, seed=0)
    for epoch in range(epochs):
        for batch in sharder.batches(64):       # numpy int64 arrays of indices
            train_step(x[batch], y[batch])

Iterating (``for i in sharder``, ``sharder.batches(n)``) yields the rest of
the current epoch, from the cursor ``state()`` = (epoch, position), and moves
the cursor as it goes: to (epoch + 1, 0) once the epoch's last index has been
handed out. Save ``state_dict()`` with a checkpoint and pass it back
(``Sharder(..., state=s)`` or ``load_state_dict(s)``) to resume exactly where
the job stopped, in the same world or another. The cursor alone, ``state()``,
is a position in this world's layout of the epoch: restored after a resize
mid-epoch, or into another world, it points at other items.

An elastic job whose world changes mid-epoch re-shards: ``state_dict()`` of
any one rank (ranks that take a batch each per step share their cursor)
describes the whole world, and ``reshard(num_shards, shard, state)`` splits
the items of that epoch that no rank has handed out over the new world, every
rank as many as the others (with remainder "pad" a few repeated, with "drop"
fewer than the world's size left out, as in any epoch); later epochs are
laid out for the new world as usual::

    state = sharder.state_dict()                  # rank 0's, broadcast
    sharder.reshard(new_world_size, new_rank, state)
"""

import operator
import threading

# Imported before the first Sharder returns an array: pybind11 2.10 imports
# numpy's C API inside a C++ static initializer, where a second thread then
# waits holding the GIL that the import needs (two threads' first batches
# deadlocked); with numpy loaded already that import never gives up the GIL.
import numpy

from . import _C
from .errors import InvalidArgumentError

__all__ = ["Sharder"]

# What a state_dict's positions are positions in: Sharder's own options.
_DATASET = ("size", "shuffle", "seed", "remainder")


def _integer(value, field):
    """value as an int (numpy's included), or InvalidArgumentError naming
    `field`: int() truncated a float, so Sharder(10.9) held 10 items."""
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{field}: {value!r} is not an integer") from None


def _fits(value, field, bits=64):
    """_integer(value), or InvalidArgumentError naming `field` past a signed `bits`-bit int
    (where pybind11 would raise a TypeError listing the binding's signature)."""
    number = _integer(value, field)
    if not -2**(bits - 1) <= number < 2**(bits - 1):
        raise InvalidArgumentError(f"{field}: {number} is out of range")
    return number


def _flag(value, field):
    """A bool (numpy's too), or InvalidArgumentError naming `field`:
    bool("false") is True, so shuffle="false" shuffled."""
    if isinstance(value, (bool, numpy.bool_)):
        return bool(value)
    raise InvalidArgumentError(f"{field}: {value!r} is not True or False")


def _seed(value):
    """A seed as the generator's 64 bits: a negative one as its two's
    complement, one past 64 bits refused (2**64 gave seed 0's order)."""
    number = _integer(value, "seed")
    if not -2**63 <= number < 2**64:
        raise InvalidArgumentError(f"seed: {number} is out of range (a 64-bit int, signed "
                                   "or unsigned)")
    return number & (2**64 - 1)


class Sharder:
    """Shard ``shard`` of ``num_shards`` over the indices [0, size).

    shuffle: a new permutation every epoch, drawn from (seed, epoch) by
    splitmix64 and Fisher-Yates, identical on every rank and platform; the
    shard is a contiguous block of it. False keeps the dataset's order.
    seed: a 64-bit int, signed or unsigned (-1 is 2**64 - 1).
    remainder: "pad" (default; every shard has ceil(size / num_shards)
    indices, repeating a few from the start of the permutation) or "drop"
    (floor(size / num_shards), leaving out the rest).

    state: where to resume, a checkpoint's ``state_dict()`` (see
    load_state_dict) or a cursor (epoch, position) (see load_state).

    Bad input (num_shards <= 0, shard out of range, size 0, size <
    num_shards with "drop") raises InvalidArgumentError (a ValueError)
    naming the field and the value.

    Threads may share one: each step of an iteration is taken whole, and
    only from the epoch the iteration began in.
    """

    def __init__(self, size, num_shards=1, shard=0, shuffle=True, seed=0,
                 remainder="pad", state=None):
        # The data set's order (_DATASET): state_dict() carries it, a pickle rebuilds from it.
        self._dataset = (_fits(size, "size"), _flag(shuffle, "shuffle"), _seed(seed),
                         str(remainder))
        size, shuffle, seed, remainder = self._dataset
        self._s = _C.data.Sharder(size=size, num_shards=_fits(num_shards, "num_shards", 32),
                                  shard=_fits(shard, "shard", 32), shuffle=shuffle, seed=seed,
                                  remainder=remainder)
        # Threads may share it: a step's check of the epoch and its next()
        # (and state()'s two reads) are taken under it, one thread at a time.
        self._lock = threading.Lock()
        if isinstance(state, dict):
            self.load_state_dict(state)
        elif state is not None:
            self.load_state(state)

    @classmethod
    def from_context(cls, size, context=None, **kwargs):
        """This worker's shard: rank of world_size from ``deepnex.init()``."""
        if context is None:
            from . import init
            context = init()
        return cls(size, context.world_size, context.rank, **kwargs)

    def __getstate__(self):
        """Pickles (and copies) as its attributes, with the world and
        state_dict() in place of the C++ sharder, which has no pickle of its
        own (and which copy.copy shared), and of the lock."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("_s", "_lock")}
        out["_s"] = (self.num_shards, self.shard, self.state_dict())
        return out

    def __setstate__(self, state):
        state = dict(state)
        num_shards, shard, sharder_state = state.pop("_s")
        size, shuffle, seed, remainder = state["_dataset"]
        # Sharder's own __init__, whatever a subclass's takes.
        Sharder.__init__(self, size, num_shards, shard, shuffle, seed, remainder, sharder_state)
        self.__dict__.update(state)

    def __len__(self):
        """The indices iterating now yields, as with torch's samplers
        (``len(self) == len(list(self))``; a DataLoader's len() follows it):
        the rest of the current epoch from the cursor, this shard's whole
        share at an epoch's start. Mid-epoch (after a resume, a reshard or
        part of an iteration) that is less than a fresh epoch's; the same on
        every shard."""
        return self._s.remaining

    def num_batches(self, batch_size, drop_last=False):
        """The steps ``batches(batch_size, drop_last)`` yields now, the same
        on every shard: the current epoch's cursor positions left, divided by
        ``batch_size`` (rounded down with ``drop_last``, else up)."""
        batch_size = _fits(batch_size, "batch_size")
        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size: {batch_size} must be at least 1")
        with self._lock:
            positions = self._s.epoch_length - self._s.position
        return positions // batch_size if drop_last else -(-positions // batch_size)

    @property
    def num_shards(self):
        return self._s.num_shards

    @property
    def shard(self):
        return self._s.shard

    @property
    def epoch_length(self):
        """Indices every shard yields in the current epoch (one re-sharded
        mid-way: its share of what was left)."""
        return self._s.epoch_length

    @property
    def epoch(self):
        return self._s.epoch

    @property
    def position(self):
        return self._s.position

    def state(self):
        """(epoch, position): what has been handed out so far."""
        with self._lock:
            return (self._s.epoch, self._s.position)

    def load_state(self, state):
        """Moves the cursor to (epoch, position) of this world's layout;
        position == epoch_length means the epoch is done. A checkpoint is
        resumed with load_state_dict, which knows the world it was saved in."""
        try:
            epoch, position = state
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"state: expected (epoch, position), got {state!r}") from None
        self._s.seek(_fits(epoch, "state.epoch"), _fits(position, "state.position"))

    def state_dict(self):
        """The cursor with the world it is for, the layout of a re-sharded
        current epoch, and the order they index: {"epoch", "position",
        "num_shards", "ranges"} (ints and [first, last) pairs of permutation
        positions) and this sharder's "size", "shuffle", "seed", "remainder"."""
        return dict(self._s.state(), **dict(zip(_DATASET, self._dataset)))

    def load_state_dict(self, state):
        """Continues ``state`` (any shard's state_dict()) as this shard of
        this sharder's world: see reshard()."""
        self.reshard(self.num_shards, self.shard, state)

    def reshard(self, num_shards, shard, state=None):
        """Becomes shard ``shard`` of ``num_shards``, continuing ``state``
        (default: this sharder's own state_dict()). Within the same world
        that is a resume; in another one the items of state's epoch that
        none of its shards has handed out are split over the new world and
        the cursor moves to their start. Every shard gets as many as the
        others, as in a whole epoch: with remainder "pad" the shorter ones
        end with a repeat of the first of them, with "drop" the longer ones'
        last is left out, so that all of them take the same steps (a
        DataLoader over a shard one item short took one batch fewer, and
        DDP waited for it for ever)."""
        if state is None:
            state = self.state_dict()
        keys = ("epoch", "position", "num_shards", "ranges")
        missing = [k for k in keys if not isinstance(state, dict) or k not in state]
        if missing:
            raise InvalidArgumentError(f"state: no {', '.join(missing)} (a state_dict() has "
                                       f"{', '.join(keys)})")
        # Positions in another order are other items. (A state saved before
        # state_dict() carried the order has none of these keys.)
        for key, value in zip(_DATASET, self._dataset):
            if key in state and state[key] != value:
                raise InvalidArgumentError(f"state.{key}: {state[key]!r} is not this sharder's "
                                           f"{value!r} (the state is a position in another "
                                           "order of the data set)")
        try:
            pairs = [(a, b) for a, b in state["ranges"]]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"state.ranges: {state['ranges']!r} is not a list of "
                                       "[first, last) pairs") from None
        ranges = [(_fits(a, "state.ranges"), _fits(b, "state.ranges")) for a, b in pairs]
        self._s.reshard(_fits(state["epoch"], "state.epoch"),
                        _fits(state["position"], "state.position"),
                        _fits(state["num_shards"], "state.num_shards", 32), ranges,
                        _fits(num_shards, "num_shards", 32), _fits(shard, "shard", 32))

    def set_epoch(self, epoch):
        """Moves to the start of ``epoch``, as torch's DistributedSampler
        takes the epoch's order, unless the cursor is in that epoch already:
        a loop that calls ``set_epoch(epoch)`` at the top of every epoch
        then goes on where a resume put it (restarting it repeated what the
        checkpoint had seen). ``load_state((epoch, 0))`` restarts it."""
        epoch = _fits(epoch, "epoch")
        with self._lock:
            if epoch != self._s.epoch:
                self._s.seek(epoch, 0)

    def permutation(self, epoch=None):
        """The whole dataset's order in ``epoch`` (default: the current one)."""
        return self._s.permutation(self.epoch if epoch is None else _fits(epoch, "epoch"))

    def indices(self, epoch=None):
        """This shard's indices in ``epoch`` (default: the current one)."""
        return self._s.indices(self.epoch if epoch is None else _fits(epoch, "epoch"))

    def batches(self, batch_size, drop_last=False):
        """Yields the rest of the current epoch as int64 arrays of at most
        ``batch_size`` indices, one per step of ``batch_size`` cursor
        positions; ``drop_last`` skips a final step of fewer positions. Every
        shard takes the same steps."""
        batch_size = _fits(batch_size, "batch_size")
        epoch = self.epoch
        while True:
            with self._lock:
                if self.epoch != epoch:
                    return
                batch = self._s.next(batch_size)
            if drop_last and len(batch) < batch_size:
                continue
            yield batch

    def __iter__(self):
        """Yields the rest of the current epoch's indices as ints, moving the
        cursor one index at a time so that state() is exact mid-epoch; as a
        torch sampler (``DataLoader(data, batch_size, sampler=sharder)``).
        A DataLoader's workers draw indices ahead of the loop: checkpoint
        through deepnex.torch.ResumableLoader."""
        for batch in self.batches(1):
            yield int(batch[0])
