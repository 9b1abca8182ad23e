"""The GPU commands of the deepnex CLI, against deepnex-central:

    deepnex nodes                       a table of nodes, modes, GPUs, memory
    deepnex nodes --usage               also what the agents measure: per GPU, cores, memory
    deepnex alloc --gpus 2 --gpu-mode shared --gpu-memory 10GiB   (prints where it waits)
    deepnex release ID
    deepnex allocations [--user U] [--pending]
    deepnex queue [--user U]            the waiting requests, in order, and why they wait
    deepnex quota                       every user's quota beside usage (admin)
    deepnex quota USER                  USER's quota beside usage (USER "default": the default)
    deepnex quota USER --gpus 4 --gpu-memory 40GiB --cpus none   sets the limits given;
                                        "none" clears one, the others stay
    deepnex quota USER --max-priority 10   the highest priority USER may ask for (default 0)
    deepnex node mode NAME exclusive|shared [--when-drained]
    deepnex node cordon|uncordon|remove NAME ; deepnex node drain NAME [--release]
    deepnex metrics                     Prometheus text: the nodes', your containers' usage

The address is --central or $DEEPNEX_CENTRAL; the token --token,
--token-file or $DEEPNEX_TOKEN.
"""

import argparse
import sys
import threading
import time

from deepnex._cli_common import add_central_args, client, format_table, guard, parse_pairs


def _size(n):
    from deepnex import format_byte_size
    return format_byte_size(n)


def _nodes(args):
    rows = [("NODE", "MODE", "STATUS", "HEARTBEAT", "GPUS USED/ALL", "GPU MEMORY USED/ALL",
             "CPUS USED/ALL", "MEMORY USED/ALL", "ADDRESS")]
    if args.usage:  # what the agents measure, beside what is granted
        rows[0] += ("GPU UTIL/MEMORY IN USE", "CPUS BUSY", "MEMORY IN USE")
    now = time.time()
    for n in client(args).nodes():
        # As kubectl: NotReady outranks a cordon, which the admin chose.
        state = ("NotReady" if not n.ready else "Draining" if n.draining
                 else "Cordoned" if n.cordoned else "Ready")
        if n.pending_mode:
            state += f" (-> {n.pending_mode})"
        # Since the node's agent was last heard; "-" for a declared node.
        beat = "-" if n.last_heartbeat is None else f"{_duration(max(0, now - n.last_heartbeat))} ago"
        gpus = n.gpus
        used_mem = sum(g["memory_used"] for g in gpus)
        total_mem = sum(g["memory"] for g in gpus)
        rows.append((n.name, n.mode, state, beat, f"{len(gpus) - n.gpus_free}/{len(gpus)}",
                     f"{_size(used_mem)}/{_size(total_mem)}", f"{n.cpus_used}/{n.cpus}",
                     f"{_size(n.memory_used)}/{_size(n.memory)}", n.address or "-"))
        if args.usage:
            agent = n.last_heartbeat is not None
            # Per GPU where the agent has NVML: "0:42%/3GiB,1:0%/0B".
            gpu_usage = ",".join(f"{g['index']}:{g['utilization']}%/{_size(g['memory_used'])}"
                                 for g in n.gpu_usage)
            rows[-1] += (gpu_usage or "-", f"{n.cpus_busy:.1f}" if agent else "-",
                         _size(n.memory_in_use) if agent else "-")
    print(format_table(rows))
    return 0


def _duration(seconds):
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _print_allocation(a):
    gpus = ", ".join(f"{g.index}:{_size(g.memory)}{'' if g.exclusive else ' shared'}"
                     for g in a.gpus) or "none"
    job = f" job={a.job}" if a.job else ""
    print(f"{a.id} user={a.user}{job} node={a.node} gpus=[{gpus}] cpus={a.cpus} "
          f"memory={_size(a.memory)}" + (f" gang={a.gang}/{a.replica}" if a.gang else ""))
    for k, v in sorted(a.env.items()):
        print(f"  {k}={v}")


