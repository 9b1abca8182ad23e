"""``deepnex ps``: a table of the containers that launchers run; and the
containers of deepnex-central's launcher.

    deepnex ps --state-dir D       (or $DEEPNEX_STATE_DIR)
    deepnex ps --central ADDR      (or $DEEPNEX_CENTRAL): the caller's containers there
    deepnex ps --all               every user's containers there, with USER and NODE (admins)
    deepnex launch --central ADDR --alloc ID [--name N] [--cpus C] [--memory M]
                   [--restart P] [--env K=V] [--mount SRC:DST[:ro]] [--workdir D] -- CMD ...
    deepnex logs NAME [--follow]   (--follow: then "container NAME <how it
                                    ended>" on stderr, and its exit code)
    deepnex stop NAME [--grace S]

The commands against deepnex-central take its address and token as the GPU
commands do (--central, --token, --token-file or $DEEPNEX_CENTRAL,
$DEEPNEX_TOKEN).

Each Launcher keeps a JSON record per container under
``<state_dir>/containers/<name>/record.json``; ps reads them and the usage
live from each container's cgroup (or, for the process backend without
cgroups, its processes). A running container whose launcher process is gone
shows as "orphaned" (``launcher.cleanup(id)`` sweeps it).

record.json (written atomically by WriteRecordLocked in
src/launch/launcher.cc at every change of state) is one JSON object:

    name, launcher_id, launcher_pid   the container and the launcher running it
    backend, id, run_name             the backend, its id of the run (process:
                                      the pid), the run's name there
    cgroup                            the run's cgroup, for backends that name one
    state                             starting, running, restarting, stopped or exited
    restarts, last_exit               restarts so far; ExitStatus text, once one ended
    image, command, user, cpus, memory, pids_limit, restart   from the spec
    allocation, gpus                  the allocation's id (if any), its GPU indices
    started_at                        seconds since the epoch
    usage                             {cpu_seconds, memory, memory_peak, pids}
                                      when last sampled

ps reads name, backend, state, restarts, gpus, cpus, memory, last_exit,
usage and, for live usage, launcher_pid, id and cgroup. deepnex-central's
records (deepnex.gpu.CentralClient.containers) have no launcher_pid and
come with state and usage live.

rows() turns records into the table's rows, so a server that holds the same
records (deepnex-central) can serve the same table.
"""

import argparse
import glob
import json
import os
import re
import secrets
import signal
import sys

from deepnex import _C
from deepnex._cli_common import (add_central_args, central_address, client, format_table,
                                 guard, parse_pairs)

HEADER = ("NAME", "BACKEND", "STATE", "RESTARTS", "GPU INDICES", "CPUS", "MEMORY LIMIT",
          "CPU SECONDS", "MEMORY NOW/PEAK", "LAST EXIT")


def read_records(state_dir):
    """The records under state_dir, sorted by name; unreadable ones are skipped
    (a launcher may be replacing one). The one reader of the records that
    src/launch/record.h describes, key by key."""
    records = []
    for path in sorted(glob.glob(os.path.join(state_dir, "containers", "*", "record.json"))):
        try:
            with open(path) as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            continue
    return records


def _alive(pid):
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"
    except (OSError, ValueError, IndexError):
        return False


def _live(record):
    """The record's state and usage as they are now."""
    state = record.get("state", "?")
    usage = record.get("usage") or {}
    # deepnex-central's records (no launcher_pid) come with live state and usage.
    if state in ("starting", "running", "restarting") and "launcher_pid" in record:
        if not _alive(record["launcher_pid"]):
            state = "orphaned"
        pid = int(record["id"]) if record.get("backend") == "process" and str(
            record.get("id", "")).isdigit() else 0
        now = _C.launch.recorded_usage(record.get("cgroup", ""), pid)
        if now is not None:
            usage = now
    return state, usage


def _size(n):
    """A limit or a measured size ("256MiB", "12.3MiB"); "-" for none."""
    return _C.format_byte_size(int(n)) if n else "-"


