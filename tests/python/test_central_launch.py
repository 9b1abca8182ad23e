"""deepnex-central's launcher from Python and the CLI, on the process backend:
containers on the caller's own allocations, released when they end for good."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import deepnex
from _central import (AS_ROOT, CENTRAL_BIN, USER_IDS, clients, run_cli, start_central_launcher,
                      stop_central)
from _wait import wait_for
from deepnex import gpu, launch

needs_root = pytest.mark.skipif(not AS_ROOT, reason="running as another uid needs root")


def grant(cpus=1, memory="256MiB", gpus=1):
    """A request whose grant a container can run on: a grant's CPUs and
    memory bound its containers, and 0 grants none."""
    return gpu.Request(user="", gpus=gpus, cpus=cpus, memory=memory)


def await_container(client, name, done, timeout=60):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = next((c for c in client.containers() if c["name"] == name), None)
        if last is not None and done(last):
            return last
        time.sleep(0.02)
    pytest.fail(f"container {name}: {last}")


def test_start_list_logs_and_release_at_the_end(central, open_dir):
    alice, _ = clients(central)
    a = alice.allocate(grant())
    gate = open_dir / "gate"
    c = alice.start_container(launch.ContainerSpec(
        name="w0", command=["sh", "-c", f"echo hi $CUDA_VISIBLE_DEVICES; "
                                        f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 2"]),
        a)
    assert (c["name"], c["user"], c["allocation"], c["backend"]) == ("w0", "alice", a.id,
                                                                      "process")
    running = await_container(alice, "w0", lambda c: c["state"] == "running")
    assert running["gpus"] == [a.gpus[0].index] and running["restarts"] == 0
    assert [x.id for x in alice.allocations()] == [a.id]
    gate.write_text("")
    ended = await_container(alice, "w0", lambda c: c["allocation_released"])
    assert (ended["state"], ended["last_exit"]) == ("exited", "exited(2)")
    assert alice.container_logs("w0") == f"hi {a.env['CUDA_VISIBLE_DEVICES']}\n"
    assert alice.allocations() == []


def test_stop_releases_and_follow_reads_to_the_end(central):
    alice, _ = clients(central)
    a = alice.allocate(grant())
    alice.start_container(launch.ContainerSpec(name="ps", command=["sleep", "60"]), a.id)
    await_container(alice, "ps", lambda c: c["state"] == "running")
    stopped = alice.stop_container("ps", grace=10)
    assert (stopped["state"], stopped["last_exit"], stopped["allocation_released"]) == (
        "stopped", "signaled(SIGTERM)", True)
    assert alice.allocations() == []
    b = alice.allocate(grant())
    alice.start_container(launch.ContainerSpec(
        name="w1", command=["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"]), b)
    assert "".join(alice.container_logs("w1", follow=True)) == "1\n2\n3\n"


def test_blocking_calls_at_once_run_side_by_side(central):
    """Central runs calls that block (a Stop waits out its grace) on threads
    it keeps for the next call: four Stops at once of containers that ignore
    SIGTERM end in about one grace period, none queued behind another, and
    the threads serve the next calls."""
    alice, _ = clients(central)
    names = [f"t{i}" for i in range(4)]
    for _ in range(2):
        a = alice.allocate(grant(cpus=4, memory="1GiB"))
        for n in names:
            alice.start_container(launch.ContainerSpec(
                name=n, command=["sh", "-c", "trap '' TERM; sleep 60"], cpus=1, memory="64MiB"), a)
        for n in names:
            await_container(alice, n, lambda c: c["state"] == "running")
        grace = 2
        start = time.monotonic()
        with ThreadPoolExecutor(len(names)) as pool:
            stopped = list(pool.map(lambda n: alice.stop_container(n, grace=grace), names))
        took = time.monotonic() - start
        assert [(s["state"], s["last_exit"]) for s in stopped] == [
            ("stopped", "signaled(SIGKILL)")] * len(names)
        assert grace <= took < 2 * grace, took
        # The last one's end released the grant.
        assert alice.allocations() == []


def test_other_users_allocations_and_containers(central):
    alice, bob = clients(central)
    a = alice.allocate(grant())
    spec = launch.ContainerSpec(name="w0", command=["sleep", "60"])
    with pytest.raises(PermissionError, match=f"user bob cannot start a container on "
                                              f"allocation {a.id}: it is another user's$"):
        bob.start_container(spec, a.id)
    with pytest.raises(deepnex.NotFoundError, match='"a999" does not exist'):
        alice.start_container(spec, "a999")
    with pytest.raises(deepnex.InvalidArgumentError, match="spec.allocation"):
        alice.start_container(launch.ContainerSpec(name="w0", command=["true"], allocation=a), a)
    # Another user's name was dropped without a word, the container running
    # as alice (probe).
    with pytest.raises(PermissionError, match=f'spec.user "bob" may not use allocation '
                                              f'"{a.id}" of user "alice"'):
        alice.start_container(launch.ContainerSpec(name="w0", command=["true"], user="bob"), a)
    alice.start_container(launch.ContainerSpec(name="w0", command=["sleep", "60"], user="alice"),
                          a)
    assert bob.containers() == []
    with pytest.raises(deepnex.NotFoundError, match='no container "w0" of user bob'):
        bob.stop_container("w0")
    with pytest.raises(deepnex.NotFoundError):
        bob.container_logs("w0")
    with pytest.raises(PermissionError):
        bob.containers(user="alice")
    assert [c["state"] for c in alice.containers()] in (["starting"], ["running"])
    alice.stop_container("w0", grace=1)


def test_cli_launch_ps_logs_stop(central):
    alice, _ = clients(central)
    a = alice.allocate(grant())
    out = run_cli("launch", "--central", central, "--alloc", a.id, "--name", "w0",
                  "--memory", "64MiB", "--restart", "on-failure:2", "--",
                  "sh", "-c", "echo hello; sleep 60")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"w0 running on {a.id} (process ")
    await_container(alice, "w0", lambda c: c["usage"]["memory"] > 0)
    # Running is not having written: wait for the echo before the CLI reads it.
    wait_for(lambda: alice.container_logs("w0") == "hello\n", "w0's hello in its log")
    table = run_cli("ps", "--central", central).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "NODE", "BACKEND", "STATE", "RESTARTS"]
    row = table[1].split()
    assert row[:6] == ["w0", a.node, "process", "running", "0", str(a.gpus[0].index)]
    assert row[7] == "64MiB"
    assert len(table) == 2
    assert run_cli("ps", "--central", central, token="bobtok").stdout.splitlines()[1:] == []
    logs = run_cli("logs", "w0", "--central", central)
    assert (logs.returncode, logs.stdout) == (0, "hello\n")
    denied = run_cli("stop", "w0", "--central", central, token="bobtok")
    assert denied.returncode == 1 and 'no container "w0" of user bob' in denied.stderr
    out = run_cli("stop", "w0", "--grace", "10", "--central", central)
    assert (out.returncode, out.stdout) == (0, "w0 stopped signaled(SIGTERM), allocation released\n")
    follow = run_cli("logs", "w0", "--follow", "--central", central)
    assert (follow.returncode, follow.stdout) == (128 + 15, "hello\n")
    assert follow.stderr == "container w0 signaled(SIGTERM)\n"
    assert alice.allocations() == []
    missing = run_cli("launch", "--central", central, "--alloc", "a999", "--", "true")
    assert missing.returncode == 1 and '"a999" does not exist' in missing.stderr


def test_mounts_are_refused_without_allow_mount(central, tmp_path):
    alice, _ = clients(central)
    a = alice.allocate(grant())
    with pytest.raises(deepnex.PermissionDeniedError) as e:
        alice.start_container(launch.ContainerSpec(
            name="m", command=["true"], mounts=[(str(tmp_path), str(tmp_path), False)]), a)
    assert str(e.value) == (f'spec.mounts[0].source: "{tmp_path}": this deepnex-central allows '
                            f'no mounts (its --allow-mount is not set)')
    alice.release(a.id)


def test_mounts_only_under_allow_mount(tmp_path, open_dir):
    allowed, other = open_dir / "allowed", open_dir / "other"
    (allowed / "data").mkdir(parents=True)
    other.mkdir()
    (allowed / "data" / "f").write_text("in-data\n")
    (allowed / "escape").symlink_to(other)
    proc, address = start_central_launcher(tmp_path, "--allow-mount", str(allowed))
    try:
        alice, _ = clients(address)
        a = alice.allocate(grant())
        data = str(allowed / "data")
        # The CLI, with --workdir: the process backend takes a mount onto itself.
        out = run_cli("launch", "--central", address, "--alloc", a.id, "--name", "m",
                      "--mount", f"{data}:{data}", "--workdir", data, "--",
                      "sh", "-c", "pwd; cat f")
        assert out.returncode == 0, out.stderr
        done = await_container(alice, "m", lambda c: c["allocation_released"])
        assert done["last_exit"] == "exited(0)"
        assert alice.container_logs("m") == f"{data}\nin-data\n"
        b = alice.allocate(grant())
        for source, real in [(str(other), ""), (str(allowed / "escape"), f' ("{other}")')]:
            with pytest.raises(deepnex.PermissionDeniedError) as e:
                alice.start_container(launch.ContainerSpec(
                    name="m2", command=["true"], mounts=[(source, source, False)]), b)
            assert str(e.value) == (f'spec.mounts[0].source: "{source}"{real} is outside the '
                                    f'allowed mount roots [{allowed}]')
        bad = run_cli("launch", "--central", address, "--alloc", b.id, "--mount", "nocolon",
                      "--", "true")
        assert (bad.returncode, bad.stderr) == (
            1, "deepnex: --mount 'nocolon': expected SRC:DST or SRC:DST:ro\n")
    finally:
        stop_central(proc)


def test_allow_mount_must_be_a_directory(tmp_path):
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    out = subprocess.run([CENTRAL_BIN, "--allow-mount", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert f'--allow-mount "{tmp_path / "missing"}": not a directory' in out.stderr


@pytest.mark.skipif(launch.probe_backends().get("oci", "") != "",
                    reason="oci backend not usable here (needs root, runc and tini)")
def test_oci_with_a_relative_state_dir_mounts_and_a_quick_stop(tmp_path):
    """deepnex-central on the oci backend, started with a relative
    --launch-state-dir: a container reads through an allowed mount, and one
    that handles SIGTERM stops at once (the init passes the TERM on)."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "f").write_text("through-the-mount\n")
    proc, address = start_central_launcher(tmp_path, "--allow-mount", str(allowed), "--image", "host=host",
                                  backend="oci", state_dir="rel-launch", cwd=str(tmp_path))
    try:
        alice, _ = clients(address)
        a = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(
            name="r", command=["cat", "/in/f"], mounts=[launch.Mount(str(allowed), "/in")]), a)
        done = await_container(alice, "r", lambda c: c["allocation_released"], timeout=60)
        assert done["last_exit"] == "exited(0)"
        assert alice.container_logs("r") == "through-the-mount\n"
        assert (tmp_path / "rel-launch" / "containers").is_dir()
        b = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(
            name="t", command=["python3", "-c",
                               "import signal, sys, time\n"
                               "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                               "print('up', flush=True)\n"
                               "time.sleep(1000)"]), b)
        await_container(alice, "t", lambda c: alice.container_logs("t") == "up\n", timeout=60)
        t0 = time.monotonic()
        stopped = alice.stop_container("t", grace=20)
        assert time.monotonic() - t0 < 5
        assert (stopped["state"], stopped["last_exit"]) == ("stopped", "exited(0)")
        # As the user's uid, with a generated /etc: the host's shadow is not there.
        c = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(
            name="who", command=["sh", "-c", "id -u; cat /etc/shadow 2>/dev/null || echo no-shadow; "
                                             "grep alice /etc/passwd"]), c)
        await_container(alice, "who", lambda c: c["allocation_released"], timeout=60)
        assert alice.container_logs("who") == (
            "65534\nno-shadow\nalice:x:65534:65534:alice:/:/bin/sh\n")
    finally:
        stop_central(proc)


