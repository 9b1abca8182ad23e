"""``deepnex tune``: hyperparameter search from the command line.

    deepnex tune --space 'lr=loguniform(0.01, 0.5)' --space 'hidden=choice([32, 64, 128])' \\
        --samples 8 --max-concurrent 2 --asha --max-t 12 --out tune-digits \\
        -- python3 examples/digits/mlp_numpy.py --mode allreduce --epochs 12

Each trial runs the command with its configuration appended as --name value;
see deepnex.tune.
"""


def _tune(args):
    from deepnex import tune
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("deepnex tune: no command (put it after --)")
    scheduler = None
    if args.asha:
        scheduler = tune.ASHA(metric=args.metric, mode=args.mode, min_t=args.min_t,
                              max_t=args.max_t, eta=args.eta)
    results = tune.run(command, tune.parse_space(args.space), metric=args.metric,
                       mode=args.mode, num_samples=args.samples, scheduler=scheduler,
                       max_concurrent=args.max_concurrent, seed=args.seed, out_dir=args.out)
    return 0 if results.best is not None else 1


def add_commands(commands):
    import argparse
    p = commands.add_parser("tune", help="hyperparameter search (random, grid, ASHA)",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", action="append", default=[], metavar="NAME=EXPR",
                   help="a dimension: a literal, uniform(a, b), loguniform(a, b), "
                        "randint(a, b), choice([...]) or grid([...]); repeatable")
    p.add_argument("--samples", type=int, default=4,
                   help="configurations drawn per grid point (default 4)")
    p.add_argument("--metric", default="accuracy")
    p.add_argument("--mode", choices=("max", "min"), default="max")
    p.add_argument("--max-concurrent", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--asha", action="store_true", help="stop poor trials early (ASHA)")
    p.add_argument("--min-t", type=int, default=1, help="ASHA's first rung (default 1)")
    p.add_argument("--max-t", type=int, default=100, help="ASHA's budget (default 100)")
    p.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor (default 3)")
    p.add_argument("--out", default="tune-results", help="results directory")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(func=_tune)