def rows(records, node=False, user=False):
    """The table's rows (HEADER first) for records of containers; with `node`,
    a NODE column after NAME (deepnex-central's: where each runs); with
    `user`, a USER column first (whose each is)."""
    out = [HEADER]
    for r in records:
        state, u = _live(r)
        gpus = ",".join(str(g) for g in r.get("gpus", [])) or "-"
        cpus = r.get("cpus") or 0
        out.append((
            r.get("name", "?"), r.get("backend", "?"), state, str(r.get("restarts", 0)), gpus,
            f"{cpus:g}" if cpus else "-", _size(r.get("memory", 0)),
            f"{u.get('cpu_seconds', 0):.2f}",
            f"{_size(u.get('memory', 0))}/{_size(u.get('memory_peak', 0))}",
            r.get("last_exit", "-")))
    if node:
        out = [(row[0], "NODE" if i == 0 else records[i - 1].get("node") or "-") + tuple(row[1:])
               for i, row in enumerate(out)]
    if user:
        out = [("USER" if i == 0 else records[i - 1].get("user") or "-",) + tuple(row)
               for i, row in enumerate(out)]
    return out


def _ps(args):
    if args.all:  # an admin's view of deepnex-central: every user's, with USER and NODE
        if args.state_dir:
            raise SystemExit("deepnex: ps: --all lists deepnex-central's containers; "
                             f"--state-dir {args.state_dir!r} is a launcher's")
        print(format_table(rows(client(args).containers(all=True), node=True, user=True)))
        return 0
    state_dir = None if args.central else args.state_dir or os.environ.get("DEEPNEX_STATE_DIR")
    if state_dir:
        # A mistyped directory is not an empty launcher.
        if not os.path.isdir(state_dir):
            given = "--state-dir" if args.state_dir else "$DEEPNEX_STATE_DIR"
            raise SystemExit(f"deepnex: ps: {given} {state_dir!r} is not a directory")
        print(format_table(rows(read_records(state_dir))))
        return 0
    if not central_address(args):
        raise SystemExit("deepnex: no launcher state directory (--state-dir or $DEEPNEX_STATE_DIR)"
                         " and no central address (--central or $DEEPNEX_CENTRAL)")
    records = client(args).containers()
    if len({r["user"] for r in records}) > 1:  # an admin's view: say whose
        records = [dict(r, name=f"{r['user']}/{r['name']}") for r in records]
    print(format_table(rows(records, node=True)))
    return 0


def _launch(args):
    from deepnex import launch
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise SystemExit("deepnex: launch: no command (deepnex launch ... -- CMD ...)")
    name = args.name or f"{os.path.basename(command[0])[:40]}-{secrets.token_hex(3)}"
    spec = launch.ContainerSpec(
        name=name, command=command, image=args.image, env=parse_pairs(args.env, "--env"),
        working_dir=args.workdir or "", mounts=[launch.Mount.parse(m) for m in args.mount or []],
        cpus=args.cpus, memory=args.memory,
        pids_limit=args.pids_limit, labels=parse_pairs(args.label, "--label"), restart=args.restart,
        host_network=args.host_network)
    c = client(args).start_container(spec, args.alloc)
    print(f"{c['name']} {c['state']} on {c['allocation']} ({c['backend']} {c['id']})")
    return 0


def exit_code(last_exit):
    """The shell's exit code for a container's last exit ("exited(3)",
    "signaled(SIGTERM)", "oom_killed", "lost", maybe with " after N
    restarts"): the code; 128 + the signal; 1 for anything else."""
    m = re.match(r"(\w+)(?:\((.*?)\))?", last_exit or "")
    reason, arg = (m[1], m[2]) if m else ("", None)
    if reason == "exited" and arg is not None and arg.isdigit():
        return int(arg)
    if reason == "signaled" and arg:
        number = arg[len("signal "):] if arg.startswith("signal ") else None
        if number is not None and number.isdigit():
            return 128 + int(number)
        if arg in signal.Signals.__members__:
            return 128 + signal.Signals[arg].value
    return 1


