"""The GPU commands of the deepnex CLI, against deepnex-central:

    deepnex nodes                       a table of nodes, modes, GPUs, memory
    deepnex alloc --gpus 2 --mode shared --gpu-memory 10GiB
    deepnex release ID
    deepnex allocations [--user U]
    deepnex quota USER --gpus 4 --gpu-memory 40GiB   (USER "default": the default)
    deepnex node mode NAME exclusive|shared [--when-drained]
    deepnex node cordon|uncordon|remove NAME ; deepnex node drain NAME [--release]
    deepnex metrics

The address is --central or $DEEPNEX_CENTRAL; the token --token,
--token-file or $DEEPNEX_TOKEN.
"""

import os
import sys


def add_central_args(p):
    """The options every command against deepnex-central takes."""
    p.add_argument("--central", help="host:port of deepnex-central ($DEEPNEX_CENTRAL)")
    p.add_argument("--token", help="bearer token ($DEEPNEX_TOKEN)")
    p.add_argument("--token-file")
    p.add_argument("--tls-ca-file")
    p.add_argument("--call-timeout", type=float, default=30.0, help="seconds per call")


def client(args):
    """A deepnex.gpu.CentralClient from add_central_args' options."""
    from deepnex import gpu
    address = args.central or os.environ.get("DEEPNEX_CENTRAL")
    if not address:
        raise SystemExit("deepnex: no central address (--central or $DEEPNEX_CENTRAL)")
    token = args.token or (None if args.token_file else os.environ.get("DEEPNEX_TOKEN"))
    return gpu.CentralClient(address, token=token, token_file=args.token_file,
                             tls_ca_file=args.tls_ca_file, timeout=args.call_timeout)


def _size(n):
    from deepnex import format_byte_size
    return format_byte_size(n)


def _nodes(args):
    rows = [("NODE", "MODE", "STATE", "GPUS USED/ALL", "GPU MEMORY USED/ALL", "CPUS USED/ALL",
             "MEMORY USED/ALL")]
    for n in client(args).nodes():
        state = "draining" if n.draining else "cordoned" if n.cordoned else "ready"
        if n.pending_mode:
            state += f" (-> {n.pending_mode})"
        gpus = n.gpus
        used_mem = sum(g["memory_used"] for g in gpus)
        total_mem = sum(g["memory"] for g in gpus)
        rows.append((n.name, n.mode, state, f"{len(gpus) - n.gpus_free}/{len(gpus)}",
                     f"{_size(used_mem)}/{_size(total_mem)}", f"{n.cpus_used}/{n.cpus}",
                     f"{_size(n.memory_used)}/{_size(n.memory)}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _print_allocation(a):
    gpus = ", ".join(f"{g.index}:{_size(g.memory)}{'' if g.exclusive else ' shared'}"
                     for g in a.gpus) or "none"
    print(f"{a.id} user={a.user} node={a.node} gpus=[{gpus}] cpus={a.cpus} "
          f"memory={_size(a.memory)}" + (f" gang={a.gang}/{a.replica}" if a.gang else ""))
    for k, v in sorted(a.env.items()):
        print(f"  {k}={v}")


def _alloc(args):
    from deepnex import gpu
    selector = {}
    for item in args.selector or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"deepnex: --selector {item!r}: expected KEY=VALUE")
        selector[key] = value
    request = gpu.Request(user=args.user or "", gpus=args.gpus, mode=args.mode,
                          gpu_memory=args.gpu_memory, cpus=args.cpus, memory=args.memory,
                          selector=selector, node=args.node, priority=args.priority,
                          replicas=args.replicas, spread=args.spread, lease=args.lease)
    got = client(args).allocate(request, wait=not args.no_wait, timeout=args.timeout)
    for a in got if isinstance(got, list) else [got]:
        _print_allocation(a)
    return 0


def _release(args):
    client(args).release(args.id)
    print(f"released {args.id}")
    return 0


def _allocations(args):
    for a in client(args).allocations(user=args.user):
        _print_allocation(a)
    return 0


def _quota(args):
    c = client(args)
    kw = dict(gpus=args.gpus, gpu_memory=args.gpu_memory, cpus=args.cpus, memory=args.memory)
    note = c.set_default_quota(**kw) if args.user == "default" else c.set_quota(args.user, **kw)
    print(note or f"quota of {args.user} set")
    return 0


def _node(args):
    c = client(args)
    if args.action == "mode":
        if not args.mode:
            raise SystemExit("deepnex: node mode NAME exclusive|shared")
        c.set_node_mode(args.name, args.mode, when_drained=args.when_drained)
    elif args.action == "drain":
        c.drain(args.name, release=args.release)
    else:
        getattr(c, {"cordon": "cordon", "uncordon": "uncordon",
                    "remove": "remove_node"}[args.action])(args.name)
    print(f"node {args.name}: {args.action} done")
    return 0


def _metrics(args):
    sys.stdout.write(client(args).metrics())
    return 0


def guard(fn):
    """fn(args), with a DeepnexError printed as one line and exit code 1."""
    def run(args):
        from deepnex import DeepnexError
        try:
            return fn(args)
        except DeepnexError as e:
            print(f"deepnex: {e}", file=sys.stderr)
            return 1
    return run


def add_commands(commands):
    """Adds the GPU subcommands to the CLI's subparsers."""
    def sub(name, fn, help):
        p = commands.add_parser(name, help=help)
        add_central_args(p)
        p.set_defaults(func=guard(fn))
        return p

    sub("nodes", _nodes, "table of nodes, modes, GPUs used/free, memory")
    p = sub("alloc", _alloc, "allocate GPUs, CPU cores and memory")
    p.add_argument("--user", help="default: the token's user")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--mode", default="exclusive", choices=["exclusive", "shared"])
    p.add_argument("--gpu-memory", default=0, help="per GPU, e.g. 10GiB")
    p.add_argument("--cpus", type=int, default=0)
    p.add_argument("--memory", default=0, help="host memory, e.g. 16GiB")
    p.add_argument("--selector", action="append", help="KEY=VALUE (repeatable)")
    p.add_argument("--node")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--spread", action="store_true")
    p.add_argument("--lease", type=float, help="seconds")
    p.add_argument("--no-wait", action="store_true", help="refuse instead of queueing")
    p.add_argument("--timeout", type=float, help="seconds to wait in the queue")
    p = sub("release", _release, "release an allocation (or a gang) by id")
    p.add_argument("id")
    p = sub("allocations", _allocations, "list allocations")
    p.add_argument("--user")
    p = sub("quota", _quota, "set a user's quota (USER 'default': the default quota)")
    p.add_argument("user")
    p.add_argument("--gpus", type=int)
    p.add_argument("--gpu-memory")
    p.add_argument("--cpus", type=int)
    p.add_argument("--memory")
    p = sub("node", _node, "change a node: mode, cordon, uncordon, drain, remove")
    p.add_argument("action", choices=["mode", "cordon", "uncordon", "drain", "remove"])
    p.add_argument("name")
    p.add_argument("mode", nargs="?", choices=["exclusive", "shared"])
    p.add_argument("--when-drained", action="store_true")
    p.add_argument("--release", action="store_true")
    sub("metrics", _metrics, "Prometheus text metrics")
