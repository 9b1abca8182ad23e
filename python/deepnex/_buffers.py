"""Turning numpy arrays and CPU torch tensors into buffers for deepnex._C.

The bindings take anything with the buffer protocol and never copy. torch
tensors do not export the buffer protocol, so the Python layer passes
``t.numpy()``, which shares the tensor's memory. torch is not imported here:
a tensor is recognised by its type's module.
"""

from typing import Any, Optional, Tuple

from deepnex import _C
from deepnex.errors import InvalidArgumentError


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


def to_buffer(x: Any, what: str) -> Tuple[Any, Optional["_C.DType"]]:
    """(object with the buffer protocol, dtype override) for ``x``.

    A torch bfloat16 tensor becomes an int16 view of the same memory with
    the override DType.bfloat16; other tensors their ``.numpy()`` view
    (detached, so tensors that require grad work too). Anything else is
    returned as is. Raises InvalidArgumentError naming ``what`` for a tensor
    that is not on the CPU. Contiguity is checked by the bindings.
    """
    if not _is_torch_tensor(x):
        return x, None
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
