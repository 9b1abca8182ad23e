"""Allreduce inputs whose results are exact in every dtype, and those
results: what a rank (a thread, or a process on any host) checks.
Imports only numpy, so rank scripts can import it too."""

import numpy as np

DTYPES = (np.float32, np.float64, np.float16, np.int32, np.int64)
OPS = ("sum", "mean", "max", "min", "prod")


def allreduce_case(op, dtype, size, n):
    """(each of the n ranks' input, the exact result of allreducing them with
    op). Small integers, so sums and products are exact; mean is the sum
    divided as the communicator does (truncated for integers, in float32
    for float16)."""
    i = np.arange(size)
    vals = [((i + k) % 3 + 1) if op == "prod" else (i * 7 + 3 * k) % 11 + k for k in range(n)]
    stack = np.stack(vals).astype(np.float64)
    want = {"sum": stack.sum(0), "prod": stack.prod(0), "max": stack.max(0),
            "min": stack.min(0), "mean": stack.sum(0)}[op]
    if op == "mean":
        if np.issubdtype(dtype, np.integer):
            want = np.trunc(want / n)
        elif dtype == np.float64:
            want = want / n
        else:
            want = (want.astype(np.float32) / np.float32(n)).astype(dtype)
    return [v.astype(dtype) for v in vals], want.astype(dtype)
