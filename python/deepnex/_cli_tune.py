"""``deepnex tune``: hyperparameter search from the command line.

    deepnex tune --space 'lr=loguniform(0.01, 0.5)' --space 'hidden=choice([32, 64, 128])' \\
        --samples 8 --out tune-digits \\
        -- python3 examples/digits/mlp_numpy.py --epochs 12

Each trial runs the command with its configuration appended as --name value,
as a job (deepnex run's): --workers-per-trial workers in --mode (sync,
ssp:S, async, allreduce), each with --cpus cores, --memory (required with
--central) and --gpus-per-worker GPUs.
Trials run at once as far as the machine's cores and GPUs (and
--max-concurrent) allow; the others wait. In the parameter-server modes a
configuration's lr, momentum and optimizer also go to the servers. --plain
runs each trial as one plain process instead. --metric is maximized, or
minimized with --direction min.

Configurations come from --search (tpe by default where Optuna is
installed); ASHA stops poor trials (on by default; --scheduler hyperband
or none; --max-t from the command's --epochs). A python SCRIPT.py command
runs warm (--cold: fresh interpreters).

While trials run, a status table is redrawn in place on a terminal (a line
per trial start and end otherwise). Ctrl-C or SIGTERM stops the running
trials, writes results.csv and best.json for the finished ones and exits 130
or 143. The search is journalled under --out: --resume OUT continues it.

    deepnex tune show OUT     the trials, the best and each one's reports
    deepnex tune plot OUT     OUT/tune.png: history, curves, parallel coordinates

See deepnex.tune.
"""

import sys

from deepnex._cli_common import add_worker_resources, central_address, central_token


def _warn(message):
    print(f"deepnex tune: {message}", file=sys.stderr, flush=True)


def _modes(args, warn=True):
    """(training mode, direction) from --mode, --job-mode and --direction,
    with the old spellings (--mode max|min, --job-mode) warned about."""
    mode, direction = args.mode, args.direction
    if mode in ("max", "min"):
        if warn:
            _warn(f"--mode {mode} is deprecated for the metric's direction: use --direction "
                  f"{mode} (--mode is now the trials' training mode)")
        if direction is not None and direction != mode:
            raise SystemExit(f"deepnex tune: --mode {mode} and --direction {direction} "
                             "disagree")
        mode, direction = None, mode
    if args.job_mode is not None:
        if warn:
            _warn(f"--job-mode is deprecated: use --mode {args.job_mode}")
        if mode is not None and mode != args.job_mode:
            raise SystemExit(f"deepnex tune: --mode {mode} and --job-mode {args.job_mode} "
                             "disagree")
        mode = args.job_mode
    return mode or "allreduce", direction or "max"


# The options a resumed search may take from its command line (where given)
# rather than from the search it continues.
_RESUME_OWN = ("resume", "retries", "max_concurrent", "func") + ("token", "token_file")

# The flags of the trials' jobs (--mode aside: also the old spelling of
# --direction), which --plain trials do not have.
_JOB_FLAGS = ("job_mode", "workers_per_trial", "ps", "cpus", "memory", "gpus_per_worker",
              "backend", "central")

# The credentials for --central: never journalled (the journal outlives the
# search and may be shared), so each run, a resume too, gives them again
# (--token, --token-file or $DEEPNEX_TOKEN).
_SECRET = ("token", "token_file")


# The tune parser's defaults (add_commands), by dest. The parser's own are
# _UNSET, so that a flag given, even with its default value, is told from
# one left out (_given).
_DEFAULTS = {}
_UNSET = object()


def _given(args):
    """The dests of the flags given (--space: non-empty), each left-out one
    set to its default in `args`."""
    given = set()
    for dest, default in _DEFAULTS.items():
        value = getattr(args, dest)
        if value is _UNSET:
            setattr(args, dest, default)
        elif value != [] or default != []:
            given.add(dest)
    return given


