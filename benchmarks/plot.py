#!/usr/bin/env python3
"""Turns the benchmarks' CSV output into PNG charts (matplotlib, Agg).

    python3 benchmarks/plot.py ps.csv scaling.csv --out charts/

One chart per CSV, <out>/<csv name>.png. Known layouts:

  ps_bench --csv: goodput (GB/s) against workers, a line for deepnex in
      each mode and one for each peer (torch rpc, torch rpc+malloc, raw TCP).
  anything else (launch_bench, scaling, ...): the first column is x; every
      other numeric column is a series. A non-numeric column other than the
      first (e.g. "mode") splits the rows into one series per value.
"""

import argparse
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PS_BENCH_COLUMNS = {"workers", "mode", "deepnex_gbps", "torch_rpc_gbps", "raw_tcp_gbps"}


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
    return out, (x_col, numeric[0] if len(numeric) == 1 else "value")


def plot(path, out_dir):
    rows = read_csv(path)
    series, (xlabel, ylabel) = series_of(rows)
    if not series:
        raise ValueError(f"{path}: no numeric column to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    categorical = any(isinstance(x, str) for pts in series.values() for x, _ in pts)
    for label, points in series.items():
        points = [(x, y) for x, y in points if y is not None]
        if not categorical:
            points.sort()
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(os.path.splitext(os.path.basename(path))[0])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".png")
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
