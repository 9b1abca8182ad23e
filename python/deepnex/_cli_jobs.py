"""The job records of deepnex-central, as squeue and sacct show them:

    deepnex jobs [--all] [--user U] [--state pending|running|completed|failed|cancelled]
                 [--since T]      jobs that have not ended; --all, --since or an ended
                                  --state: the history too. T: YYYY-MM-DD[THH:MM[:SS]]
                                  (local time), seconds since the epoch, or an age (30m, 2h, 7d)
    deepnex job show NAME        one job in detail, its containers per node
    deepnex job cancel NAME      stop it everywhere: central releases its allocations and
                                 stops its containers; its `deepnex run` exits non-zero

Jobs come from `deepnex run --central`. Users see their own jobs; admins
everyone's (--user filters). The address and token are as for the GPU
commands (--central, --token, --token-file or $DEEPNEX_CENTRAL, $DEEPNEX_TOKEN).
"""

import datetime
import re
import shlex
import time

from deepnex._cli_common import add_central_args, client, format_table, guard, printable

STATES = ("pending", "running", "completed", "failed", "cancelled")
HEADER = ("NAME", "USER", "STATE", "NODES", "WORKERS", "ELAPSED", "GPU-H", "CPU-H", "PEAK-MEM",
          "EXIT", "LAST REPORT")
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text, now=None):
    """--since T as seconds since the epoch: a date and time (local), seconds
    since the epoch, or an age back from `now` (30m, 2h, 7d). A SystemExit
    naming the flag and the value otherwise."""
    from deepnex.gpu import MAX_EPOCH_SECONDS  # here: the parser loads no compiled module
    now = time.time() if now is None else now
    age = _AGE.fullmatch(text)
    value = None
    if age:
        value = now - float(age.group(1)) * _UNIT[age.group(2)]
    else:
        try:
            value = float(text)
        except ValueError:
            try:
                value = datetime.datetime.fromisoformat(text).timestamp()
            except ValueError:
                pass
    if value is not None and 0 < value < MAX_EPOCH_SECONDS:
        return value
    raise SystemExit(f"deepnex: --since {text!r}: expected a time (YYYY-MM-DD[THH:MM[:SS]] "
                     "or seconds since the epoch, before the year 10000) or an age (30m, 2h, 7d)")


