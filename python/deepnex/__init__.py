"""deepnex: data-parallel training on shared GPU machines.

    import deepnex
    ctx = deepnex.init()          # the job environment a launcher gave us
    deepnex.parse_byte_size("8GiB")

Errors are deepnex.DeepnexError subclasses (see deepnex.errors).
"""

try:
    from deepnex import _C
except ImportError as _e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "deepnex's compiled module deepnex._C could not be loaded "
        f"({_e}). Build it with CMake and put <build>/python on PYTHONPATH, "
        "or install the package with pip."
    ) from _e

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

__version__: str = _C.__version__

Context = _C.Context
DType = _C.DType
parse_byte_size = _C.parse_byte_size
format_byte_size = _C.format_byte_size


def init(environ=None) -> "Context":
    """Returns this process's job Context, read from the environment.

    ``environ`` is a mapping to read instead of os.environ. Raises
    InvalidArgumentError (a ValueError) naming a missing or malformed
    variable, e.g. ``DEEPNEX_RANK="x" is not an integer``.
    """
    return _C.Context.from_env(environ)


from deepnex import collective  # noqa: E402

# The parameter server's Python layer is optional while it is being written.
try:
    from deepnex import ps
except ModuleNotFoundError as _e:
    if _e.name != "deepnex.ps":
        raise

from deepnex import gpu  # noqa: E402  (GPU allocation)
from deepnex import data  # noqa: E402  (data sharding)
from deepnex import launch  # noqa: E402  (container launch)
from deepnex import job  # noqa: E402  (deepnex run)
from deepnex import tune  # noqa: E402  (hyperparameter search; no torch)

__all__ = [
    "__version__",
    "Context",
    "DType",
    "init",
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
