"""deepnex: data-parallel training on shared GPU machines.

    import deepnex
    ctx = deepnex.init()          # the job environment a launcher gave us
    deepnex.parse_byte_size("8GiB")

Errors are deepnex.DeepnexError subclasses (see deepnex.errors).
"""

import sys

from deepnex.errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    DeepnexError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
)

# Everything else resolves on first use (PEP 562), so that `import deepnex`
# (and every `deepnex` command) starts without the compiled module, numpy or
# the submodules a program does not touch. They import through __import__
# (not importlib.import_module), which `python -X importtime` reports.
_FROM_C = ("__version__", "Context", "DType", "parse_byte_size", "format_byte_size")
_SUBMODULES = ("_C", "collective", "ps", "gpu", "data", "launch", "job", "tune")


def _compiled():
    """deepnex._C, or an ImportError that says how to build it."""
    try:
        import deepnex._C
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(
            "deepnex's compiled module deepnex._C could not be loaded "
            f"({e}). Build it with CMake and put <build>/python on PYTHONPATH, "
            "or install the package with pip."
        ) from e
    return sys.modules["deepnex._C"]


def __getattr__(name):
    if name in _FROM_C:
        value = getattr(_compiled(), name)
    elif name == "_C":
        value = _compiled()
    elif name in _SUBMODULES:
        _compiled()  # its error says how to build it
        try:
            __import__(f"deepnex.{name}")
        except ModuleNotFoundError as e:
            # The parameter server's Python layer is optional while it is being written.
            if e.name != f"deepnex.{name}":
                raise
            raise AttributeError(f"module 'deepnex' has no attribute {name!r}") from e
        value = sys.modules[f"deepnex.{name}"]
    elif name == "report":  # a training script's progress: to its search, or its job's record
        from deepnex.tune import report as value
    else:
        raise AttributeError(f"module 'deepnex' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_FROM_C) | set(_SUBMODULES) | {"report"})


def init(environ=None) -> "Context":
    """Returns this process's job Context, read from the environment.

    ``environ`` is a mapping to read instead of os.environ. Raises
    InvalidArgumentError (a ValueError) naming a missing or malformed
    variable, e.g. ``DEEPNEX_RANK="x" is not an integer``.

    In shared GPU mode (``DEEPNEX_GPU_MEMORY_LIMIT`` set) the limit is handed
    to the frameworks this process has imported already (neither is imported
    here, so import yours first): PyTorch gets
    ``torch.cuda.set_per_process_memory_fraction(limit / total memory)`` on
    every visible GPU, TensorFlow memory growth and a logical device of
    ``limit`` on every visible GPU. One log line (logger "deepnex") says what
    was applied. The frameworks enforce it in their allocators only: hard
    enforcement needs a CUDA driver hook.
    """
    ctx = _compiled().Context.from_env(environ)
    if ctx.gpu_memory_limit is not None:
        _apply_gpu_memory_limit(ctx.gpu_memory_limit)
    return ctx


def _apply_gpu_memory_limit(limit):
    import logging
    import sys

    done, problems = [], []
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_available():
            fractions = []
            for i in range(torch.cuda.device_count()):
                total = torch.cuda.get_device_properties(i).total_memory
                fraction = min(1.0, limit / total)
                torch.cuda.set_per_process_memory_fraction(fraction, i)
                fractions.append(f"{fraction:.4g}")
            done.append(f"PyTorch (memory fraction {', '.join(fractions)} on "
                        f"{len(fractions)} GPU(s))")
        else:
            problems.append("PyTorch sees no CUDA device")
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        gpus = tf.config.list_physical_devices("GPU")
        megabytes = max(1, limit >> 20)  # TensorFlow's memory_limit is in MiB
        try:
            # Growth first: TensorFlow refuses it once a logical device is set.
            for g in gpus:
                tf.config.experimental.set_memory_growth(g, True)
            for g in gpus:
                tf.config.set_logical_device_configuration(
                    g, [tf.config.LogicalDeviceConfiguration(memory_limit=megabytes)])
            done.append(f"TensorFlow (memory growth and a {megabytes}MiB logical device on "
                        f"{len(gpus)} GPU(s))")
        except RuntimeError as e:  # its GPUs were initialized before init()
            problems.append(f"TensorFlow refused it ({e})")
    what = f"DEEPNEX_GPU_MEMORY_LIMIT={_compiled().format_byte_size(limit)} per GPU"
    if not done and not problems:
        problems.append("neither torch nor tensorflow is imported yet")
    line = f"deepnex: {what} applied to {' and '.join(done)}" if done else f"deepnex: {what}"
    if problems:
        line += f"{'; ' if done else ' not applied: '}{'; '.join(problems)}"
    logging.getLogger("deepnex").info(
        "%s (the frameworks' allocators enforce it; hard enforcement needs a CUDA driver hook)",
        line)


__all__ = [
    "__version__",
    "Context",
    "DType",
    "init",
    "report",
    "parse_byte_size",
    "format_byte_size",
    "DeepnexError",
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
]