def memory_bytes(pid, field):
    """VmRSS (now) or VmHWM (the peak since the last reset_peak)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib * 1024


def reset_peak(pid):
    # A whole-log read that is freed again would not show in VmRSS after it.
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def test_a_200mb_log_is_read_by_offset_and_central_stays_small(central_process):
    address, proc = central_process
    alice, _ = clients(address)
    a = alice.allocate(grant())
    mib = 1 << 20
    written = 200 * mib + len("\nEND\n")
    alice.start_container(launch.ContainerSpec(
        name="big", command=["sh", "-c", "head -c 209715200 /dev/zero | tr '\\0' x; "
                                         "echo; echo END"]), a)
    await_container(alice, "big", lambda c: c["state"] == "exited", timeout=120)
    reset_peak(proc.pid)
    before = memory_bytes(proc.pid, "VmRSS")
    # The default 64 MiB limit keeps the last rotated file and the current
    # one: from 128 MiB on.
    offset, first, sizes, tail, ended = 0, None, [], b"", False
    while not ended:
        data, next_offset, ended = alice._c.logs("big", offset, "")
        if first is None:
            first = next_offset - len(data)
        sizes.append(len(data))
        tail = (tail + data)[-8:]
        offset = next_offset
    growth = memory_bytes(proc.pid, "VmHWM") - before
    assert first == 128 * mib
    assert offset == written
    assert sum(sizes) == written - 128 * mib
    assert max(sizes) == mib
    assert tail == b"xxx\nEND\n"
    assert growth < 64 * mib, f"central grew by {growth} bytes reading the log"


def test_ps_shows_the_restarts_of_a_crash_loop(central):
    alice, _ = clients(central)
    a = alice.allocate(grant())
    out = run_cli("launch", "--central", central, "--alloc", a.id, "--name", "w0",
                  "--restart", "on-failure:1", "--", "sh", "-c", "exit 3")
    assert out.returncode == 0, out.stderr
    # The crash-loop floor: 1 s before the restart.
    ended = await_container(alice, "w0", lambda c: c["state"] == "exited")
    assert (ended["restarts"], ended["last_exit"]) == (1, "exited(3) after 1 restart")
    row = run_cli("ps", "--central", central).stdout.splitlines()[1].split()
    assert row[:5] == ["w0", "n1", "process", "exited", "1"]


def sleeper(name, **limits):
    return launch.ContainerSpec(name=name, command=["sleep", "60"], **limits)


def test_the_three_quota_bypasses_are_closed(central):
    """#12: under a quota of 2 CPUs and 512 MiB, no container without a
    memory limit, none with 64 CPUs on a 0-CPU grant, and not 60 one-CPU
    containers on one 1-CPU grant."""
    admin = gpu.CentralClient(central, token="admintok", timeout=10)
    alice, _ = clients(central)
    admin.set_quota("alice", cpus=2, memory="512MiB")
    no_memory = alice.allocate(grant(cpus=1, memory=0))
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        alice.start_container(sleeper("nolimit"), no_memory)
    assert str(e.value) == (f'spec.memory: allocation "{no_memory.id}" grants no memory, and a '
                            f'container needs some (allocate with memory > 0)')
    no_cpus = alice.allocate(grant(cpus=0))
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        alice.start_container(sleeper("many", cpus=64), no_cpus)
    assert str(e.value) == f'spec.cpus: 64 is more than allocation "{no_cpus.id}" grants (0)'
    alice.release(no_memory.id)
    alice.release(no_cpus.id)
    one = alice.allocate(grant(cpus=1))
    alice.start_container(sleeper("c0", cpus=1, memory="64MiB"), one)
    with pytest.raises(deepnex.ResourceExhaustedError) as e:
        alice.start_container(sleeper("c1", cpus=1, memory="64MiB"), one)
    assert str(e.value) == (f'spec.cpus: allocation "{one.id}" grants 1 CPUs; its running '
                            f'containers would use 2')
    assert [c["name"] for c in alice.containers()] == ["c0"]
    alice.stop_container("c0", grace=1)
    assert alice.allocations() == []


def test_a_job_token_reaches_only_its_jobs_containers(central):
    alice, _ = clients(central)
    job = gpu.CentralClient(central, token="j1tok", timeout=10)
    plain = alice.allocate(grant())
    mine = job.allocate(grant())
    assert mine.job == "j1"
    alice.start_container(sleeper("other"), plain)
    with pytest.raises(deepnex.PermissionDeniedError) as e:
        job.start_container(sleeper("w0"), plain)
    assert str(e.value) == (f'the token of "alice" is for job "j1"; allocation {plain.id} '
                            f'is of no job')
    job.start_container(sleeper("w0"), mine)
    assert [c["name"] for c in job.containers()] == ["w0"]
    assert sorted(c["name"] for c in alice.containers()) == ["other", "w0"]
    for call in (lambda: job.stop_container("other"), lambda: job.container_logs("other")):
        with pytest.raises(deepnex.PermissionDeniedError) as e:
            call()
        assert str(e.value) == ('the token of "alice" is for job "j1"; container "other" is '
                                'of no job')
    job.stop_container("w0", grace=1)
    alice.stop_container("other", grace=1)
    assert alice.allocations() == []


def test_ctrl_c_and_a_closed_pipe_end_a_command_without_a_traceback(central):
    """A waiting `deepnex alloc` stopped with Ctrl-C, and `deepnex
    allocations | head` whose reader went first, once ended in tracebacks."""
    alice, _ = clients(central)
    alice.allocate(grant(gpus=2))
    env = dict(os.environ, DEEPNEX_TOKEN="alicetok", DEEPNEX_CENTRAL=central)
    env.pop("DEEPNEX_STATE_DIR", None)
    waiting = subprocess.Popen([sys.executable, "-m", "deepnex", "alloc", "--gpus", "1"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(alice.pending()) == 1, "alloc's request in the queue")
    waiting.send_signal(signal.SIGINT)
    _, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 130 and err.endswith("deepnex alloc: interrupted\n"), err
    assert "Traceback" not in err and alice.pending() == []
    read, write = os.pipe()
    os.close(read)
    try:
        gone = subprocess.run([sys.executable, "-m", "deepnex", "allocations"], env=env,
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (gone.returncode, gone.stderr) == (141, "")


def test_a_restarted_central_sweeps_what_the_killed_one_left_before_it_is_reaped(tmp_path):
    """The sweep once passed over the records of a launcher whose pid still
    answered: a killed central not yet reaped (a zombie, as here), or one
    whose pid another process took. The container ran on, its grant held."""
    ledger = ("--state-dir", str(tmp_path / "ledger"))
    marker = f"{600 + os.getpid() % 1000}.5"  # sleep's argument: this test's alone
    proc, _ = killed_with_a_sleeper(tmp_path, ledger, marker)  # not reaped: a zombie
    again, address = start_central_launcher(tmp_path, *ledger)
    try:
        alice, _ = clients(address)
        assert alice.allocations() == [] and alice.containers() == []
        wait_for(lambda: not sleepers(marker), "the orphan's process to end")
    finally:
        stop_central(again)
        proc.wait()
    assert "swept 1 container(s) of launcher " in again.stderr.read()


def test_a_container_whose_record_was_damaged_is_swept_by_its_launchers_id(tmp_path):
    """A container whose record.json was damaged ran on after central was
    killed, unswept, on GPUs that its user could release and another user
    be granted. Central's state directory names its launcher, so the sweep
    needs no record to end that launcher's processes."""
    ledger = ("--state-dir", str(tmp_path / "ledger"))
    marker = f"{2000 + os.getpid() % 1000}.25"  # sleep's argument: this test's alone
    proc, a = killed_with_a_sleeper(tmp_path, ledger, marker)
    proc.wait()
    containers = tmp_path / "launch" / "containers"
    [record] = containers.glob("*/record.json")
    record.write_text('{"name": "al')  # cut short
    again, address = start_central_launcher(tmp_path, *ledger)
    try:
        alice, _ = clients(address)
        wait_for(lambda: not sleepers(marker), "the orphan's process to end")
        # No record names its grant: held until its user releases it.
        assert [x.id for x in alice.allocations()] == [a.id]
        assert alice.containers() == [] and list(containers.iterdir()) == []
    finally:
        stop_central(again)
    err = again.stderr.read()
    assert "swept 0 container(s) of launcher " in err, err
    assert (f"removed {record.parent}: no readable container record; its allocation, if any, "
            "stays held until released") in err, err