def _logs(args):
    central = client(args)
    logs = central.container_logs(args.name, follow=args.follow, user=args.user)
    for piece in logs if args.follow else [logs]:
        sys.stdout.write(piece)
        sys.stdout.flush()
    if not args.follow:
        return 0
    # Followed to its end for good: say how it ended, and end the same way,
    # so that `deepnex logs -f NAME && next` chains on the container.
    c = next((c for c in central.containers(user=args.user) if c["name"] == args.name), None)
    last_exit = (c or {}).get("last_exit", "")
    print(f"container {args.name} {last_exit or (c or {}).get('state', 'gone')}",
          file=sys.stderr, flush=True)
    return exit_code(last_exit)


def _stop(args):
    c = client(args).stop_container(args.name, grace=args.grace, user=args.user)
    released = ", allocation released" if c["allocation_released"] else ""
    print(f"{c['name']} {c['state']} {c.get('last_exit', '')}{released}".replace("  ", " "))
    return 0


def add_commands(commands):
    ps = commands.add_parser("ps", help="a table of containers: state, GPUs, CPU and memory")
    ps.add_argument("--state-dir",
                    help="the launchers' state_dir, an existing directory (default "
                    "$DEEPNEX_STATE_DIR); without it, deepnex-central's containers")
    ps.add_argument("--all", action="store_true",
                    help="every user's containers on deepnex-central, with USER and NODE "
                    "(admins)")
    add_central_args(ps)
    ps.set_defaults(func=guard(_ps))

    p = commands.add_parser("launch", help="start a container on an allocation of deepnex-central")
    add_central_args(p)
    p.add_argument("--alloc", required=True, help="the allocation id it runs on (yours)")
    p.add_argument("--name", help="default: the command's name and a random suffix")
    p.add_argument("--image", default="host",
                   help="NAME[:TAG] or OWNER/NAME[:TAG] from `deepnex images` (default: host, "
                   "the host's /usr and /opt read-only, where the admin lists it)")
    p.add_argument("--cpus", type=float, default=0, help="cores (default: the allocation's)")
    p.add_argument("--memory", default=0, help="e.g. 256MiB (default: the allocation's)")
    p.add_argument("--pids-limit", type=int, default=0,
                   help="most processes at once (default 0: 4096 where the backend limits "
                        "them: process, oci, docker)")
    p.add_argument("--restart", default="never", help="never, on-failure[:N], always[:N]")
    p.add_argument("--env", action="append", help="KEY=VALUE (repeatable)")
    p.add_argument("--label", action="append", help="KEY=VALUE (repeatable)")
    p.add_argument("--mount", action="append", metavar="SRC:DST[:ro]",
                   help="bind host path SRC at DST (repeatable); deepnex-central allows only "
                        "sources under its --allow-mount directories")
    p.add_argument("--workdir", help="the command's working directory in the container")
    p.add_argument("--host-network", action="store_true",
                   help="oci: share the host's network (deepnex-central allows it only to "
                        "the users its --allow-host-network names); default: a private "
                        "network with only its own loopback")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARG ...")
    p.set_defaults(func=guard(_launch))

    p = commands.add_parser("logs", help="a container's output on deepnex-central")
    add_central_args(p)
    p.add_argument("name", help="the container's name")
    p.add_argument("--follow", "-f", action="store_true",
                   help="until it ends for good; then print \"container NAME exited(N)\" (or "
                   "how it ended) on stderr and exit with its code (128+N for signal N, 1 "
                   "when lost or OOM-killed)")
    p.add_argument("--user", help="whose container (admins)")
    p.set_defaults(func=guard(_logs))

    p = commands.add_parser("stop", help="stop a container on deepnex-central")
    add_central_args(p)
    p.add_argument("name", help="the container's name")
    p.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")
    p.add_argument("--user", help="whose container (admins)")
    p.set_defaults(func=guard(_stop))
