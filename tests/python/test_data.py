"""deepnex.data.Sharder: disjoint equal shards, deterministic per-epoch
shuffles (checked against an independent splitmix64 + Fisher-Yates), and
exact resume."""

import subprocess
import sys
import textwrap

import pytest

import deepnex
from deepnex.data import Sharder

M64 = 2**64 - 1


def splitmix64(state):
    """(new state, output), as src/data/sharder.cc computes it."""
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def reference_permutation(size, seed, epoch):
    a = splitmix64(seed)[1]
    b = splitmix64(epoch ^ 0x5851F42D4C957F2D)[1]
    state = a ^ ((b * 0xFF51AFD7ED558CCD) & M64)
    order = list(range(size))
    for i in range(size - 1, 0, -1):
        bound = i + 1
        threshold = (2**64 - bound) % bound
        while True:
            state, x = splitmix64(state)
            if x >= threshold:
                break
        j = x % bound
        order[i], order[j] = order[j], order[i]
    return order


def test_permutation_matches_an_independent_implementation():
    for size, seed, epoch in [(10, 42, 0), (97, 0, 3), (1000, 2**63 + 5, 12)]:
        s = Sharder(size, seed=seed)
        assert s.permutation(epoch).tolist() == reference_permutation(size, seed, epoch)
    # The C++ test pins the same values.
    assert Sharder(10, seed=42).permutation(0).tolist() == reference_permutation(10, 42, 0)


@pytest.mark.parametrize("remainder,per_shard", [("drop", 25), ("pad", 26)])
def test_shards_are_disjoint_equal_and_cover_the_range(remainder, per_shard):
    shards = [Sharder(103, 4, k, seed=9, remainder=remainder) for k in range(4)]
    for epoch in (0, 1, 7):
        parts = [s.indices(epoch).tolist() for s in shards]
        assert [len(p) for p in parts] == [per_shard] * 4
        flat = sum(parts, [])
        if remainder == "drop":
            assert len(set(flat)) == 100 and set(flat) <= set(range(103))
        else:
            assert set(flat) == set(range(103)) and len(flat) == 104


def test_same_seed_same_order_other_epoch_or_seed_differs():
    a, b = Sharder(500, 2, 1, seed=3), Sharder(500, 2, 1, seed=3)
    assert a.indices(4).tolist() == b.indices(4).tolist()
    assert a.indices(4).tolist() != a.indices(5).tolist()
    assert a.indices(4).tolist() != Sharder(500, 2, 1, seed=4).indices(4).tolist()


def test_no_shuffle_is_contiguous():
    assert Sharder(10, 3, 1, shuffle=False, remainder="drop").indices(0).tolist() == [3, 4, 5]


def test_iteration_walks_epochs_and_batches():
    s = Sharder(20, 2, 0, seed=1)
    e0, e1 = s.indices(0).tolist(), s.indices(1).tolist()
    batches = [b.tolist() for b in s.batches(4)]
    assert batches == [e0[0:4], e0[4:8], e0[8:10]]
    assert s.state() == (1, 0)
    assert [b.tolist() for b in s.batches(4, drop_last=True)] == [e1[0:4], e1[4:8]]
    assert s.state() == (2, 0)
    assert list(s) == s.indices(2).tolist()
    s.set_epoch(1)
    assert next(iter(s)) == e1[0]


def test_set_epoch_at_the_top_of_a_resumed_epoch_goes_on_from_the_checkpoint():
    """The DistributedSampler loop calls set_epoch(epoch) at the top of each
    epoch; it moved a sharder resumed mid-epoch back to the epoch's start,
    so the loop saw again what the checkpoint had seen."""
    s = Sharder(20, 2, 0, seed=1)
    first = [next(iter(s)) for _ in range(3)]
    resumed = Sharder(20, 2, 0, seed=1, state=s.state_dict())
    resumed.set_epoch(0)
    assert first + list(resumed) == s.indices(0).tolist()
    assert resumed.state() == (1, 0)
    resumed.set_epoch(1)   # the cursor's epoch: unmoved
    assert resumed.state() == (1, 0)
    resumed.set_epoch(0)   # another: its start
    assert resumed.state() == (0, 0)
    # A re-sharded epoch keeps its layout and cursor too.
    three = Sharder(20, 3, 1, seed=1, state=s.state_dict())
    state = three.state_dict()
    three.set_epoch(0)
    assert three.state_dict() == state


