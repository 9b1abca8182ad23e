"""Python values to what deepnex._C takes: arrays and CPU torch tensors to
buffers, byte sizes to ints, keywords to C++ option structs. Every module of
the package converts through here, so that a tensor or a size means the same
thing everywhere.

The bindings take anything with the buffer protocol and never copy. torch
tensors do not export the buffer protocol, so the Python layer passes
``t.numpy()``, which shares the tensor's memory. torch is not imported here:
a tensor is recognised by its type's module.
"""

import numbers
from typing import Any, Optional, Tuple

from deepnex import _C
from deepnex.errors import InvalidArgumentError


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


def to_buffer(x: Any, what: str) -> Tuple[Any, Optional["_C.DType"]]:
    """(object with the buffer protocol, dtype override) for ``x``, a numpy
    array or a CPU torch tensor; never a copy.

    A torch bfloat16 tensor becomes an int16 view of the same memory with
    the override DType.bfloat16; other tensors their ``.numpy()`` view
    (detached, so tensors that require grad work too); a numpy array is
    returned as is. Raises InvalidArgumentError naming ``what`` for a tensor
    that is not on the CPU, TypeError for anything else. Contiguity is
    checked by the bindings.
    """
    import numpy as np  # here, so that the modules without arrays start without it

    if isinstance(x, np.ndarray):
        return x, None
    if not is_torch_tensor(x):
        raise TypeError(f"{what}: expected a numpy array or a torch tensor, "
                        f"got {type(x).__name__}")
    if x.device.type != "cpu":
        raise InvalidArgumentError(
            f"{what}: the tensor is on {x.device}; deepnex takes CPU tensors "
            "(move it with .cpu(), which copies)"
        )
    t = x.detach()
    import torch  # only reached with a tensor in hand

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), _C.DType.bfloat16
    return t.numpy(), None


def is_bool(value: Any) -> bool:
    """A bool, numpy's and torch's included: float(), int() and pybind11 take
    one as 0 or 1, where deepnex wants a number (a probe's SGD(lr=True)
    trained at lr 1)."""
    if isinstance(value, bool):
        return True
    dtype = str(getattr(value, "dtype", ""))
    if dtype == "object" and getattr(value, "size", 0) == 1:
        # np.array(True, dtype=object): float() takes its item.
        return is_bool(value.item())
    return dtype in ("bool", "torch.bool")


def is_real(value: Any) -> bool:
    """A real number that is no bool: an int or a float, numpy's and torch's
    integers and floats, a Decimal or anything else float() converts, but
    not what float() also takes: a complex number (dropping its imaginary
    part), bytes, a string, numpy's durations and dates."""
    if is_bool(value):
        return False
    dtype = getattr(value, "dtype", None)
    if hasattr(dtype, "kind"):  # numpy's
        if dtype.kind == "O" and getattr(value, "size", 0) == 1:
            return is_real(value.item())
        return dtype.kind in "iuf"
    if hasattr(dtype, "is_complex"):  # torch's
        return not dtype.is_complex
    if isinstance(value, numbers.Real):
        return True
    return (hasattr(value, "__float__") and
            not isinstance(value, (numbers.Complex, str, bytes, bytearray)))


def number(value: Any, name: str) -> float:
    """float(value); InvalidArgumentError naming ``name`` for a bool or
    anything else that is not a real number (is_real)."""
    if is_bool(value):
        raise InvalidArgumentError(f"{name}={value!r}: a bool, where a number is expected")
    if not is_real(value):
        raise InvalidArgumentError(f"{name}={value!r}: not a number")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(f"{name}={value!r}: not a number a float holds") from None


def byte_size(value: Any, name: str) -> int:
    """An int of bytes from an int (numpy's too) or a string such as
    "80GiB"; InvalidArgumentError naming ``name`` and the value otherwise."""
    # numbers.Integral: numpy's integers too, without importing numpy.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"{name}={value}: must be >= 0")
        if value >= 2**64:  # as the strings' parser: bytes are 64-bit
            raise InvalidArgumentError(f"{name}={value}: more bytes than 64 bits count")
        return int(value)
    if isinstance(value, str):
        return _C.parse_byte_size(value, name)
    raise InvalidArgumentError(
        f"{name}: expected a byte size such as \"80GiB\" or an int, got {value!r}")


def options(struct: Any, **fields: Any) -> Any:
    """A bound C++ options struct (``_C.<part>.<Name>Options``) with
    ``fields`` set; the others keep their C++ defaults. A field the struct
    lacks is an AttributeError, a bad value the struct's own error, or
    InvalidArgumentError naming the field where the binding refuses the
    value's type or range (pybind11 says only "incompatible function
    arguments") and for a bool where the field is not one."""
    o = struct()
    for name, value in fields.items():
        # pybind11 takes True as 1: a probe's worker_id=True was worker 1.
        if is_bool(value) and not isinstance(getattr(o, name), bool):
            raise InvalidArgumentError(f"{name}={value!r}: a bool, where a number is expected")
        try:
            setattr(o, name, value)
        except TypeError:
            bad = not_utf8(value)
            if bad is not None:
                raise InvalidArgumentError(f"{name}: {bad!r} is not UTF-8 text") from None
            raise InvalidArgumentError(
                f"{name}={value!r}: not a value of this option's type, or out of its range"
            ) from None
    return o


def text(value: Any, what: str) -> Any:
    """`value`, refused naming `what` where it is a str the C++ layer cannot
    take: one with a lone surrogate (as os.fsdecode, and so argv, makes of
    bytes that are not UTF-8) failed inside pybind11 with "incompatible
    function arguments" and a traceback. Anything else goes on to the C++
    layer, which checks it."""
    if isinstance(value, str) and not_utf8(value) is not None:
        raise InvalidArgumentError(f"{what}: {value!r} is not UTF-8 text")
    return value


def not_utf8(value: Any) -> Any:
    """The first str in `value` (a str, or a list, tuple or dict of them)
    that UTF-8 cannot encode (an argument with bytes the locale does not
    decode comes as lone surrogates), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value
        return None
    if isinstance(value, dict):
        value = [part for item in value.items() for part in item]
    if isinstance(value, (list, tuple)):
        for part in value:
            bad = not_utf8(part)
            if bad is not None:
                return bad
    return None