def _alloc(args):
    from deepnex import gpu
    selector = parse_pairs(args.selector, "--selector")
    request = gpu.Request(user=args.user or "", gpus=args.gpus, mode=args.gpu_mode,
                          gpu_memory=args.gpu_memory, cpus=args.cpus, memory=args.memory,
                          selector=selector, node=args.node, priority=args.priority,
                          replicas=args.replicas, spread=args.spread, lease=args.lease,
                          job=args.job)
    c = client(args)
    watch = None
    if not args.no_wait:
        watch = _QueueWatch(c, request)
        watch.start()
    try:
        got = c.allocate(request, wait=not args.no_wait, timeout=args.timeout)
    finally:
        if watch:
            watch.stop()
    for a in got if isinstance(got, list) else [got]:
        _print_allocation(a)
    return 0


class _QueueWatch:
    """Polls deepnex-central's queue while `deepnex alloc` waits, and prints
    where its request waits and why ("queued at position N: REASON") to
    stderr, once and again whenever that changes.

    The allocate call does not learn its place in the queue, so the request
    is recognized as the entry that was not there before it was sent and has
    its user, sizes and priority."""

    def __init__(self, c, request, poll=0.5):
        from deepnex import DeepnexError
        self._c, self._r, self._poll = c, request, poll
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        try:
            self._before = {p["id"] for p in c.pending()}
        except DeepnexError:
            self._before = None  # no view of the queue: print nothing

    def _mine(self, p):
        r = self._r
        return (p["id"] not in self._before and (not r.user or p["user"] == r.user) and
                (p["gpus"], p["mode"], p["cpus"], p["replicas"], p["priority"]) ==
                (r.gpus, r.mode, r.cpus, r.replicas, r.priority))

    def _run(self):
        from deepnex import DeepnexError
        mine, shown, delay = None, None, 0
        while not self._stopped.wait(delay):
            delay = self._poll
            try:
                pending = self._c.pending()
            except DeepnexError:
                return
            if mine is None:
                found = [p for p in pending if self._mine(p)]
                if not found:
                    continue
                mine = found[0]["id"]
            entry = next((p for p in pending if p["id"] == mine), None)
            if entry is None:
                return  # granted or refused: allocate returns
            now = (entry["position"], entry["reason"])
            if now != shown:
                shown = now
                print(f"queued at position {now[0]}: {now[1]}", file=sys.stderr, flush=True)

    def start(self):
        if self._before is not None:
            self._thread.start()

    def stop(self):
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _release(args):
    client(args).release(args.id)
    print(f"released {args.id}")
    return 0


def _allocations(args):
    if args.pending:
        return _queue(args)
    rows = [("ID", "USER", "JOB", "NODE", "MODE", "GPU INDICES", "GPU MEMORY", "CPUS", "MEMORY",
             "GANG")]
    for a in client(args).allocations(user=args.user):
        mode = "-" if not a.gpus else "exclusive" if a.gpus[0].exclusive else "shared"
        rows.append((a.id, a.user, a.job or "-", a.node, mode,
                     ",".join(str(g.index) for g in a.gpus) or "-",
                     _size(a.gpus[0].memory) if a.gpus else "-", str(a.cpus), _size(a.memory),
                     f"{a.gang}/{a.replica}" if a.gang else "-"))
    print(format_table(rows))
    return 0


def _queue(args):
    rows = [("POS", "ID", "USER", "GPUS", "MODE", "GPU MEMORY", "CPUS", "MEMORY", "REPLICAS",
             "PRIORITY", "WAITED", "REASON")]
    for p in client(args).pending(user=args.user):
        rows.append((str(p["position"]), p["id"], p["user"], str(p["gpus"]),
                     p["mode"] if p["gpus"] else "-",
                     _size(p["gpu_memory"]) if p["gpu_memory"] else "-", str(p["cpus"]),
                     _size(p["memory"]) if p["memory"] else "-", str(p["replicas"]),
                     str(p["priority"]),
                     _duration(p["waited"]), p["reason"]))
    print(format_table(rows))
    return 0


