"""The job commands of the deepnex CLI:

    deepnex run [--workers N|MIN:MAX [--nodes K]] [--ps M] [--mode sync|ssp:S|async|allreduce]
                [--gpus-per-worker K --gpu-mode exclusive|shared --gpu-memory 8GiB]
                [--cpus C --memory 4GiB] [--backend process|oci|docker|slurm|kubernetes]
                [--mount SRC:DST[:ro] ... --workdir D]
                [--central ADDR [--token T | --token-file F] [--user U]]
                [--advertise-address ADDR]
                [--restart on-failure:3] [--checkpoint-dir D]
                [--optimizer sgd|adam|adagrad --lr LR [--momentum M]] -- python3 train.py ARGS
    deepnex top                 the jobs running on this machine, their GPUs and usage

``deepnex run`` exits with the job's exit code; Ctrl-C, SIGTERM or SIGHUP
stops the job, releases its allocations and exits 130 / 143 / 129. With
--central it allocates as the token's user.
"""

import argparse
import os
import re
import signal
import sys
import threading

from deepnex._cli_common import (add_worker_resources, central_address, central_token,
                                 format_table)


def _notice(message):
    # One write per line, as the workers' (job._write_line): print() writes the text
    # and its newline separately, and a worker's output line, written to the same
    # pipe meanwhile, would land between.
    from deepnex.job import _write_line
    try:
        _write_line(sys.stderr, f"deepnex run: {message}")
    except OSError:
        pass  # the terminal went away (SIGHUP): the job is stopped all the same


def _run(args) -> int:
    from deepnex import DeepnexError, job, launch
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        _notice("no command (deepnex run [flags] -- python3 train.py ...)")
        return 2
    try:
        mounts = [launch.Mount.parse(m) for m in args.mount or []]
    except DeepnexError as e:
        _notice(e)
        return 2
    try:
        min_workers, workers = parse_workers(str(args.workers))
    except ValueError as e:
        _notice(e)
        return 2
    # Relative to where deepnex run is, as --checkpoint-dir and --state-dir.
    workdir = os.path.abspath(os.path.expanduser(args.workdir)) if args.workdir else None
    options = dict(mounts=mounts, working_dir=workdir, image=args.image, workers=workers,
                   min_workers=min_workers,
                   nodes=args.nodes, advertise_address=args.advertise_address, ps=args.ps,
                   mode=args.mode, gpus_per_worker=args.gpus_per_worker, gpu_mode=args.gpu_mode,
                   gpu_memory=args.gpu_memory or 0, cpus=args.cpus, memory=args.memory or 0,
                   backend=args.backend, central=central_address(args), user=args.user,
                   central_token=central_token(args),
                   central_token_file=args.token_file, notify=args.notify or [],
                   notify_every=args.notify_every, notify_when=args.notify_when,
                   restart=args.restart, checkpoint_dir=args.checkpoint_dir,
                   optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, name=args.name,
                   on_event=_notice)
    if args.state_dir:
        options["state_dir"] = args.state_dir
    try:
        j = job.Job(command, **options)
    except DeepnexError as e:
        _notice(e)
        return 2

    stopped = {}
    stopper = []

    def stop(signum):
        try:
            j.stop(signum)
        except DeepnexError as e:
            stopped["error"] = e

    def on_signal(signum, frame):
        # Notes the signal and stops the job on a thread of its own, which
        # ends the start or the wait below; it raises nothing. An exception
        # raised here lands wherever the main thread is, threading's weakref
        # callbacks included, where Python drops it: the job then ended as if
        # by itself (seen in CI).
        if stopped and not any(t.is_alive() for t in stopper):
            return  # the stop is over, and the run is returning its code
        if stopped:
            # A second one while the first one's stop waits for hosts that do
            # not answer: leave now, saying what may still run.
            left = j.unstopped()
            held = [a.id for a in j.allocations()]
            _notice(f"job {j.name}: {signal.Signals(signum).name} again: exiting without "
                    "waiting for the stop; "
                    + (f"left running: {', '.join(left)}" if left else "no container left")
                    + (f"; allocations not released: {', '.join(held)}" if held else ""))
            os._exit(128 + stopped["signal"])
        stopped["signal"] = signum
        # Off the main thread, so that a second signal is taken meanwhile.
        t = threading.Thread(target=stop, args=(signum,), name=f"deepnex stop {j.name}",
                             daemon=True)
        stopper.append(t)
        t.start()

    # SIGHUP: a closed terminal or ssh session left the job running on. One
    # ignored stays so (`nohup deepnex run`, a shell's background job). The
    # handlers stay until the process exits: put back at the end, a second
    # signal took its default action, and its exit code (probe).
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, on_signal)
    result = None
    try:
        j.start()
        if not stopped:
            word = "worker" if str(args.workers) == "1" else "workers"
            _notice(f"job {j.name}: {args.workers} {word}{' (elastic)' if min_workers else ''}, "
                    f"mode {args.mode}, "
                    f"backend {j.backend}")
            result = j.wait()
    except DeepnexError as e:
        if not stopped:  # else the start ended because the job was stopped
            j.stop()
            _notice(e)
            return 1
    for t in stopper:
        while t.is_alive():
            t.join(0.2)  # in slices: a second signal is taken meanwhile
    # A job that had ended by itself before the signal (a worker failed, and
    # the signal came while the others were stopped) tells its own end.
    if stopped and (result is None or result.stopped):
        signum = stopped["signal"]
        if "error" in stopped:
            _notice(f"job {j.name} stopped by {signal.Signals(signum).name}: "
                    f"{stopped['error']}")
        else:
            _notice(f"job {j.name} stopped by {signal.Signals(signum).name}; "
                    "everything released")
        return 128 + signum
    for rank, e in enumerate(result.workers):
        _notice(f"worker {rank}: {e}")
    _notice(f"job {j.name} exited {result.exit_code} after {result.seconds:.1f} s")
    return result.exit_code