def test_resume_from_a_saved_state_gives_exactly_the_rest():
    s = Sharder(50, 3, 2, seed=5, remainder="drop")
    it = iter(s)
    taken = [next(it) for _ in range(7)]
    state = s.state()
    assert state == (0, 7)
    rest = list(Sharder(50, 3, 2, seed=5, remainder="drop", state=state))
    assert taken + rest == s.indices(0).tolist()


def test_bad_inputs_name_field_and_value():
    with pytest.raises(deepnex.InvalidArgumentError, match="num_shards: 0"):
        Sharder(10, 0, 0)
    with pytest.raises(ValueError, match=r"shard: 2 is out of range \[0, 2\)"):
        Sharder(10, 2, 2)
    with pytest.raises(ValueError, match="shard: -1"):
        Sharder(10, 2, -1)
    with pytest.raises(ValueError, match="size: 1 is below num_shards 2"):
        Sharder(1, 2, 0, remainder="drop")
    with pytest.raises(ValueError, match="size: -5 is negative"):
        Sharder(-5, 1, 0)
    # Too big to hold, refused at once (2**62 threw std::length_error at the
    # first epoch) and past 64 bits or 32 not pybind's TypeError.
    with pytest.raises(ValueError, match="^size: 4611686018427387904 items is more than a "
                                         r"Sharder holds \(4294967296: "):
        Sharder(2**62, 2, 0)
    with pytest.raises(deepnex.InvalidArgumentError, match="^size: 18446744073709551616 is "
                                                           "out of range$"):
        Sharder(2**64, 2, 0)
    with pytest.raises(deepnex.InvalidArgumentError, match="^num_shards: 1099511627776 is "
                                                           "out of range$"):
        Sharder(10, 2**40, 0)
    with pytest.raises(ValueError, match='remainder: "keep"'):
        Sharder(10, remainder="keep")
    s = Sharder(10, 2, 0)
    with pytest.raises(ValueError, match="position: 6 is past"):
        s.load_state((0, 6))
    # The cursor counted on to epoch 2**63, a state load_state refuses (probe).
    with pytest.raises(deepnex.InvalidArgumentError,
                       match="^epoch: 9223372036854775807 is past the last epoch, "
                             "4611686018427387904$"):
        s.load_state((2**63 - 1, 4))
    s.load_state((2**62, 5))  # the last epoch, done: 2**62 more are left to count
    assert s.state() == (2**62 + 1, 0)
    assert len(s.indices()) == 5
    s.load_state((0, 0))
    with pytest.raises(ValueError, match="batch_size: 0"):
        next(s.batches(0))
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^state: expected \(epoch, position\), got 'x'$"):
        s.load_state("x")
    with pytest.raises(deepnex.InvalidArgumentError,
                       match="^state: no epoch, ranges \\(a state_dict\\(\\) has epoch, "
                             "position, num_shards, ranges\\)$"):
        s.reshard(3, 0, {"position": 0, "num_shards": 2})
    assert s.state() == (0, 0)


def test_from_context(job_env):
    s = Sharder.from_context(40, seed=1)   # rank 1 of 4
    assert s.indices(0).tolist() == Sharder(40, 4, 1, seed=1).indices(0).tolist()
    assert len(s) == 10


def test_drop_last_drops_the_same_step_on_every_rank_of_a_resharded_epoch():
    """drop_last dropped a batch shorter than batch_size: in a re-sharded
    epoch the shorter shard's last full step is one index short, so its rank
    alone dropped it and took a step fewer than the others (a collective
    then waits for it forever). Now every shard is as long as the others."""
    one = Sharder(10, 1, 0, seed=1)
    seen = one._s.next(1).tolist()
    two = [Sharder(10, 1, 0, seed=1) for _ in range(2)]
    for k, s in enumerate(two):
        s.reshard(2, k, one.state_dict())
    assert [s.epoch_length for s in two] == [5, 5]   # 9 left: the second padded
    steps = [[b.tolist() for b in s.batches(5, drop_last=True)] for s in two]
    assert [len(b) for b in steps[0] + steps[1]] == [5, 5]
    got = seen + steps[0][0] + steps[1][0]
    assert len(got) == 11 and sorted(set(got)) == list(range(10))
    assert steps[1][0][-1] == steps[0][0][0]   # the rest's first item, again
    # A step of fewer positions than batch_size is dropped on every rank.
    for k, s in enumerate(two):
        s.reshard(2, k, one.state_dict())
    assert [[len(b) for b in s.batches(3, drop_last=True)] for s in two] == [[3], [3]]


