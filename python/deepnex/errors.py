"""deepnex's exceptions: one class per status code (gRPC's codes).

Every error deepnex raises is a :class:`DeepnexError` whose ``code`` is the
code's name (``"INVALID_ARGUMENT"``), and also an instance of the matching
builtin where one fits, so ordinary handlers keep working::

    try:
        deepnex.parse_byte_size("12XB", "memory")
    except ValueError as e:          # InvalidArgumentError is a ValueError
        print(e.code, e)
"""

# Annotations stay unevaluated, so that importing deepnex needs no typing.
from __future__ import annotations

__all__ = [
    "DeepnexError",
    "CancelledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
    "error_for_code",
]


class DeepnexError(Exception):
    """Base of deepnex's errors. ``code`` names the status code."""

    code: str = "UNKNOWN"
    #: The numeric code (absl / gRPC).
    code_value: int = 2


class CancelledError(DeepnexError):
    code, code_value = "CANCELLED", 1


class UnknownError(DeepnexError):
    code, code_value = "UNKNOWN", 2


class InvalidArgumentError(DeepnexError, ValueError):
    code, code_value = "INVALID_ARGUMENT", 3


class DeadlineExceededError(DeepnexError, TimeoutError):
    code, code_value = "DEADLINE_EXCEEDED", 4


class NotFoundError(DeepnexError, KeyError):
    code, code_value = "NOT_FOUND", 5

    def __str__(self) -> str:
        # KeyError's __str__ would show the message repr-quoted.
        return Exception.__str__(self)


class AlreadyExistsError(DeepnexError):
    code, code_value = "ALREADY_EXISTS", 6


class PermissionDeniedError(DeepnexError, PermissionError):
    code, code_value = "PERMISSION_DENIED", 7


class ResourceExhaustedError(DeepnexError):
    code, code_value = "RESOURCE_EXHAUSTED", 8


class FailedPreconditionError(DeepnexError):
    code, code_value = "FAILED_PRECONDITION", 9


class AbortedError(DeepnexError):
    code, code_value = "ABORTED", 10


class OutOfRangeError(DeepnexError, IndexError):
    code, code_value = "OUT_OF_RANGE", 11


class UnimplementedError(DeepnexError, NotImplementedError):
    code, code_value = "UNIMPLEMENTED", 12


class InternalError(DeepnexError):
    code, code_value = "INTERNAL", 13


class UnavailableError(DeepnexError, ConnectionError):
    code, code_value = "UNAVAILABLE", 14


class DataLossError(DeepnexError):
    code, code_value = "DATA_LOSS", 15


class UnauthenticatedError(DeepnexError, PermissionError):
    code, code_value = "UNAUTHENTICATED", 16


_BY_NAME: dict[str, type[DeepnexError]] = {
    cls.code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}
_BY_VALUE: dict[int, type[DeepnexError]] = {
    cls.code_value: cls for cls in _BY_NAME.values()
}


def error_for_code(code: str | int) -> type[DeepnexError]:
    """The class for a code name ("NOT_FOUND") or number (5).

    An unknown code, or OK, gives UnknownError. The C++ bindings use this to
    raise a failed absl::Status.
    """
    if isinstance(code, int):
        return _BY_VALUE.get(code, UnknownError)
    return _BY_NAME.get(str(code).upper(), UnknownError)
