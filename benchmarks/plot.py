#!/usr/bin/env python3
"""Turns the benchmarks' CSV output into PNG charts (matplotlib, Agg).

    python3 benchmarks/plot.py allreduce.csv ps.csv scaling.csv --out charts/

One chart per CSV, <out>/<csv name>.png, titled with what was measured,
where and with how many ranks (as far as the CSV records it). Known layouts:

  allreduce_bench --csv: bus bandwidth (GB/s) against message size (a log
      axis with KiB/MiB ticks), a line per peer ("deepnex shm", "deepnex
      tcp", "torch gloo", "Open MPI").
  ps_bench --csv: goodput (GB/s) against workers, a line for deepnex in
      each mode and one for each peer (torch rpc, torch rpc + malloc, raw
      TCP).
  scaling --csv: two panels against workers, samples/s and time to the
      target accuracy, a line per model and mode.
  launch_bench --csv: the median start-to-running and start-to-exit
      latency of each backend as bars, every round as a dot.
  anything else: the first column is x (a log axis where it spans 100x or
      more, a size axis where it is in bytes); every other numeric column is
      a series. A non-numeric column other than the first (e.g. "mode")
      splits the rows into one series per value. Titled with the file name.
"""

import argparse
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

PS_BENCH_COLUMNS = {"workers", "mode", "deepnex_gbps", "torch_rpc_gbps", "raw_tcp_gbps"}
SCALING_COLUMNS = {"workers", "model", "mode", "samples_per_s", "time_to_target_s"}
LAUNCH_BENCH_COLUMNS = {"backend", "round", "start_to_running_ms", "start_to_exit_ms"}
ALLREDUCE_SUFFIX = "_busbw_gbps"

# allreduce_bench's peers as people know them.
ALLREDUCE_PEERS = {"shm": "deepnex shm", "tcp": "deepnex tcp", "gloo": "torch gloo",
                   "mpi": "Open MPI", "nccl": "NCCL"}
LAUNCH_BACKENDS = {"process": "deepnex process", "oci": "deepnex oci (runc)",
                   "docker": "deepnex docker", "slurm": "deepnex slurm",
                   "kubernetes": "deepnex kubernetes", "runc (plain)": "plain runc run"}
SCALING_MODELS = {"numpy": "NumPy MLP", "torch": "PyTorch MLP"}
SCALING_MODES = {"sync": "sync PS", "async": "async PS", "allreduce": "allreduce"}
# A column's unit suffix -> (axis unit, the name without it).
UNITS = {"gbps": "GB/s", "ms": "ms", "s": "s", "bytes": "bytes"}


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def human_bytes(n):
    """1024 -> "1 KiB", 64 << 20 -> "64 MiB", 512 -> "512 B"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v.is_integer() else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


def _spread(values):
    """"2" or "1-4" for the distinct values of a column ("" if none)."""
    nums = sorted({v for v in (_number(x) for x in values) if v is not None})
    if not nums:
        return ""
    fmt = lambda v: f"{v:g}"  # noqa: E731
    return fmt(nums[0]) if len(nums) == 1 else f"{fmt(nums[0])}-{fmt(nums[-1])}"


def _plural(n_text, word):
    return f"{n_text} {word}" + ("" if n_text == "1" else "s")


def size_axis(ax, xs, label="message size"):
    """A log-2 x axis with ticks at powers of 4 bytes labelled 1 KiB, 4 KiB,
    ..., 64 MiB (thinned to at most 10)."""
    ax.set_xscale("log", base=2)
    low, high = min(xs), max(xs)
    ticks = [1 << k for k in range(0, 63, 2) if low <= (1 << k) <= high]
    step = 1
    while len(ticks[::step]) > 10:
        step += 1
    ax.xaxis.set_major_locator(FixedLocator(ticks[::step] or sorted(set(xs))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_xlabel(f"{label} (log scale)")


def series_of(rows):
    """{label: [(x, y)]} and (x label, y label) for a CSV's rows: the
    generic layout, and ps_bench's."""
    columns = list(rows[0].keys())
    if PS_BENCH_COLUMNS <= set(columns):
        out = {}
        for r in rows:
            x = _number(r["workers"])
            out.setdefault(f"deepnex {r['mode']}", []).append((x, _number(r["deepnex_gbps"])))
        for col, label in (("torch_rpc_gbps", "torch rpc"),
                           ("torch_rpc_malloc_gbps", "torch rpc + malloc"),
                           ("raw_tcp_gbps", "raw TCP (loopback ceiling)")):
            if col in columns:
                # The peers' figures repeat on every mode's row of a worker count.
                points = dict((_number(r["workers"]), _number(r[col])) for r in rows)
                out[label] = sorted(points.items())
        return out, ("workers", "goodput, GB/s")
    x_col = columns[0]
    numeric = [c for c in columns[1:] if all(_number(r[c]) is not None or r[c] in ("", None)
                                             for r in rows)
               and any(_number(r[c]) is not None for r in rows)]
    groups = [c for c in columns[1:] if c not in numeric]
    units = {c.rsplit("_", 1)[-1] for c in numeric}
    # With one unit for every series the unit goes on the axis, not in each name.
    shared = units.pop() if len(units) == 1 and len(numeric) > 1 else None

    def name(c):
        if shared in UNITS and c.endswith("_" + shared):
            c = c[:-len(shared) - 1]
        return c.replace("_", " ")
    out = {}
    for r in rows:
        group = " ".join(r[g] for g in groups if r[g])
        for c in numeric:
            y = _number(r[c])
            if y is None:
                continue
            label = f"{group} {name(c)}".strip() if group else name(c)
            out.setdefault(label, []).append((_number(r[x_col]) if _number(r[x_col]) is not None
                                               else r[x_col], y))
    ylabel = (name(numeric[0]) if len(numeric) == 1
              else UNITS.get(shared, "value") if shared else "value")
    return out, (x_col, ylabel)