def _refuse_changes(args, given, recorded):
    """Refuses flags and a command given with --resume that differ from the
    search's own: a probe's `--resume r --samples 8 --space ...` ran the
    recorded search, saying nothing of what it left out."""
    import argparse
    import os

    before = argparse.Namespace(**{"job_mode": None, "scheduler": None, **recorded})
    from deepnex import tune

    def modes(ns):
        return _modes(ns, warn=False)

    def max_t(ns):
        return _max_t(ns, ns.command[ns.command[:1] == ["--"]:])
    resolve = {"mode": modes, "job_mode": modes, "direction": modes,
               "scheduler": _scheduler, "asha": _scheduler, "max_t": max_t,
               "search": lambda ns: ns.search or tune.default_search()}

    def same(key):
        """Whether the flag comes to what the search resolved for itself:
        --direction max where it was started without --direction, say. One
        that disagrees with the search's other flags is a change."""
        if key not in resolve:
            return False
        after = argparse.Namespace(**{**vars(before), key: getattr(args, key)})
        try:
            return resolve[key](after) == resolve[key](before)
        except SystemExit:
            return False

    def switch(flag, on):
        return flag if on else "--no-" + flag[2:]

    changed = []
    for key in sorted(given - set(_RESUME_OWN), key=list(_DEFAULTS).index):
        value = getattr(args, key)
        flag = "--" + key.replace("_", "-")
        was = recorded.get(key)
        if key == "out":
            if os.path.abspath(value) != os.path.abspath(args.resume):
                changed.append(f"--out {value} (it resumes in {args.resume})")
        elif value == was or same(key):
            continue
        elif key == "mode" and value in ("max", "min"):
            # The old spelling of --direction: it clashes with the direction.
            changed.append(f"--mode {value} (the search's: --direction {modes(before)[1]})")
        elif isinstance(value, bool):
            # A store_true switch (default False) is off unless given.
            off = was is None or (was is False and _DEFAULTS[key] is False)
            changed.append(f"{switch(flag, value)} (" + (
                "the search was started without it" if off
                else f"the search's: {switch(flag, was)}") + ")")
        else:
            changed.append(f"{flag} {value} (" + (
                "the search was started without it" if was is None else f"the search's: {was}")
                + ")")
    command = args.command[args.command[:1] == ["--"]:]
    if command and command != recorded["command"][recorded["command"][:1] == ["--"]:]:
        changed.append("another command")
    if changed:
        raise SystemExit(f"deepnex tune: --resume {args.resume} continues the search as it "
                         f"was started, and was also given {', '.join(changed)}; leave them "
                         "out (only --retries and --max-concurrent may change), or start a new "
                         "search with another --out")


def _max_t(args, command):
    """--max-t, else the command's --epochs, else 100. A --max-t 0 given is
    the scheduler's to refuse, not a flag left out."""
    if args.max_t is not None:
        return args.max_t
    from deepnex import tune
    return tune.command_epochs(command) or 100


def _scheduler(args):
    """--scheduler's value, with --asha / --no-asha (the older spelling)."""
    # getattr: a search journalled before --scheduler has no such flag.
    name, asha = getattr(args, "scheduler", None), args.asha
    if name is not None and asha is not None and name != ("asha" if asha else "none"):
        raise SystemExit(f"deepnex tune: --scheduler {name} and "
                         f"--{'' if asha else 'no-'}asha disagree")
    if name is not None:
        return name
    return "none" if asha is False else "asha"


def _tune(args):
    from deepnex.errors import DeepnexError
    try:
        return _tune_or_raise(args)
    except DeepnexError as e:
        # A bad flag, space or journal, or a check that stopped the search:
        # one line, not a traceback.
        raise SystemExit(f"deepnex tune: {e}") from None


