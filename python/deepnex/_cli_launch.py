"""``deepnex ps``: a table of the containers that launchers run.

    deepnex ps --state-dir D       (or $DEEPNEX_STATE_DIR)

Each Launcher keeps a JSON record per container under
``<state_dir>/containers/<name>/record.json``; ps reads them and the usage
live from each container's cgroup (or, for the process backend without
cgroups, its processes). A running container whose launcher process is gone
shows as "orphaned" (``launcher.cleanup(id)`` sweeps it).

rows() turns records into the table's rows, so a server that holds the same
records (deepnex-central) can serve the same table.
"""

import glob
import json
import os

from deepnex import _C

HEADER = ("NAME", "BACKEND", "STATE", "RESTARTS", "GPUS", "CPUS", "MEMORY LIMIT", "CPU SECONDS",
          "MEMORY NOW/PEAK", "LAST EXIT")


def read_records(state_dir):
    """The records under state_dir, sorted by name; unreadable ones are skipped
    (a launcher may be replacing one)."""
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
    if state in ("starting", "running", "restarting"):
        if not _alive(record.get("launcher_pid", 0)):
            state = "orphaned"
        pid = int(record["id"]) if record.get("backend") == "process" and str(
            record.get("id", "")).isdigit() else 0
        now = _C.launch.recorded_usage(record.get("cgroup", ""), pid)
        if now is not None:
            usage = now
    return state, usage


def _size(n):
    """A limit, exactly ("256MiB")."""
    return _C.format_byte_size(int(n)) if n else "-"


def _amount(n):
    """A measured size, to three figures ("12.3MiB")."""
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" or n >= 100 else f"{n:.3g}{unit}"
        n /= 1024


def rows(records):
    """The table's rows (HEADER first) for records of containers."""
    out = [HEADER]
    for r in records:
        state, u = _live(r)
        gpus = ",".join(str(g) for g in r.get("gpus", [])) or "-"
        cpus = r.get("cpus") or 0
        out.append((
            r.get("name", "?"), r.get("backend", "?"), state, str(r.get("restarts", 0)), gpus,
            f"{cpus:g}" if cpus else "-", _size(r.get("memory", 0)),
            f"{u.get('cpu_seconds', 0):.2f}",
            f"{_amount(u.get('memory', 0))}/{_amount(u.get('memory_peak', 0))}",
            r.get("last_exit", "-")))
    return out


def format_table(table):
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def _ps(args):
    state_dir = args.state_dir or os.environ.get("DEEPNEX_STATE_DIR")
    if not state_dir:
        raise SystemExit("deepnex: no launcher state directory (--state-dir or $DEEPNEX_STATE_DIR)")
    print(format_table(rows(read_records(state_dir))))
    return 0


def add_commands(commands):
    ps = commands.add_parser("ps", help="a table of containers: state, GPUs, CPU and memory")
    ps.add_argument("--state-dir", help="the launchers' state_dir (default $DEEPNEX_STATE_DIR)")
    ps.set_defaults(func=_ps)