def _axis_label(column):
    """"size_bytes" -> "size, bytes"; "workers" -> "workers"."""
    head, _, unit = column.rpartition("_")
    if head and unit in UNITS:
        return f"{head.replace('_', ' ')}, {UNITS[unit]}"
    return column.replace("_", " ")


def draw_lines(ax, series, xlabel, ylabel, sizes=False):
    """Lines with markers; `sizes`: x is in bytes (a size axis). Otherwise
    a log axis where x spans 100x or more, integer ticks where x is whole."""
    categorical = any(isinstance(x, str) for pts in series.values() for x, _ in pts)
    xs_all = [x for pts in series.values() for x, y in pts if y is not None]
    for label, points in series.items():
        points = [(x, y) for x, y in points if y is not None]
        if not points:
            continue
        if not categorical:
            points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel(xlabel)
    if sizes and not categorical and xs_all and min(xs_all) > 0:
        size_axis(ax, xs_all, xlabel)
    elif (not categorical and xs_all and min(xs_all) > 0
            and max(xs_all) >= 100 * min(xs_all)):
        ax.set_xscale("log")
        ax.set_xlabel(f"{xlabel} (log scale)")
    elif not categorical and all(float(x).is_integer() for x in xs_all):
        ax.set_xticks(sorted(set(xs_all)))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def allreduce_series(rows):
    """{peer as people know it: [(size in bytes, busbw GB/s)]}."""
    out = {}
    for c in rows[0]:
        if c.endswith(ALLREDUCE_SUFFIX):
            peer = c[:-len(ALLREDUCE_SUFFIX)]
            out[ALLREDUCE_PEERS.get(peer, peer)] = [
                (_number(r["size_bytes"]), _number(r[c])) for r in rows]
    return out


def draw_allreduce(fig, rows):
    ax = fig.subplots()
    draw_lines(ax, allreduce_series(rows), "message size", "bus bandwidth, GB/s (1e9 B/s)",
               sizes=True)
    ranks = _spread((r.get("ranks") for r in rows))
    hosts = sorted({r["host"] for r in rows if r.get("host")})
    where = (f"{_plural(ranks, 'rank')} on one host ({', '.join(hosts)})" if ranks and hosts
             else f"{_plural(ranks, 'rank')}" if ranks else "ranks and host not recorded")
    ax.set_title(f"allreduce bus bandwidth, float32 sum\n{where}; higher is better")


def draw_ps_bench(fig, rows):
    ax = fig.subplots()
    series, (xlabel, ylabel) = series_of(rows)
    draw_lines(ax, series, xlabel, ylabel)
    r = rows[0]
    model = (f"{_number(r['mb']):g} MiB float32 model" if _number(r.get("mb")) else "model")
    if _number(r.get("partitions")):
        model += f" in {_number(r['partitions']):g} partitions"
    rounds = (f", median of {_number(r['rounds']):g} rounds" if _number(r.get("rounds"))
              else "")
    workers = _spread((x["workers"] for x in rows))
    ax.set_title(f"parameter server push+pull goodput, {model}\n1 server and "
                 f"{_plural(workers, 'worker')} on one host (127.0.0.1){rounds}")