def _tune_or_raise(args):
    import argparse
    from deepnex import tune
    given = _given(args)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    elif command and command[0] in ("show", "plot"):
        if len(command) != 2:
            raise SystemExit(f"deepnex tune: usage: deepnex tune {command[0]} OUT")
        if command[0] == "show":
            tune.show(command[1])
        else:
            print(tune.plot(command[1]))
        return 0
    if args.resume:
        recorded = tune.load(args.resume).note.get("cli")
        if recorded is None:
            raise SystemExit(f"deepnex tune: --resume {args.resume}: the search there was "
                             "not started by deepnex tune (resume it with tune.run)")
        _refuse_changes(args, given, recorded)
        # Old spellings are warned about as typed now, not as recorded (a
        # probe's resume warned of the --mode max it had not typed).
        if given & {"mode", "job_mode"}:
            _modes(args)
        own = {k: v for k, v in vars(args).items() if k in _RESUME_OWN and v is not None}
        # The defaults first: flags added since the search was journalled,
        # and the credentials, which only the command line gives.
        args = argparse.Namespace(**{**_DEFAULTS, **{k: v for k, v in recorded.items()
                                                     if k not in _SECRET},
                                     **own, "out": args.resume})
        command = [w for w in args.command[args.command[:1] == ["--"]:]]
    if not command:
        raise SystemExit("deepnex tune: no command (put it after --)")
    mode, direction = _modes(args, warn=not args.resume)
    if args.plain and not args.resume:
        # They shape the trials' jobs, which --plain does not make: a
        # probe's --plain --central ADDR ran every trial here, saying nothing.
        # (A resume's were checked as the search started, and any given
        # again as it resumed: the search's own, resolved, may be.)
        job_flags = [f"--{dest.replace('_', '-')} {getattr(args, dest)}"
                     for dest in _JOB_FLAGS if dest in given]
        if "mode" in given and args.mode not in ("max", "min"):
            job_flags.insert(0, f"--mode {args.mode}")
        if job_flags:
            raise SystemExit(f"deepnex tune: {', '.join(job_flags)}: --plain runs each trial "
                             "as a plain process on this machine, not as a job; leave "
                             f"{'it' if len(job_flags) == 1 else 'them'} out, or --plain")
    if args.token and args.token_file:
        raise SystemExit(f"deepnex tune: --token and --token-file {args.token_file} were "
                         "both given; give one")
    space = tune.parse_space(args.space)
    scheduler = tune.make_scheduler(_scheduler(args), args.metric, direction,
                                    _max_t(args, command),
                                    min_t=args.min_t, eta=args.eta)
    if args.plain:
        runner = tune.subprocess_runner
    else:
        options = {"backend": args.backend}
        central = central_address(args)
        if central:
            options["central"] = central
            if args.token_file:
                options["central_token_file"] = args.token_file
            else:
                options["central_token"] = central_token(args)
        runner = tune.job_runner(workers=args.workers_per_trial, mode=mode, ps=args.ps,
                                 cpus=args.cpus, memory=args.memory or 0,
                                 gpus_per_worker=args.gpus_per_worker, **options)
    try:
        results = tune.run(command, space, metric=args.metric, mode=direction,
                           num_samples=args.samples, scheduler=scheduler,
                           max_concurrent=args.max_concurrent, seed=args.seed,
                           out_dir=args.out, runner=runner, search=args.search,
                           retries=args.retries or 0, resume=bool(args.resume),
                           warm=False if args.cold else None,
                           note={"cli": {k: v for k, v in vars(args).items()
                                         if k not in ("resume", "func") + _SECRET}})
    except tune.Interrupted as e:
        # The search has said what finished and where the results are.
        return e.exit_code
    return 0 if results.best is not None else 1


