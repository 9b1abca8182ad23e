"""deepnex.launch on the process backend: the issue's example, supervision,
and each bad input raising the right deepnex error."""

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

import deepnex
from _central import clients, run_cli
from _wait import wait_for
from deepnex import gpu, launch
from deepnex._cli_launch import exit_code


def allocation(user="alice", gpus=2):
    alloc = deepnex.gpu.Allocator()
    alloc.add_node(deepnex.gpu.Node("n1", gpus=[deepnex.gpu.Gpu(memory="16GiB")] * 4,
                                    cpus=4, memory="8GiB"))
    return alloc.allocate(deepnex.gpu.Request(user=user, gpus=gpus, cpus=1, memory="256MiB"))


def alive(pid):
    """Whether pid runs (a zombie that nobody reaps does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.fixture
def launcher(tmp_path):
    with launch.Launcher("process", state_dir=str(tmp_path / "state"),
                         allowed_mount_roots=[str(tmp_path)]) as l:
        yield l


def test_issue_example(launcher):
    a = allocation()
    h = launcher.start(launch.ContainerSpec(
        name="w0", image="host",
        command=[sys.executable, "-c",
                 "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['X'])"],
        cpus=1, memory="256MiB", env={"X": "y"}, allocation=a, restart="on-failure:2"))
    assert h.name == "w0"
    e = h.wait(timeout=60)
    assert (e.reason, e.code, e.signal, e.restarts, e.ok) == ("exited", 0, 0, 0, True)
    assert h.logs() == a.env["CUDA_VISIBLE_DEVICES"] + " y\n"
    assert (h.status().state, h.status().queued) == ("exited", "")  # no engine's queue
    assert h.env["NVIDIA_VISIBLE_DEVICES"] == a.env["NVIDIA_VISIBLE_DEVICES"]
    u = h.usage()
    assert u.cpu_seconds > 0 and u.memory_peak > 0
    h.stop()  # idempotent after the end


def test_restarts_logs_and_stop(launcher):
    h = launcher.start(launch.ContainerSpec(name="flaky", command=["sh", "-c", "echo r; exit 4"],
                                            restart="on-failure:3", backoff=0.01))
    e = h.wait(timeout=60)
    assert (e.reason, e.code, e.restarts) == ("exited", 4, 3)
    assert str(e) == "exited(4) after 3 restarts"
    assert h.logs() == "r\n" * 4
    s = launcher.start(launch.ContainerSpec(name="sleeper", command=["sleep", "1000"]))
    with pytest.raises(deepnex.DeadlineExceededError, match='"sleeper" still running'):
        s.wait(timeout=0.05)
    # A grace long enough that, on a loaded machine too, SIGTERM is what ends it.
    s.stop(grace=10)
    e = s.wait(timeout=60)
    assert (e.reason, e.signal) == ("signaled", 15)
    assert s.status().state == "stopped"
    assert sorted(h.name for h in launcher.list()) == ["flaky", "sleeper"]
    assert launcher.get("flaky").name == "flaky"
    launcher.remove("flaky")
    with pytest.raises(deepnex.NotFoundError):
        launcher.get("flaky")


needs_cgroups = pytest.mark.skipif(
    not any(os.access(p, os.W_OK) for p in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/cgroup.procs")),
    reason="no writable cgroup tree: the process backend runs without limits")


@needs_cgroups
def test_oom_killed(launcher):
    h = launcher.start(launch.ContainerSpec(
        name="hog", command=["sh", "-c", "x=$(head -c 64000000 /dev/zero | tr '\\0' a); echo ${#x}"],
        memory=16 << 20))
    assert h.wait(timeout=60).reason == "oom_killed"


def test_follow_logs(launcher):
    h = launcher.start(launch.ContainerSpec(name="talk", command=["sh", "-c", "echo a; sleep 0.1; echo b"]))
    seen = []
    h.follow_logs(seen.append)
    assert "".join(seen) == "a\nb\n"


def test_mounts_as_values_and_tuples(launcher, tmp_path):
    data = str(tmp_path / "data")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_text("in-data\n")
    # The process backend takes only mounts onto themselves, writable.
    spec = launch.ContainerSpec(name="m", command=["cat", data + "/f"],
                                mounts=[launch.Mount(data, data, read_only=False),
                                        (data, data, False)])
    h = launcher.start(spec)
    assert h.wait(timeout=60).ok
    assert h.logs() == "in-data\n"
    for mount, why in [((data, "/data", False), ""), ((data, data), " read-only")]:
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            launcher.start(launch.ContainerSpec(name="m2", command=["true"], mounts=[mount]))
        assert str(e.value) == (
            f'spec.mounts[0]: the process backend runs on the host\'s files and cannot mount '
            f'"{data}" at "{mount[1]}"{why}; it takes only a writable mount of a path onto '
            f'itself, which changes nothing')


@pytest.mark.parametrize("text, want", [
    ("/a:/b", launch.Mount("/a", "/b", False)),
    ("/a:/b:ro", launch.Mount("/a", "/b", True)),
    ("/a:/b:rw", launch.Mount("/a", "/b", False)),
    ("rel/x:/b", launch.Mount(os.path.join(os.getcwd(), "rel/x"), "/b", False)),
])
def test_mount_parse(text, want):
    assert launch.Mount.parse(text) == want


@pytest.mark.parametrize("text", ["/a", "/a:/b:rx", ":/b", "/a:", "/a:/b:ro:x"])
def test_mount_parse_refuses(text):
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        launch.Mount.parse(text)
    assert str(e.value) == f"--mount {text!r}: expected SRC:DST or SRC:DST:ro"


@pytest.mark.parametrize("change, error, message", [
    (dict(command=["deepnex-no-such-command"]), deepnex.NotFoundError,
     'command "deepnex-no-such-command" not found on PATH='),
    (dict(image="/nonexistent/rootfs"), deepnex.NotFoundError, 'spec.image: "/nonexistent/rootfs" does not exist'),
    (dict(memory="1KiB"), deepnex.InvalidArgumentError,
     "spec.memory: 1024 bytes is below the minimum 4MiB"),
    (dict(memory="lots"), deepnex.InvalidArgumentError, 'spec.memory: "lots" is not a byte size'),
    (dict(mounts=[("data", "/data")]), deepnex.InvalidArgumentError,
     'spec.mounts[0].source: "data" is not an absolute path'),
    (dict(mounts=[("/etc", "/etc")]), deepnex.PermissionDeniedError,
     'spec.mounts[0].source: "/etc" is outside the allowed mount roots'),
    (dict(mounts=[("/etc", "/dev/x")]), deepnex.InvalidArgumentError,
     'spec.mounts[0].target: "/dev/x" is over the container\'s /dev, which the runtime mounts'),
    (dict(allocation="other"), deepnex.PermissionDeniedError,
     'spec.user "bob" may not use allocation'),
    (dict(restart="sometimes"), deepnex.InvalidArgumentError,
     'restart: "sometimes" is not a restart policy'),
    (dict(name="bad name"), deepnex.InvalidArgumentError, 'spec.name: "bad name"'),
    (dict(command="true"), deepnex.InvalidArgumentError, "expected a list of arguments"),
])
def test_bad_input(launcher, change, error, message):
    if change.get("allocation") == "other":
        change = dict(allocation=allocation(user="alice"), user="bob")
    spec = launch.ContainerSpec(**{**dict(name="bad", command=["true"]), **change})
    with pytest.raises(error) as e:
        launcher.start(spec)
    assert message in str(e.value)
    # The launcher goes on.
    assert launcher.start(launch.ContainerSpec(name="good", command=["true"])).wait(timeout=60).ok


def test_launcher_options():
    with pytest.raises(deepnex.InvalidArgumentError, match='backend: "lxc" is not one of'):
        launch.Launcher("lxc")
    with pytest.raises(deepnex.InvalidArgumentError, match='unknown option "colour"'):
        launch.Launcher("process", colour="red")
    with launch.Launcher("process", id="opt1", min_memory="64MiB", cgroup_parent="deepnex") as l:
        assert (l.id, l.backend) == ("opt1", "process")
        with pytest.raises(deepnex.InvalidArgumentError, match="below the minimum 64MiB"):
            l.start(launch.ContainerSpec(name="x", command=["true"], memory="32MiB"))
    probe = launch.probe_backends()
    assert probe["process"] == ""
    assert set(probe) == {"process", "oci", "docker", "slurm", "kubernetes"}


def test_cleanup_after_a_launcher_is_killed(tmp_path):
    """A Python process that launched a container is SIGKILLed; cleanup(id)
    sweeps the orphan."""
    script = (
        "import sys, time, deepnex\n"
        "from deepnex import launch\n"
        f"l = launch.Launcher('process', id='pycrash', state_dir={str(tmp_path)!r})\n"
        "h = l.start(launch.ContainerSpec(name='o', command=['sleep', '987654']))\n"
        "print(h.status().id, flush=True)\n"
        "time.sleep(1000)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
    assert os.path.exists(f"/proc/{pid}")
    record = json.load(open(tmp_path / "containers" / "o" / "record.json"))
    assert (record["state"], record["launcher_id"], record["id"]) == ("running", "pycrash", str(pid))
    with launch.Launcher("process") as l:
        assert l.cleanup("pycrash") >= 1
    # cleanup sends SIGKILL; the process ends a moment later.
    wait_for(lambda: not alive(pid), f"pid {pid} to end")


def test_cleanup_leaves_a_launcher_whose_id_extends_the_ones_swept(tmp_path):
    """Runs are named "<launcher id>-<container>-<n>", so cleanup("amb") took
    the cgroups of launcher "amb-x" too, and killed job amb-x's worker when a
    killed job amb was swept (probe)."""
    with launch.Launcher("process", id="amb-x", state_dir=str(tmp_path)) as other:
        h = other.start(launch.ContainerSpec(name="amb-x-worker0", command=["sleep", "987653"]))
        with launch.Launcher("process") as sweeper:
            assert sweeper.cleanup("amb") == 0
        # A swept cgroup is removed once its processes are gone.
        assert alive(int(h.status().id)), h.status()


def test_ps_table(tmp_path):
    state = tmp_path / "state"
    with launch.Launcher("process", state_dir=str(state)) as l:
        busy = l.start(launch.ContainerSpec(name="busy", command=["sh", "-c", "while :; do :; done"],
                                            cpus=0.5, memory="64MiB", allocation=allocation()))
        done = l.start(launch.ContainerSpec(name="done", command=["sh", "-c", "exit 2"]))
        done.wait(timeout=60)
        wait_for(lambda: busy.usage().cpu_seconds >= 0.1, "0.1 s of CPU used by busy")
        out = subprocess.run([sys.executable, "-m", "deepnex", "ps", "--state-dir", str(state)],
                             check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "BACKEND", "STATE", "RESTARTS", "GPU", "INDICES", "CPUS",
                                "MEMORY", "LIMIT", "CPU", "SECONDS", "MEMORY", "NOW/PEAK", "LAST",
                                "EXIT"]
    busy_row = lines[1].split()
    assert busy_row[:7] == ["busy", "process", "running", "0", "0,1", "0.5", "64MiB"]
    assert float(busy_row[7]) >= 0.1
    # Measured memory in the same unit rule as limits: "<n>[.d]<unit>".
    for amount in busy_row[8].split("/"):
        assert amount == "-" or deepnex.parse_byte_size(amount) > 0, busy_row
    done_row = lines[2].split()
    assert done_row[:7] + done_row[-1:] == ["done", "process", "exited", "0", "-", "-", "-",
                                            "exited(2)"]


@pytest.mark.parametrize("from_env", [False, True])
def test_ps_refuses_a_state_dir_that_does_not_exist(tmp_path, from_env):
    missing = str(tmp_path / "nonexistent")
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPNEX_CENTRAL", "DEEPNEX_STATE_DIR")}
    args = [sys.executable, "-m", "deepnex", "ps"]
    if from_env:
        env["DEEPNEX_STATE_DIR"] = missing
    else:
        args += ["--state-dir", missing]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    given = "$DEEPNEX_STATE_DIR" if from_env else "--state-dir"
    assert (out.returncode, out.stdout, out.stderr) == (
        1, "", f"deepnex: ps: {given} {missing!r} is not a directory\n")


def test_ps_of_an_empty_state_dir_is_an_empty_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "deepnex", "ps", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.split() == ["NAME", "BACKEND", "STATE", "RESTARTS", "GPU", "INDICES", "CPUS",
                                  "MEMORY", "LIMIT", "CPU", "SECONDS", "MEMORY", "NOW/PEAK",
                                  "LAST", "EXIT"]


@pytest.mark.parametrize("last_exit, code", [
    ("exited(0)", 0), ("exited(3)", 3), ("exited(3) after 2 restarts", 3),
    ("signaled(SIGTERM)", 143), ("signaled(SIGKILL) after 1 restart", 137),
    ("signaled(signal 42)", 170), ("oom_killed", 1), ("lost", 1), ("", 1), (None, 1)])
def test_logs_exit_code(last_exit, code):
    assert exit_code(last_exit) == code


@pytest.mark.parametrize("name, script, code, last_exit", [
    ("ok", "echo out; exit 0", 0, "exited(0)"),
    ("bad", "echo out; echo err >&2; exit 3", 3, "exited(3)"),
    ("killed", "echo out; kill -KILL $$", 137, "signaled(SIGKILL)"),
])
def test_logs_follow_ends_with_the_containers_status(central, name, script, code, last_exit):
    alice, _ = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=1, cpus=1, memory="256MiB"))
    started = run_cli("launch", "--central", central, "--alloc", a.id, "--name", name, "--",
                      "sh", "-c", script)
    assert started.returncode == 0, started.stderr
    follow = run_cli("logs", name, "-f", "--central", central)
    assert (follow.returncode, follow.stderr) == (code, f"container {name} {last_exit}\n")
    assert follow.stdout.startswith("out\n"), follow.stdout
    # Without --follow: the output only, and 0 (the read succeeded).
    plain = run_cli("logs", name, "--central", central)
    assert (plain.returncode, plain.stdout, plain.stderr) == (0, follow.stdout, "")


def test_blocking_calls_release_the_gil(launcher):
    import threading
    h = launcher.start(launch.ContainerSpec(name="long", command=["sleep", "1000"]))
    result = []
    waiter = threading.Thread(target=lambda: result.append(h.wait(timeout=30)))
    waiter.start()
    # With the GIL held by wait, this thread could not get here to stop it.
    h.stop(grace=1)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert result[0].reason == "signaled"


def test_every_container_command_flag_has_help():
    import argparse
    from deepnex.__main__ import build_parser
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("ps", "launch", "logs", "stop"):
        for action in commands[name]._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings or action.dest)


def run_job_cli(tmp_path, *args):
    env = dict(os.environ, DEEPNEX_RUN_DIR=str(tmp_path / "run"))
    return subprocess.run([sys.executable, "-m", "deepnex", "run", *args], env=env, text=True,
                          capture_output=True, timeout=120, cwd=tmp_path)


def test_run_mount_and_workdir_flags_on_the_process_backend(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = run_job_cli(tmp_path, "--mode", "allreduce", "--mount", f"{work}:{work}", "--workdir",
                  str(work), "--", "sh", "-c", "pwd")
    assert out.returncode == 0, out.stderr
    assert f"[worker 0] {work}\n" in out.stdout
    refused = run_job_cli(tmp_path, "--mode", "allreduce", "--mount", f"{work}:/work", "--", "true")
    assert refused.returncode == 1
    assert (f'spec.mounts[0]: the process backend runs on the host\'s files and cannot mount '
            f'"{work}" at "/work"') in refused.stderr
    bad = run_job_cli(tmp_path, "--mount", "nocolon", "--", "true")
    assert (bad.returncode, bad.stderr) == (
        2, "deepnex run: --mount 'nocolon': expected SRC:DST or SRC:DST:ro\n")


# ---------------------------------------------------------------------------
# The oci backend (runc as root, tini as the containers' init).

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(ROOT, "examples", "digits", "mlp_numpy.py")
OCI_UNUSABLE = launch.probe_backends().get("oci", "")
needs_oci = pytest.mark.skipif(OCI_UNUSABLE != "", reason=f"oci backend: {OCI_UNUSABLE}")


def deepnex_mounts():
    """--mount flags that bring this checkout, its build tree and, when
    deepnex is pip-installed into a venv, that venv (its python, deepnex,
    deepnex-ps, libdeepnex) into a host-image container at the same paths."""
    build = os.path.abspath(os.environ.get("DEEPNEX_BUILD_DIR") or os.path.join(ROOT, "build"))
    dirs = [ROOT] + ([] if build.startswith(ROOT + os.sep) else [build])
    if sys.prefix != sys.base_prefix:
        dirs.append(sys.prefix)
    return [arg for d in dirs for arg in ("--mount", f"{d}:{d}:ro")]


@needs_oci
def test_run_trains_digits_in_oci_containers(tmp_path):
    """README's digits example through `deepnex run --backend oci`, as the
    process backend runs it: the workers and the parameter server in runc
    containers of the host image, the code mounted in, a relative state dir."""
    pytest.importorskip("sklearn")
    if deepnex.job._ps_binary() is None:
        pytest.skip("deepnex-ps not found (set DEEPNEX_BUILD_DIR)")
    name = "oci" + uuid.uuid4().hex[:8]
    env = dict(os.environ, DEEPNEX_RUN_DIR=str(tmp_path / "run"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "deepnex", "run", "--name", name, "--backend", "oci",
           "--state-dir", "state", *deepnex_mounts(), "--mount", f"{tmp_path}:{tmp_path}",
           "--workers", "2", "--mode", "sync", "--lr", "0.1", "--momentum", "0.9",
           "--", sys.executable, DIGITS, "--min-accuracy", "0.9", "--epochs", "6"]
    try:
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=400)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        assert f"job {name}: 2 workers, mode sync, backend oci" in text
        assert re.search(r"^\[ps 0\] deepnex-ps listening on 127\.0\.0\.1:\d+", text, re.M), text
        summary = re.search(r"^\[worker 0\] summary: digits mlp_numpy mode=ps .*"
                            r"test_accuracy=([0-9.]+)", text, re.M)
        assert summary and float(summary.group(1)) >= 0.9, text
    finally:
        # The relative --state-dir was taken from the job's cwd; nothing of
        # the job is left there.
        with launch.Launcher("oci", state_dir=str(tmp_path / "state")) as sweeper:
            assert sweeper.cleanup(name) == 0


@needs_oci
def test_run_image_runs_the_workers_in_it_with_the_jobs_variables_only(tmp_path):
    """`deepnex run --image`: the workers run in the image, in its directory,
    with the job's variables and not the shell's (its PATH would hide the
    image's; a secret in it is not the image's to read). Before it a job
    could run only in the host image, so a kubernetes job could not run at
    all. An image the backend cannot honour is refused, not ignored."""
    from _registry import busybox_layout
    layout = busybox_layout(tmp_path / "layout", files={"/srv/motd": "in the image\n"})
    name = "img" + uuid.uuid4().hex[:8]
    env = dict(os.environ, DEEPNEX_RUN_DIR=str(tmp_path / "run"), SECRET_FROM_SHELL="leaked")
    script = ("echo rank=$RANK of $WORLD_SIZE in $(pwd) secret=${SECRET_FROM_SHELL:-none} "
              "path=$PATH; cat /srv/motd")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "deepnex", "run", "--name", name, "--backend", "oci",
             "--state-dir", "state", "--image", str(layout), "--workers", "2",
             "--mode", "allreduce", "--", "sh", "-c", script],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        for rank in (0, 1):
            assert (f"[worker {rank}] rank={rank} of 2 in / secret=none "
                    "path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
                    f"[worker {rank}] in the image\n") in out.stdout, text
    finally:
        with launch.Launcher("oci", state_dir=str(tmp_path / "state")) as sweeper:
            assert sweeper.cleanup(name) == 0
    # The process backend runs the host's files whatever the image says.
    refused = run_job_cli(tmp_path, "--image", str(layout), "--mode", "allreduce", "--", "true")
    assert refused.returncode == 1, refused.stderr
    assert (f'deepnex run: image (--image): "{layout}": the process backend runs this host\'s '
            "files (image \"host\"); an image needs the oci, docker or kubernetes backend, or "
            "deepnex-central's agents\n") in refused.stderr, refused.stderr
    # deepnex-ps is this host's program: no parameter server in a kubernetes
    # pod of the job's image, said before anything is asked of the cluster.
    refused = run_job_cli(tmp_path, "--backend", "kubernetes", "--image", "busybox:1",
                          "--mode", "sync", "--", "true")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr == (
        "deepnex run: image (--image): \"busybox:1\" with mode \"sync\": the parameter servers run "
        "deepnex-ps from this host's files, which the kubernetes backend cannot run; use mode "
        "allreduce, or the oci backend\n"), refused.stderr
    empty = run_job_cli(tmp_path, "--image", "", "--mode", "allreduce", "--", "true")
    assert (empty.returncode, empty.stderr) == (
        2, "deepnex run: image (--image): empty; \"host\" runs this host's files\n")


@needs_oci
def test_oci_mounts_and_workdir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("hello\n")
    with launch.Launcher("oci", state_dir=str(tmp_path / "state")) as l:
        h = l.start(launch.ContainerSpec(
            name="m", command=["sh", "-c", "pwd; cat in.txt; echo out > /w/out.txt; "
                               "touch /r/x 2>/dev/null || echo read-only"],
            mounts=[launch.Mount(str(data), "/w", read_only=False),
                    launch.Mount(str(data), "/r")],
            working_dir="/w"))
        e = h.wait(timeout=60)
        assert e.ok, h.logs()
        assert h.logs() == "/w\nhello\nread-only\n"
    assert (data / "out.txt").read_text() == "out\n"
    assert not (data / "x").exists()