def _workers_value(text):
    """--workers: N as a number, MIN:MAX as given (parse_workers checks it)."""
    return int(text) if _DIGITS.fullmatch(text) else text


# ASCII digits alone: int() takes " 1", "+1", "1_0" and "١" too, which a
# probe's job then echoed as its size ("job ...: ١:2 workers").
_DIGITS = re.compile(r"[0-9]+")


def parse_workers(text):
    """--workers N or MIN:MAX: (min_workers, workers); min_workers 0 when not
    elastic (N, or MIN == MAX). ValueError naming the flag and value for a
    MIN:MAX out of order or below 1, or anything else."""
    parts = text.split(":")
    if len(parts) > 2 or not all(_DIGITS.fullmatch(p) for p in parts):
        raise ValueError(f"--workers: {text!r} is not N or MIN:MAX (e.g. 2 or 1:4)")
    numbers = [int(p) for p in parts]
    low, high = numbers[0], numbers[-1]
    if len(numbers) == 1:
        return 0, high  # the job checks N
    if low < 1:
        raise ValueError(f"--workers: {text!r}: MIN {low} is below 1")
    if low > high:
        raise ValueError(f"--workers: {text!r}: MIN {low} is above MAX {high}")
    return (low if low < high else 0), high


def _registry():
    return os.environ.get("DEEPNEX_RUN_DIR") or f"/tmp/deepnex-{os.getuid()}/jobs"


def running_jobs(registry=None):
    """The records (job.json) of the jobs whose `deepnex run` is alive."""
    import glob
    import json

    from deepnex._cli_launch import _alive
    jobs = []
    for path in sorted(glob.glob(os.path.join(registry or _registry(), "*", "job.json"))):
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # being written or removed
        if _alive(record.get("pid", 0)):
            jobs.append(record)
    return jobs


def top_text(registry=None):
    """What one screen of `deepnex top` shows."""
    import time

    from deepnex._cli_launch import read_records, rows
    jobs = running_jobs(registry)
    if not jobs:
        return "no deepnex jobs running"
    out = []
    for j in jobs:
        gpus = sorted({f"{a['node']}:{g}" for a in j.get("allocations", []) for g in a["gpus"]})
        uptime = int(time.time() - j.get("started_at", time.time()))
        out.append(f"job {j['name']}  user {j.get('user', '?')}  mode {j.get('mode')}  "
                   f"workers {j.get('workers')}  ps {j.get('ps')}  backend {j.get('backend')}  "
                   f"up {uptime // 60}m{uptime % 60:02d}s  gpus {','.join(gpus) or '-'}")
        out.append(format_table(rows(read_records(j["state_dir"]))))
        out.append("")
    return "\n".join(out).rstrip()