def test_a_checkpoints_state_dict_resumes_exactly_after_a_resize_and_in_another_world():
    """The docs said to checkpoint state(), (epoch, position), and resume with
    Sharder(..., state=s): after a resize mid-epoch, or in another world, that
    cursor pointed at other items (repeating and skipping some). A
    state_dict() resumes exactly, and state= takes one."""
    def resume(seen, state, world):
        rest = [i for k in range(world) for i in Sharder(20, world, k, seed=1, remainder="drop",
                                                         state=state)]
        assert sorted(seen + rest) == list(range(20))

    # Worlds that divide what is left, so that "drop" leaves nothing out.
    two = [Sharder(20, 2, k, seed=1, remainder="drop") for k in range(2)]
    seen = [int(i) for s in two for i in s._s.next(4)]
    three = [Sharder(20, 3, k, seed=1, remainder="drop") for k in range(3)]
    for s in three:
        s.load_state_dict(two[0].state_dict())
    seen += [int(i) for s in three for i in s._s.next(2)]
    assert three[0].state() == (0, 2) and three[0].state_dict()["ranges"]
    for world in (3, 2, 6):
        resume(seen, three[0].state_dict(), world)
    # The bare cursor still seeks in the world's own layout.
    assert Sharder(20, 3, 0, seed=1, remainder="drop", state=(0, 2)).state_dict() == {
        "epoch": 0, "position": 2, "num_shards": 3, "ranges": [], "size": 20, "shuffle": True,
        "seed": 1, "remainder": "drop"}


def test_a_float_or_a_seed_past_64_bits_is_refused_not_truncated():
    """int() took these: Sharder(10.9) held 10 items, shard 0.9 was shard 0,
    a cursor (0, 2.7) position 2, batches(2.5) batches of 2, and seeds 0.5
    and 2**64 gave seed 0's order."""
    import numpy as np
    for call, message in (
            (lambda: Sharder(10.9), r"^size: 10\.9 is not an integer$"),
            (lambda: Sharder(10, 2, 0.9), r"^shard: 0\.9 is not an integer$"),
            (lambda: Sharder(10, 2, 0, state=(0, 2.7)), r"^state\.position: 2\.7 is not an "),
            (lambda: next(Sharder(10).batches(2.5)), r"^batch_size: 2\.5 is not an integer$"),
            (lambda: Sharder(10, seed=0.5), r"^seed: 0\.5 is not an integer$"),
            (lambda: Sharder(10, seed=None), r"^seed: None is not an integer$"),
            (lambda: Sharder(10, seed=2**64), r"^seed: 18446744073709551616 is out of range"),
            (lambda: Sharder(10, seed=-2**63 - 1), r"^seed: -9223372036854775809 is out of "),
            # bool("false") is True: it shuffled.
            (lambda: Sharder(10, shuffle="false"), r"^shuffle: 'false' is not True or False$"),
            (lambda: Sharder(10, shuffle=0), r"^shuffle: 0 is not True or False$")):
        with pytest.raises(deepnex.InvalidArgumentError, match=message):
            call()
    # numpy's ints are ints; a negative seed is its 64 bits' two's complement.
    s = Sharder(np.int64(10), np.int32(2), np.int64(1), seed=np.uint64(2**64 - 1),
                shuffle=np.bool_(True))
    assert s.indices(0).tolist() == Sharder(10, 2, 1, seed=-1).indices(0).tolist()


def test_pickle_and_copies_carry_the_options_world_and_cursor():
    """pickle.dumps and copy.deepcopy raised TypeError (the C++ sharder does
    not pickle), and copy.copy shared the original's cursor."""
    import copy
    import pickle
    two = [Sharder(30, 2, k, seed=-7, remainder="drop") for k in range(2)]
    seen = [int(i) for s in two for i in s._s.next(3)]   # 24 left: 8 a shard
    three = [Sharder(30, 3, k, seed=-7, remainder="drop") for k in range(3)]
    for s in three:
        s.load_state_dict(two[0].state_dict())
    seen += [int(i) for s in three for i in s._s.next(1)]
    for clone in (lambda s: pickle.loads(pickle.dumps(s)), copy.deepcopy, copy.copy):
        clones = [clone(s) for s in three]
        assert [c.state_dict() for c in clones] == [s.state_dict() for s in three]
        assert sorted(seen + [i for c in clones for i in c]) == list(range(30))
        assert [c.indices(5).tolist() for c in clones] == [s.indices(5).tolist() for s in three]
        assert all(s.state() == (0, 1) for s in three)   # the originals did not move


