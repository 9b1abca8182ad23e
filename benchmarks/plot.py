#!/usr/bin/env python3
"""Turns the benchmarks' CSV output into PNG charts (matplotlib, Agg).

    python3 benchmarks/plot.py ps.csv scaling.csv --out charts/

One chart per CSV, <out>/<csv name>.png. Known layouts:

  ps_bench --csv: goodput (GB/s) against workers, a line for deepnex in
      each mode and one for each peer (torch rpc, torch rpc+malloc, raw TCP).
  scaling --csv: two panels against workers, samples/s and time to the
      target accuracy, a line per model and mode.
  launch_bench --csv: the median start-to-running and start-to-exit
      latency of each backend as bars, every round as a dot.
  anything else (allreduce_bench, ...): the first column is x (a log axis
      where it spans 100x or more); every other numeric column is a series.
      A non-numeric column other than the first (e.g. "mode") splits the
      rows into one series per value.
"""

import argparse
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PS_BENCH_COLUMNS = {"workers", "mode", "deepnex_gbps", "torch_rpc_gbps", "raw_tcp_gbps"}
SCALING_COLUMNS = {"workers", "model", "mode", "samples_per_s", "time_to_target_s"}
LAUNCH_BENCH_COLUMNS = {"backend", "round", "start_to_running_ms", "start_to_exit_ms"}


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


def series_of(rows):
    """{label: [(x, y)]} and (x label, y label) for a CSV's rows."""
    columns = list(rows[0].keys())
    if PS_BENCH_COLUMNS <= set(columns):
        out = {}
        for r in rows:
            x = _number(r["workers"])
            out.setdefault(f"deepnex {r['mode']}", []).append((x, _number(r["deepnex_gbps"])))
        for col, label in (("torch_rpc_gbps", "torch rpc"),
                           ("torch_rpc_malloc_gbps", "torch rpc + malloc"),
                           ("raw_tcp_gbps", "raw TCP")):
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
    out = {}
    for r in rows:
        group = " ".join(r[g] for g in groups if r[g])
        for c in numeric:
            y = _number(r[c])
            if y is None:
                continue
            label = f"{group} {c}".strip() if group else c
            out.setdefault(label, []).append((_number(r[x_col]) if _number(r[x_col]) is not None
                                               else r[x_col], y))
    units = {c.rsplit("_", 1)[-1] for c in numeric}
    ylabel = (numeric[0] if len(numeric) == 1
              else {"gbps": "GB/s", "ms": "ms"}.get(units.pop(), "value") if len(units) == 1
              else "value")
    return out, (x_col, ylabel)


def draw_lines(ax, series, xlabel, ylabel):
    categorical = any(isinstance(x, str) for pts in series.values() for x, _ in pts)
    xs_all = [x for pts in series.values() for x, y in pts if y is not None]
    for label, points in series.items():
        points = [(x, y) for x, y in points if y is not None]
        if not points:
            continue
        if not categorical:
            points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if (not categorical and xs_all and min(xs_all) > 0
            and max(xs_all) >= 100 * min(xs_all)):
        ax.set_xscale("log")
    elif not categorical and all(float(x).is_integer() for x in xs_all):
        ax.set_xticks(sorted(set(xs_all)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def scaling_series(rows, column):
    out = {}
    for r in rows:
        out.setdefault(f"{r['model']} {r['mode']}", []).append(
            (_number(r["workers"]), _number(r[column])))
    return out


def draw_scaling(fig, rows, title):
    left, right = fig.subplots(1, 2)
    draw_lines(left, scaling_series(rows, "samples_per_s"), "workers", "samples/s")
    draw_lines(right, scaling_series(rows, "time_to_target_s"), "workers",
               "time to target accuracy, s")
    fig.suptitle(title)


def draw_launch_bench(fig, rows, title):
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
    ax.set_xticklabels(backends)
    ax.set_ylabel("latency, ms (bar: median; dots: rounds)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)


def plot(path, out_dir):
    rows = read_csv(path)
    columns = set(rows[0].keys())
    title = os.path.splitext(os.path.basename(path))[0]
    if SCALING_COLUMNS <= columns:
        fig = plt.figure(figsize=(11, 4.5))
        draw_scaling(fig, rows, title)
    elif LAUNCH_BENCH_COLUMNS <= columns:
        fig = plt.figure(figsize=(7, 4.5))
        draw_launch_bench(fig, rows, title)
    else:
        series, (xlabel, ylabel) = series_of(rows)
        if not series:
            raise ValueError(f"{path}: no numeric column to plot")
        fig = plt.figure(figsize=(7, 4.5))
        ax = fig.subplots()
        draw_lines(ax, series, xlabel, ylabel)
        ax.set_title(title)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, title + ".png")
    fig.savefig(target, dpi=120)
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