def _top(args) -> int:
    import time
    if args.once:
        print(top_text(args.run_dir))
        return 0
    # A terminal's screen is redrawn; into a pipe or file the screens follow
    # one another, a blank line apart, as `top -b`'s.
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            sys.stdout.write(clear + top_text(args.run_dir) + ("\n" if clear else "\n\n"))
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def add_commands(commands) -> None:
    run = commands.add_parser(
        "run", help="run a training script data-parallel: allocate, launch, supervise",
        description="Runs COMMAND as the workers of a data-parallel job.",
        usage="deepnex run [options] -- COMMAND [ARGS ...]")
    run.add_argument("--workers", "--nproc-per-node", dest="workers", default=1,
                     type=_workers_value,
                     metavar="N|MIN:MAX",
                     help="worker processes (default 1); --nproc-per-node as in torchrun. "
                          "MIN:MAX: elastic, starts with MIN, grows toward MAX as capacity "
                          "frees and shrinks (down to MIN) when a worker or its node is lost")
    run.add_argument("--nodes", type=int, default=0,
                     help="spread the workers over N nodes, as evenly as possible, as srun -N "
                          "(a backend that places on nodes: slurm); parameter "
                          "servers go to the same nodes (default: where they fit)")
    run.add_argument("--advertise-address", default=None, metavar="ADDR",
                     help="the host the job's processes reach this one at (its store, "
                          "MASTER_ADDR); default 127.0.0.1 when the whole job is local, else "
                          "this host's primary address")
    run.add_argument("--ps", type=int, default=None,
                     help="parameter servers (default 1, or 0 with --mode allreduce)")
    run.add_argument("--mode", default="sync",
                     help="training mode: sync, ssp:S, async or allreduce (default sync)")
    run.add_argument("--gpus-per-worker", type=int, default=0,
                     help="GPUs per worker (default 0: CPU only)")
    run.add_argument("--gpu-mode", default="exclusive", choices=["exclusive", "shared"],
                     help="whole GPUs, or a share of one's memory (default exclusive)")
    run.add_argument("--gpu-memory", default=None,
                     help="GPU memory per GPU, required in shared mode (e.g. 8GiB)")
    add_worker_resources(run)
    run.add_argument("--backend", default="process",
                     choices=["process", "oci", "docker", "slurm", "kubernetes"],
                     help="what starts the containers (default process)")
    run.add_argument("--central", default=None,
                     help="host:port of deepnex-central (default $DEEPNEX_CENTRAL; "
                          "unset: a local allocator over this machine)")
    run.add_argument("--token", default=None,
                     help="deepnex-central token; it decides the user (default $DEEPNEX_TOKEN)")
    run.add_argument("--token-file", default=None, help="file holding the deepnex-central token")
    run.add_argument("--user", default=None,
                     help="user to allocate for (default: the token's with --central, else "
                          "$USER); a user token is refused any user but its own")
    run.add_argument("--restart", default="never",
                     help="never, on-failure[:N] or always[:N] (default never)")
    run.add_argument("--checkpoint-dir", default=None,
                     help="parameter servers checkpoint here and restore when restarted")
    run.add_argument("--optimizer", default="sgd",
                     help="parameter servers' optimizer: sgd, adam, adamw or adagrad (default sgd)")
    run.add_argument("--lr", type=float, default=None,
                     help="learning rate (default: the optimizer's, 0.01; adam and adamw 0.001)")
    run.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    run.add_argument("--name", default=None, help="job id (default job-<random>)")
    run.add_argument("--notify", action="append", metavar="URL",
                     help="with --central: central POSTs the job's events (queued, started, "
                          "worker_restarted, completed, failed, cancelled) to URL (repeatable)")
    run.add_argument("--notify-every", type=float, default=0, metavar="MINUTES",
                     help="with --notify: a job.progress event with rank 0's last "
                          "deepnex.report(step=..., **metrics) every MINUTES (default: never)")
    run.add_argument("--notify-when", default=None, metavar="'METRIC>=NUMBER'",
                     help="with --notify: a job.progress event once, when rank 0's reported "
                          "METRIC first crosses NUMBER (>=, <=, >, < or ==), e.g. "
                          "'accuracy>=0.9'")
    run.add_argument("--state-dir", default=None,
                     help="where the containers' logs and records go (default: in the run "
                          "directory, removed at the end)")
    run.add_argument("--mount", action="append", metavar="SRC:DST[:ro]",
                     help="bind host path SRC at DST in every container (repeatable): the code, "
                          "data and deepnex that a container backend's image lacks")
    run.add_argument("--image", default="host",
                     help="what the workers run in (default host: this host's files and "
                          "environment): an OCI layout or rootfs directory (oci), an image "
                          "reference (docker, kubernetes), or with --central a catalog name; "
                          "in an image the workers get the job's variables (RANK, "
                          "DEEPNEX_*, ...), not this shell's environment")
    run.add_argument("--workdir", default=None,
                     help="the containers' working directory, relative to the current one "
                          "(default: the current one)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="each worker's command and its arguments")
    run.set_defaults(func=_run)

    top = commands.add_parser("top", help="the jobs running here: containers, GPUs, CPU, memory")
    top.add_argument("--once", action="store_true",
                     help="print once instead of refreshing (into a pipe or file without it: "
                          "a screen every --interval, one after another, as top -b)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--run-dir", default=None,
                     help="where jobs register (default $DEEPNEX_RUN_DIR or /tmp/deepnex-UID/jobs)")
    top.set_defaults(func=_top)