def test_a_state_dict_of_another_order_is_refused():
    """A state_dict's positions index one order of the data set, and it did
    not say which: resumed with another seed, or after the data set grew, it
    handed out other items (some twice, some never) without a word."""
    saved = Sharder(20, 2, 0, seed=1)
    saved._s.next(3)
    state = saved.state_dict()
    for other, message in ((Sharder(21, 2, 0, seed=1), "^state.size: 20 is not this sharder's 21 "),
                           (Sharder(20, 2, 0, seed=2), "^state.seed: 1 is not this sharder's 2 "),
                           (Sharder(20, 2, 0, seed=1, shuffle=False),
                            "^state.shuffle: True is not this sharder's False "),
                           (Sharder(20, 2, 0, seed=1, remainder="drop"),
                            "^state.remainder: 'pad' is not this sharder's 'drop' ")):
        with pytest.raises(deepnex.InvalidArgumentError, match=message):
            other.load_state_dict(state)
        assert other.state() == (0, 0)
    # A state saved without them (before they were in it) still loads.
    old = {k: state[k] for k in ("epoch", "position", "num_shards", "ranges")}
    assert Sharder(20, 2, 1, seed=1, state=old).state() == (0, 3)


def test_threads_first_batches_at_once_do_not_deadlock():
    """In a process that had not imported numpy, two threads' first batches
    hung for good: pybind11 imported numpy's C API in a C++ static
    initializer, and the second thread waited there holding the GIL that the
    first thread's import needed."""
    code = textwrap.dedent("""
        import sys, threading
        from deepnex.data import Sharder
        sharders = [Sharder(1000, 1, 0, seed=k) for k in range(4)]
        start = threading.Barrier(4)
        def first_batch(s):
            start.wait()
            next(s.batches(10))
        threads = [threading.Thread(target=first_batch, args=(s,)) for s in sharders]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == "done\n", out.stderr


def test_threads_sharing_a_sharder_take_each_index_once_within_its_epoch():
    """A step checked the epoch, then took next(): another thread could end
    the epoch in between, and the step took the next epoch's first index,
    leaving the cursor mid-epoch (9 runs in 30 on this test's sizes)."""
    import threading
    for trial in range(30):
        s = Sharder(20000, 2, 1, seed=trial)
        taken = []
        threads = [threading.Thread(target=lambda: taken.extend(s)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert s.position == 0
        assert sorted(taken) == sorted(i for e in range(s.epoch) for i in s.indices(e).tolist())


class _Labelled(Sharder):
    def __init__(self, label, size):
        super().__init__(size, seed=5)
        self.label = label


def test_a_subclass_pickles_as_itself_with_its_attributes():
    """Sharder pickled as Sharder(options, state_dict()): a subclass came
    back as a plain Sharder, without its own attributes."""
    import copy
    import pickle
    s = _Labelled("train", 10)
    s._s.next(3)
    for clone in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert type(clone) is _Labelled and clone.label == "train"
        assert clone.state_dict() == s.state_dict()


def _world(size, n, remainder):
    return [Sharder(size, n, k, seed=3, remainder=remainder) for k in range(n)]


def _resharded(world, n):
    """World `world` (in lockstep) continued by n shards."""
    out = _world(world[0]._dataset[0], n, world[0]._dataset[3])
    for k, s in enumerate(out):
        s.reshard(n, k, world[0].state_dict())
    return out


def test_iterating_every_rank_of_a_resharded_epoch_hands_out_its_remaining_items_evenly():
    """Item by item, the ranks of an epoch re-sharded once or twice (from
    any position, pad or drop) hand out the items no rank had handed out,
    every rank as many as the others (a DataLoader over a shard one item
    short took a batch fewer, and DDP hung): with pad each of them, fewer
    than a world's size twice; with drop fewer than a world's size left out,
    none twice. len() tells; batches() takes the same steps on every rank."""
    for remainder in ("pad", "drop"):
        for size in (1, 2, 5, 7, 10):
            for n in (1, 2, 3):
                if remainder == "drop" and size < n:
                    continue
                for p in range(_world(size, n, remainder)[0].epoch_length + 1):
                    for m in (1, 2, 3, 4):
                        if remainder == "drop" and size < m:
                            continue
                        case = (remainder, size, n, p, m)
                        world = _world(size, n, remainder)
                        blocks = [s.indices(0).tolist() for s in world]
                        if p:
                            for s in world:
                                s._s.next(p)
                        moved = _resharded(world, m)
                        if p == len(blocks[0]):
                            assert all(s.state() == (1, 0) for s in moved), case
                            continue
                        if moved[0].epoch == 1:   # "drop", fewer left than m shards
                            assert remainder == "drop" and n != m, case
                            assert all(s.state() == (1, 0) for s in moved), case
                            continue
                        # What no rank has handed out, each once (with pad,
                        # the repeats of what one has are left out too).
                        read = {i for b in blocks for i in b[:p]}
                        left = [i for i in dict.fromkeys(i for b in blocks for i in b[p:])
                                if i not in read]
                        # Half of the rest handed out, then the first world again.
                        half = (moved[0].epoch_length - moved[0].position) // 2
                        taken = [int(i) for s in moved for i in s._s.next(half)] if half \
                            else []
                        again = _resharded(moved, n)
                        # "drop", fewer left than n shards: the next epoch.
                        done = again[0].epoch == 1
                        assert remainder == "drop" or not done, case
                        lengths = [0 if done else len(s) for s in again]
                        steps = [s.num_batches(2) for s in again]
                        rest = [[] if done else list(s) for s in again]
                        assert lengths == [len(r) for r in rest], case
                        assert len(set(lengths)) == 1, case
                        assert all(s.state() == (1, 0) for s in again), case
                        got = taken + [i for r in rest for i in r]
                        if p and n != m:   # else a resume, or a fresh epoch laid out anew
                            if remainder == "pad":
                                assert sorted(set(got)) == sorted(left), case
                                assert len(left) <= len(got) < len(left) + m + n, case
                            else:
                                assert len(set(got)) == len(got), case
                                assert set(got) <= set(left), case
                                assert len(left) - m - n < len(got) <= len(left), case
                        # batches() takes as many steps on every rank.
                        again = _resharded(moved, n)
                        assert [len(list(s.batches(2))) for s in again] == steps, case
                        assert len(set(steps)) == 1, case


def test_len_is_what_iterating_yields_after_a_resume_a_reshard_or_part_of_an_epoch():
    """len() was the shard's size in a fresh epoch whatever the cursor:
    after a resume, a reshard or part of an iteration mid-epoch it said more
    than iterating yielded (a DataLoader's len() with it)."""
    s = Sharder(20, 2, 1, seed=1)
    assert len(s) == 10 == s.num_batches(4) * 4 - 2
    it = iter(s)
    [next(it) for _ in range(3)]
    assert (len(s), s.num_batches(4), s.num_batches(4, drop_last=True)) == (7, 2, 1)
    resumed = Sharder(20, 2, 1, seed=1, state=s.state_dict())
    assert len(resumed) == 7 == len(list(resumed))
    assert len(resumed) == 10   # the next epoch, whole
    cursor = Sharder(20, 2, 1, seed=1, state=(0, 6))
    assert len(cursor) == 4 == len(list(cursor))
    # A re-sharded epoch: 2 x 7 items left over 3 shards, 5 each (one padded).
    three = [Sharder(20, 3, k, seed=1) for k in range(3)]
    for k, t in enumerate(three):
        t.reshard(3, k, s.state_dict())
    assert [len(t) for t in three] == [5, 5, 5]
    assert [t.num_batches(2) for t in three] == [3, 3, 3]
    assert [[len(b) for b in t.batches(2)] for t in three] == [[2, 2, 1]] * 3
    assert [len(t) for t in three] == [7, 7, 7]   # epoch 1 laid out for 3: ceil(20 / 3)
    for call, message in ((lambda: s.num_batches(0), "^batch_size: 0 must be at least 1$"),
                          (lambda: s.num_batches(2.5), r"^batch_size: 2\.5 is not an integer$")):
        with pytest.raises(deepnex.InvalidArgumentError, match=message):
            call()