def elapsed(seconds):
    """As sacct: [D-]HH:MM:SS."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{days}-{text}" if days else text


def _size(n):
    from deepnex import _C
    return _C.format_byte_size(int(n)) if n else "-"


def _ended(job):
    return job["state"] in ("completed", "failed", "cancelled")


def _number(v):
    return f"{v:.6g}"


def last_report(job, limit=None):
    """Rank 0's last deepnex.report() as `step N metric=v ...` ("-": none);
    cut to `limit` characters with "..." (the table's column)."""
    r = job.get("report")
    if not r:
        return "-"
    text = " ".join([f"step {r['step']}"] +
                    [f"{k}={_number(v)}" for k, v in sorted(r["metrics"].items())])
    if limit is not None and len(text) > limit:
        text = text[:limit - 3] + "..."
    return text


def rows(jobs):
    """The table's rows (HEADER first)."""
    out = [HEADER]
    for j in jobs:
        out.append((j["name"], j["user"], j["state"], ",".join(j["nodes"]) or "-",
                    str(j["workers"]), elapsed(j["elapsed"]), f"{j['gpu_hours']:.2f}",
                    f"{j['cpu_hours']:.2f}", _size(j["peak_memory"]),
                    str(j["exit_code"]) if _ended(j) else "-", last_report(j, 40)))
    return out


def _when(ms):
    if not ms:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def _elastic(j):
    """" (elastic 1:2, 3 resizes: resized from ...)" for an elastic job."""
    if j["min_workers"] == j["max_workers"]:
        return ""
    last = f": {j['last_resize']}" if j["last_resize"] else ""
    return f" (elastic {j['min_workers']}:{j['max_workers']}, {j['resizes']} resizes{last})"


def show_text(j):
    """`deepnex job show`'s text for job dict `j`."""
    state = j["state"] + (f" (exit {j['exit_code']})" if _ended(j) else "")
    lines = [
        f"name:        {j['name']}",
        f"user:        {j['user']}",
        f"state:       {state}",
        f"command:     {shlex.join(j['command'])}",
        f"mode:        {j['mode']}, {j['workers']} workers{_elastic(j)}, "
        f"{j['ps']} parameter servers",
        f"submitted:   {_when(j['submitted_ms'])}",
        f"started:     {_when(j['started_ms'])}",
        f"ended:       {_when(j['ended_ms'])}",
        f"elapsed:     {elapsed(j['elapsed'])}",
        f"gpu-hours:   {j['gpu_hours']:.4f}",
        f"cpu-hours:   {j['cpu_hours']:.4f}",
        f"peak memory: {_size(j['peak_memory'])}",
        f"restarts:    {j['restarts']}",
        f"last report: {last_report(j)}" + (f" (at {_when(j['report']['time_ms'])})"
                                            if j.get("report") else ""),
    ]
    if j["message"]:
        lines.append(f"message:     {j['message']}")
    lines.append("allocations:")
    for a in j["allocations"]:
        lines.append(f"  {a['id']}  node {a['node']}  {a['gpus']} GPUs  {a['cpus']} CPUs  "
                     f"{_size(a['memory'])}")
    lines.append("containers:")
    nodes = []
    for c in j["containers"]:
        if c["node"] not in nodes:
            nodes.append(c["node"])
    for node in nodes:
        lines.append(f"  node {node}:")
        table = [("NAME", "ROLE", "STATE", "RESTARTS", "CPU-S", "PEAK-MEM", "LAST-EXIT")]
        for c in j["containers"]:
            if c["node"] == node:
                table.append((c["name"], c["role"] or "-", c["state"], str(c["restarts"]),
                              f"{c['cpu_seconds']:.2f}", _size(c["memory_peak"]),
                              c["last_exit"] or "-"))
        lines.extend("    " + line for line in format_table(table).splitlines())
    return "\n".join(printable(line) for line in lines)


def _jobs(args):
    if args.state is not None and args.state not in STATES:
        raise SystemExit(f"deepnex: --state {args.state!r} is not one of {', '.join(STATES)}")
    since = parse_since(args.since) if args.since is not None else None
    jobs = client(args).jobs(all=args.all, user=args.user, state=args.state, since=since)
    print(format_table(rows(jobs)))
    return 0


def _show(args):
    print(show_text(client(args).job(args.name)))
    return 0


def _cancel(args):
    j = client(args).cancel_job(args.name)
    print(f"job {j['name']} cancelled; its allocations are released")
    return 0


def add_commands(commands):
    p = commands.add_parser("jobs", help="deepnex-central's jobs, as squeue / sacct")
    add_central_args(p)
    p.add_argument("--all", action="store_true", help="ended jobs too (the history)")
    p.add_argument("--user", help="whose jobs (admins; default everyone's)")
    p.add_argument("--state", help=f"only jobs in this state: {', '.join(STATES)}")
    p.add_argument("--since",
                   help="jobs not ended before T, history included: YYYY-MM-DD[THH:MM[:SS]] "
                        "(local time), seconds since the epoch, or an age such as 30m, 2h, 7d")
    p.set_defaults(func=guard(_jobs))

    job = commands.add_parser("job", help="one of deepnex-central's jobs: show, cancel")
    sub = job.add_subparsers(dest="job_command", metavar="COMMAND", required=True)
    show = sub.add_parser("show", help="a job in detail, with its containers per node")
    add_central_args(show)
    show.add_argument("name", help="the job's name")
    show.set_defaults(func=guard(_show))
    cancel = sub.add_parser("cancel", help="stop a job everywhere and release its allocations")
    add_central_args(cancel)
    cancel.add_argument("name", help="the job's name")
    cancel.set_defaults(func=guard(_cancel))