def scaling_series(rows, column):
    out = {}
    for r in rows:
        label = (f"{SCALING_MODELS.get(r['model'], r['model'])}, "
                 f"{SCALING_MODES.get(r['mode'], r['mode'])}")
        out.setdefault(label, []).append((_number(r["workers"]), _number(r[column])))
    return out


def draw_scaling(fig, rows):
    left, right = fig.subplots(1, 2)
    draw_lines(left, scaling_series(rows, "samples_per_s"), "workers",
               "training throughput, samples/s")
    left.set_title("throughput (higher is better)")
    draw_lines(right, scaling_series(rows, "time_to_target_s"), "workers",
               "time to target accuracy, s")
    right.set_title("time to target accuracy (lower is better)")
    workers = _spread((r["workers"] for r in rows))
    fig.suptitle(f"digits MLP under deepnex run: {_plural(workers, 'worker')} on one host "
                 "(local allocator, process backend)")


def draw_launch_bench(fig, rows):
    ax = fig.subplots()
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    metrics = (("start_to_running_ms", "start to running"), ("start_to_exit_ms", "start to exit"))
    width = 0.8 / len(metrics)
    for i, (column, label) in enumerate(metrics):
        for j, b in enumerate(backends):
            values = sorted(v for v in (_number(r[column]) for r in rows if r["backend"] == b)
                            if v is not None)
            if not values:
                continue
            x = j + (i - (len(metrics) - 1) / 2) * width
            ax.bar(x, values[len(values) // 2], width, color=f"C{i}",
                   label=label if j == 0 else None)
            ax.plot([x] * len(values), values, "k.", markersize=3)
    ax.set_xticks(range(len(backends)))
    ax.set_xticklabels([LAUNCH_BACKENDS.get(b, b) for b in backends])
    ax.set_ylabel("latency, ms (bar: median; dots: rounds)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    counts = {sum(1 for r in rows if r["backend"] == b) for b in backends}
    rounds = f"{counts.pop()} rounds each" if len(counts) == 1 else "rounds vary"
    ax.set_title(f"launch latency of a trivial container (true) by backend\n"
                 f"one host, {rounds}; lower is better")


def figure(path):
    """The chart of the CSV at `path`, as a matplotlib Figure."""
    rows = read_csv(path)
    columns = set(rows[0].keys())
    if "size_bytes" in columns and any(c.endswith(ALLREDUCE_SUFFIX) for c in columns):
        fig = plt.figure(figsize=(8, 5))
        draw_allreduce(fig, rows)
    elif PS_BENCH_COLUMNS <= columns:
        fig = plt.figure(figsize=(8, 5))
        draw_ps_bench(fig, rows)
    elif SCALING_COLUMNS <= columns:
        fig = plt.figure(figsize=(11, 4.5))
        draw_scaling(fig, rows)
    elif LAUNCH_BENCH_COLUMNS <= columns:
        fig = plt.figure(figsize=(8, 5))
        draw_launch_bench(fig, rows)
    else:
        series, (x_col, ylabel) = series_of(rows)
        if not series:
            raise ValueError(f"{path}: no numeric column to plot")
        fig = plt.figure(figsize=(8, 5))
        ax = fig.subplots()
        sizes = x_col.endswith("_bytes")
        # A size axis's ticks carry the unit (1 KiB, 64 MiB).
        xlabel = x_col[:-len("_bytes")].replace("_", " ") if sizes else _axis_label(x_col)
        draw_lines(ax, series, xlabel, ylabel, sizes=sizes)
        ax.set_title(os.path.splitext(os.path.basename(path))[0])
    fig.tight_layout()
    return fig


def plot(path, out_dir):
    """Writes <out_dir>/<csv name>.png; returns its path."""
    fig = figure(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        target = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".png")
        fig.savefig(target, dpi=120)
    finally:
        plt.close(fig)
    return target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="CSV files written by the benchmarks")
    ap.add_argument("--out", default=".", help="directory for the PNGs (default .)")
    args = ap.parse_args(argv)
    failed = 0
    for path in args.csv:
        try:
            print(plot(path, args.out))
        except (OSError, ValueError) as e:
            print(f"plot.py: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