_LIMITS = ("gpus", "gpu_memory", "cpus", "memory")
_UNSET = object()  # a limit flag not given


def _limit(kind):
    """An argparse type: "none" (no limit) or a count / byte size."""
    def parse(text):
        if text == "none":
            return None
        if kind == "count":
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected a count or none, got {text!r}") from None
        return text  # a byte size, checked by set_quota
    return parse


def _quota_rows(entries):
    def cell(e, key):
        limit, used = e["quota"][key], e["usage"][key]
        fmt = str if key in ("gpus", "cpus") else _size
        used = fmt(used) if e["user"] else "-"  # the default quota has no usage
        return f"{used}/{'unlimited' if limit is None else fmt(limit)}"
    rows = [("USER", "QUOTA", "GPUS USED/LIMIT", "GPU MEMORY USED/LIMIT", "CPUS USED/LIMIT",
             "MEMORY USED/LIMIT", "MAX PRIORITY")]
    for e in entries:
        rows.append((e["user"] or "default", "own" if e["own"] else "default",
                     *(cell(e, k) for k in _LIMITS), str(e["quota"]["max_priority"])))
    return rows


def _quota(args):
    if args.user is not None and not args.user.strip():
        raise SystemExit(f"deepnex: quota: USER {args.user!r} is empty; name a user "
                         "(or 'default')")
    c = client(args)
    default = args.user == "default"

    def current():
        if args.user is None:
            return c.quotas()
        if default:
            return [e for e in c.quotas() if not e["user"]]
        return c.quotas(user=args.user)

    given = {k: getattr(args, k) for k in _LIMITS + ("max_priority",)
             if getattr(args, k) is not _UNSET}
    if given and args.user is None:
        raise SystemExit("deepnex: quota: name the USER (or 'default') whose limits to set")
    if given:
        # The limits not named stay as they are: only "none" clears one.
        [entry] = current()
        limits = dict(entry["quota"], **given)
        note = c.set_default_quota(**limits) if default else c.set_quota(args.user, **limits)
        print(f"quota of {args.user} set")
        if note:
            print(note)
    print(format_table(_quota_rows(current())))
    return 0


def _node(args):
    c = client(args)
    if args.action == "mode":
        if not args.mode:
            raise SystemExit("deepnex: node mode NAME exclusive|shared")
        c.set_node_mode(args.name, args.mode, when_drained=args.when_drained)
        [info] = [n for n in c.nodes() if n.name == args.name]
        if info.pending_mode:
            print(f"node {args.name}: switch to {info.pending_mode} pending; the node takes no "
                  f"new GPU allocations and switches once its {info.mode} ones are released")
        else:
            print(f"node {args.name}: mode {info.mode}")
        return 0
    if args.action == "drain":
        c.drain(args.name, release=args.release)
        done = "drained, its allocations released" if args.release else "draining (cordoned)"
    else:
        getattr(c, {"cordon": "cordon", "uncordon": "uncordon",
                    "remove": "remove_node"}[args.action])(args.name)
        done = {"cordon": "cordoned", "uncordon": "uncordoned", "remove": "removed"}[args.action]
    print(f"node {args.name}: {done}")
    return 0


def _metrics(args):
    sys.stdout.write(client(args).metrics())
    return 0