def killed_with_a_sleeper(tmp_path, ledger, marker):
    """A central on `ledger` that ran alice's container "w" (`sleep marker`)
    and was killed (-9), not yet reaped; (its process, the allocation)."""
    proc, address = start_central_launcher(tmp_path, *ledger)
    try:
        alice, _ = clients(address)
        a = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(name="w", command=["sleep", marker]), a)
        await_container(alice, "w", lambda c: c["state"] == "running")
    finally:
        proc.kill()
    return proc, a


def sleepers(marker):
    """Pids of the processes running `sleep marker`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                    found.append(int(entry))
        except OSError:
            pass
    return found


@needs_root
def test_a_users_process_runs_as_their_uid_and_reads_nothing_of_centrals(tmp_path, open_dir):
    """On the process backend a user's container once ran as root and read
    the admin token."""
    tokens = tmp_path / "tokens"
    proc, address = start_central_launcher(tmp_path)
    try:
        os.chmod(tokens, 0o600)
        # Even where every directory on the way is open, the files are not.
        state = tmp_path / "launch"
        alice, _ = clients(address)
        a = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(
            name="who", command=["sh", "-c", f"id -u; id -G; cat {tokens} 2>/dev/null || echo no-token; "
                                             f"ls {state} 2>/dev/null || echo no-state; "
                                             "grep CapEff /proc/self/status"]), a)
        done = await_container(alice, "who", lambda c: c["allocation_released"])
        assert done["last_exit"] == "exited(0)"
        assert alice.container_logs("who") == (
            "65534\n65534\nno-token\nno-state\nCapEff:\t0000000000000000\n")
        assert oct(os.stat(state).st_mode & 0o777) == "0o700"
    finally:
        stop_central(proc)


def test_a_user_without_a_uid_can_allocate_but_not_start(tmp_path):
    proc, address = start_central_launcher(tmp_path, users=("alice",))
    try:
        _, bob = clients(address)
        b = bob.allocate(grant())
        with pytest.raises(deepnex.PermissionDeniedError) as e:
            bob.start_container(launch.ContainerSpec(name="w0", command=["true"]), b)
        assert str(e.value) == ("user bob has no uid on this deepnex-central (its --user or "
                                "--users-file), so their containers cannot run")
        assert bob.containers() == []
    finally:
        stop_central(proc)


def test_container_names_of_two_users_never_meet(tmp_path):
    # A user name that is not plain is hex-encoded in the launcher's names;
    # a plain one that looks like such an encoding is encoded too, or user
    # "x6a6f686e2e736d697468" would share john.smith's containers' names
    # (their records, cgroups and logs).
    looks_encoded = "x" + "john.smith".encode().hex()
    proc, address = start_central_launcher(
        tmp_path, users=("john.smith", looks_encoded),
        more_tokens=f"jstok john.smith user\nxtok {looks_encoded} user\n")
    try:
        users = [gpu.CentralClient(address, token=t, timeout=10) for t in ("jstok", "xtok")]
        for i, c in enumerate(users):
            c.start_container(launch.ContainerSpec(name="train", command=["echo", f"user {i}"]),
                              c.allocate(grant(gpus=0)))
        for i, c in enumerate(users):
            await_container(c, "train", lambda info: info["state"] == "exited")
            assert c.container_logs("train") == f"user {i}\n"
        # A name must start as the rule says, whatever the user's name.
        for bad in ["..", ".x", "-x", "_x"]:
            with pytest.raises(deepnex.InvalidArgumentError,
                               match=f'spec.name: "{bad}" is not a valid name'):
                users[0].start_container(launch.ContainerSpec(name=bad, command=["true"]),
                                         users[0].allocate(grant(gpus=0)))
    finally:
        stop_central(proc)


def test_users_file_maps_users_and_root_is_refused(tmp_path, open_dir):
    uid, gid = USER_IDS.split(":")
    users = tmp_path / "users"
    users.write_text(f"# deepnex user, uid, gid\nalice {uid} {gid}\n\nbob {uid}:{gid}  # bob\n")
    proc, address = start_central_launcher(tmp_path, "--users-file", str(users), users=())
    try:
        alice, bob = clients(address)
        for name, client in (("a", alice), ("b", bob)):
            a = client.allocate(grant())
            client.start_container(launch.ContainerSpec(name=name, command=["id", "-u"]), a)
            await_container(client, name, lambda c: c["allocation_released"])
            assert client.container_logs(name) == f"{uid}\n"
    finally:
        stop_central(proc)
    for flags, message in [
            (["--user", "root=0:0"],
             "users: root maps to uid 0 gid 0; containers never run as root or in its group"),
            (["--user", "alice=1000:0"],
             "users: alice maps to uid 1000 gid 0; containers never run as root or in its group"),
            (["--user", "alice=x:1"], 'user mapping "alice=x:1" is not NAME=UID:GID with a new NAME')]:
        out = subprocess.run([CENTRAL_BIN, *flags], capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and message in out.stderr, (flags, out.stderr)
    users.write_text("alice 1000\n")
    out = subprocess.run([CENTRAL_BIN, "--users-file", str(users)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode != 0
    assert (f'users file {users} line 1: "alice 1000" is not "NAME UID GID" or "NAME UID:GID" '
            f'with a new NAME') in out.stderr


def test_images_only_from_the_catalog_and_host_network_only_where_allowed(tmp_path):
    """A user once ran any host directory as an image, and reached the
    host's loopback."""
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    proc, address = start_central_launcher(tmp_path, "--image", f"base={rootfs}",
                                  "--allow-host-network", "alice")
    try:
        alice, bob = clients(address)
        a = alice.allocate(grant())
        for image in (str(rootfs), "/", "other"):
            with pytest.raises(deepnex.PermissionDeniedError) as e:
                alice.start_container(launch.ContainerSpec(name="i", command=["true"],
                                                           image=image), a)
            assert str(e.value) == (f'spec.image: "{image}" is not an image that user alice '
                                    f"may run [base] (deepnex images)")
        b = bob.allocate(grant())
        with pytest.raises(deepnex.PermissionDeniedError) as e:
            bob.start_container(launch.ContainerSpec(name="n", command=["true"],
                                                     host_network=True), b)
        assert str(e.value) == ("spec.host_network: user bob may not use the host's network on "
                                "this deepnex-central (its --allow-host-network)")
        out = run_cli("launch", "--central", address, "--alloc", b.id, "--host-network", "--",
                      "true", token="bobtok")
        assert out.returncode == 1 and "spec.host_network: user bob may not" in out.stderr
        # The process backend runs on the host's files: "host" needs no listing.
        alice.start_container(launch.ContainerSpec(name="n", command=["true"],
                                                   host_network=True), a)
        assert await_container(alice, "n", lambda c: c["allocation_released"])["last_exit"] == \
            "exited(0)"
    finally:
        stop_central(proc)
    bad = subprocess.run([CENTRAL_BIN, "--image", "base=relative/dir"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode != 0
    assert '--image "base=relative/dir": "relative/dir" is not an absolute directory or "host"' \
        in bad.stderr


def test_only_the_newest_ended_containers_of_a_user_are_kept_with_their_files(tmp_path):
    """--ended-containers 2: a user's third ended container takes the
    oldest one out of ps, with its logs and its directory (a probe's one
    user grew central by 70 KB per ended container and kept up to 128 MiB
    of logs per name, for good). Another user's are their own; a removed
    name starts again."""
    state = tmp_path / "launch"
    proc, address = start_central_launcher(tmp_path, "--ended-containers", "2",
                                           state_dir=str(state))
    try:
        alice, bob = clients(address)

        def run(client, name):
            client.start_container(launch.ContainerSpec(
                name=name, command=["sh", "-c", f"echo {name}"]), client.allocate(grant()))
            await_container(client, name, lambda c: c["allocation_released"])
        run(bob, "b0")
        for i in range(4):
            run(alice, f"c{i}")
        # The watcher that ends c3 removes c1 (c0 went with c2's end).
        wait_for(lambda: sorted(c["name"] for c in alice.containers()) == ["c2", "c3"],
                 lambda: f"only c2 and c3 left: {alice.containers()}")
        assert alice.container_logs("c3") == "c3\n"
        with pytest.raises(deepnex.NotFoundError, match='no container "c0" of user alice'):
            alice.container_logs("c0")
        assert [c["name"] for c in bob.containers()] == ["b0"]
        wait_for(lambda: not any(p.name.endswith(("alice.c0", "alice.c1"))
                                 for p in (state / "containers").iterdir()),
                 lambda: f"c0's and c1's files gone: {sorted(os.listdir(state / 'containers'))}")
        run(alice, "c0")
        assert alice.container_logs("c0") == "c0\n"
    finally:
        stop_central(proc)


def test_an_error_quoting_a_huge_value_still_names_its_field(central):
    """A 9000-character name came back as "received initial metadata size
    exceeds limit" (the message rides in gRPC's 8 KiB trailers), naming no
    field; the message is cut instead, keeping its start."""
    alice, _ = clients(central)
    a = alice.allocate(grant())
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        alice.start_container(launch.ContainerSpec(name="é" * 9000, command=["true"]), a)
    # A refused name is quoted and cut to its start (test_images.py's
    # test_a_refused_image_or_container_name_is_quoted_escaped_and_cut).
    assert str(e.value).startswith('spec.name: "\\xc3\\xa9') and \
        "is not a valid name" in str(e.value)
    with pytest.raises(deepnex.NotFoundError, match=r"^no container .* more bytes\)$"):
        alice.stop_container("n" * 9000)