def add_commands(commands):
    import argparse
    p = commands.add_parser("tune", help="hyperparameter search (random, grid, TPE, CMA-ES, "
                                         "ASHA, Hyperband); tune show|plot OUT",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", action="append", default=[], metavar="NAME=EXPR",
                   help="a dimension: a literal, uniform(a, b), loguniform(a, b), "
                        "randint(a, b), choice([...]) or grid([...]); repeatable")
    p.add_argument("--samples", type=int, default=4,
                   help="configurations drawn per grid point (default 4)")
    p.add_argument("--metric", default="accuracy",
                   help="the reported metric that ranks trials (default accuracy)")
    p.add_argument("--direction", choices=("max", "min"), default=None,
                   help="whether a higher (max, the default) or a lower (min) metric is "
                        "better")
    p.add_argument("--mode", default=None, metavar="sync|ssp:S|async|allreduce",
                   help="each trial's training mode: sync, ssp:S or async (with parameter "
                        "servers) or allreduce (default)")
    p.add_argument("--job-mode", default=None, help="deprecated: use --mode")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="at most this many trials at once (default: as many as fit; with "
                        "--plain, the local cores)")
    p.add_argument("--workers-per-trial", type=int, default=1,
                   help="workers in each trial's job (default 1)")
    p.add_argument("--ps", type=int, default=None,
                   help="parameter servers per trial (default 1 in the PS modes)")
    add_worker_resources(p)
    p.add_argument("--gpus-per-worker", type=int, default=0,
                   help="GPUs per worker (default 0)")
    p.add_argument("--backend", default="process",
                   help="launch backend of the trials' jobs (default process)")
    p.add_argument("--central", default=None, metavar="ADDR",
                   help="allocate the trials' jobs from deepnex-central at ADDR "
                        "(default $DEEPNEX_CENTRAL)")
    p.add_argument("--token", default=None,
                   help="bearer token for --central (default $DEEPNEX_TOKEN)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="read the token for --central from FILE instead")
    p.add_argument("--cold", action="store_true",
                   help="start each trial in a fresh interpreter (default for a python "
                        "SCRIPT.py command: forked from a warm worker that has imported what "
                        "the script imports)")
    p.add_argument("--plain", action="store_true",
                   help="run each trial as one plain process, not as a job")
    p.add_argument("--search", choices=("random", "grid", "tpe", "cmaes"), default=None,
                   help="how configurations are picked: random, grid (every choice), tpe or "
                        "cmaes (Optuna's samplers, learning from the trials that ended; "
                        "default tpe where Optuna is installed, else random)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the search (default 0). It reproduces the configurations "
                        "of random and grid searches; of tpe and cmaes only with "
                        "--max-concurrent 1 (with trials in parallel, what the model has "
                        "seen depends on which ended first)")
    p.add_argument("--scheduler", choices=("asha", "hyperband", "none"), default=None,
                   help="how poor trials stop early: asha (the default), hyperband "
                        "(brackets of ASHA that stop trials at different first steps) or "
                        "none (every trial runs to its end)")
    p.add_argument("--asha", action=argparse.BooleanOptionalAction, default=None,
                   help="--asha: --scheduler asha; --no-asha: --scheduler none")
    p.add_argument("--min-t", type=int, default=1,
                   help="the scheduler's first rung, in steps (default 1)")
    p.add_argument("--max-t", type=int, default=None,
                   help="the scheduler's budget in steps (default: the command's --epochs, "
                        "else 100)")
    p.add_argument("--retries", type=int, default=None,
                   help="run a failed trial again up to this many times (default 0)")
    p.add_argument("--resume", default=None, metavar="OUT",
                   help="continue the search in OUT: finished trials are kept, running "
                        "and interrupted ones start again, failed ones are retried "
                        "(--retries)")
    p.add_argument("--eta", type=int, default=3,
                   help="the scheduler's reduction factor (default 3)")
    p.add_argument("--out", default="tune-results",
                   help="results directory (default tune-results)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(func=_tune)
    _DEFAULTS.update({a.dest: a.default for a in p._actions
                      if a.option_strings and a.dest != "help"})
    # --space appends to its default, which stays a list.
    p.set_defaults(**{dest: _UNSET for dest, default in _DEFAULTS.items() if default != []})