class _DeprecatedMode(argparse.Action):
    """alloc's old --mode: still works, with a warning to use --gpu-mode."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("deepnex: --mode is deprecated; use --gpu-mode", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_commands(commands):
    """Adds the GPU subcommands to the CLI's subparsers."""
    def sub(name, fn, help):
        p = commands.add_parser(name, help=help, description=help)
        add_central_args(p)
        p.set_defaults(func=guard(fn))
        return p

    p = sub("nodes", _nodes, "table of nodes, modes, status, GPUs used/free, memory")
    p.add_argument("--usage", action="store_true",
                   help="also what each agent's node uses now: cores busy, memory in use, "
                        "and per GPU (with NVML) utilisation and memory in use")
    p = sub("alloc", _alloc, "allocate GPUs, CPU cores and memory; while the request waits, "
                             "print its place in the queue and why")
    p.add_argument("--user", help="whom to allocate for (admins); default: the token's user")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per part (default 0: CPU only)")
    p.add_argument("--gpu-mode", default="exclusive", choices=["exclusive", "shared"],
                   help="exclusive: whole GPUs; shared: --gpu-memory of each GPU "
                        "(default exclusive)")
    p.add_argument("--mode", dest="gpu_mode", choices=["exclusive", "shared"],
                   action=_DeprecatedMode, default=argparse.SUPPRESS,
                   help="deprecated alias of --gpu-mode")
    p.add_argument("--gpu-memory", default=0,
                   help="per GPU, e.g. 10GiB: what a shared GPU grants, the least an exclusive "
                        "one must have")
    p.add_argument("--cpus", type=int, default=0, help="CPU cores per part")
    p.add_argument("--memory", default=0, help="host memory per part, e.g. 16GiB")
    p.add_argument("--selector", action="append",
                   help="KEY=VALUE node label the node must have (repeatable)")
    p.add_argument("--node", help="only this node")
    p.add_argument("--priority", type=int, default=0, help="higher waits ahead in the queue")
    p.add_argument("--job", help="the job it is for, shown by `deepnex allocations`")
    p.add_argument("--replicas", type=int, default=1,
                   help="parts of a gang, granted all together or not at all")
    p.add_argument("--spread", action="store_true",
                   help="prefer the emptiest node instead of packing")
    p.add_argument("--lease", type=float,
                   help="seconds; the allocation is released unless renewed within them")
    p.add_argument("--no-wait", action="store_true", help="refuse instead of queueing")
    p.add_argument("--timeout", type=float, help="seconds to wait in the queue (default: no limit)")
    p = sub("release", _release, "release an allocation (or a gang) by id")
    p.add_argument("id", help="allocation id (a<N>) or gang id (g<N>)")
    p = sub("allocations", _allocations, "table of allocations (--pending: waiting requests)")
    p.add_argument("--user", help="only this user's (a user token sees only its own)")
    p.add_argument("--pending", action="store_true",
                   help="list the requests waiting in the queue instead (as deepnex queue)")
    p = sub("queue", _queue, "table of the requests waiting in the queue, in order, with why "
                             "each waits")
    p.add_argument("--user", help="only this user's (a user token sees only its own)")
    p = sub("quota", _quota, "show quotas beside usage, or set a user's limits")
    p.add_argument("user", nargs="?",
                   help="whose quota ('default': the default quota); none: every user's "
                        "(admins)")
    p.add_argument("--gpus", type=_limit("count"), default=_UNSET,
                   help="most GPUs held at once, or none for no limit")
    p.add_argument("--gpu-memory", type=_limit("size"), default=_UNSET,
                   help="most GPU memory held at once, e.g. 40GiB, or none")
    p.add_argument("--cpus", type=_limit("count"), default=_UNSET,
                   help="most CPU cores held at once, or none")
    p.add_argument("--memory", type=_limit("size"), default=_UNSET,
                   help="most host memory held at once, e.g. 128GiB, or none")
    p.add_argument("--max-priority", type=int, default=_UNSET,
                   help="the highest priority the user may ask for (default 0; higher is refused)")
    p = sub("node", _node, "change a node: mode, cordon, uncordon, drain, remove")
    p.add_argument("action", choices=["mode", "cordon", "uncordon", "drain", "remove"],
                   help="what to do")
    p.add_argument("name", help="the node")
    p.add_argument("mode", nargs="?", choices=["exclusive", "shared"],
                   help="the GPU mode to switch to (action mode)")
    p.add_argument("--when-drained", action="store_true",
                   help="mode: if the node holds GPU allocations, switch once they are released "
                        "instead of refusing")
    p.add_argument("--release", action="store_true",
                   help="drain: also release every allocation on the node")
    sub("metrics", _metrics, "deepnex-central's metrics as Prometheus text: the nodes' series and "
                             "your containers' (an admin's token: every user's; a job's: none)")
