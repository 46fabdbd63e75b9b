"""Communication hooks: what a bucket sends, and what it makes of what comes back.

In the spirit of DDP's ``register_comm_hook``, a :class:`CommHook` sits
between a bucket's gradients and the collectives of the plan.  Before a
collective starts, :meth:`CommHook.encode` writes the gradient elements of the
piece into a wire buffer of :meth:`CommHook.wire_dtype`; when the collective
completes, :meth:`CommHook.decode` writes the received elements back.  The
engine averages after decoding, in the bucket's own dtype.

The bookkeeping that rides in every bucket (the "used" flags and the step
tags) never passes through the hook: the engine copies it into the wire buffer
itself.  Those are small integers, exact in float16 and bfloat16 (the engine
shortens the step tag to what the wire dtype holds exactly).

Every rank must use the same hook (it is part of the plan's fingerprint).
"""

from __future__ import annotations

from typing import Any

import torch

from .sparsify import Sparsify

__all__ = ["CommHook", "CastHook", "ReduceInFloat32", "fp16_compress", "bf16_compress", "resolve_comm_hook",
           "LOW_PRECISION"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class CommHook:
    """Base class: override :attr:`name`, :meth:`wire_dtype`, :meth:`encode` and :meth:`decode`."""

    name = "none"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``dtype`` travels in."""
        return dtype

    def encode(self, grads: torch.Tensor, out: torch.Tensor) -> Any:
        """Write ``grads`` (flat, bucket dtype) into ``out`` (flat, wire dtype, same length); return a context."""
        out.copy_(grads)
        return None

    def decode(self, wire: torch.Tensor, out: torch.Tensor, ctx: Any) -> None:
        """Write the received ``wire`` elements into ``out`` (bucket dtype); ``ctx`` is what encode returned."""
        out.copy_(wire)

    def passes_through(self, dtype: torch.dtype) -> bool:
        """Whether a bucket of ``dtype`` travels untouched (no wire buffer): the default encode and decode into
        the same dtype."""
        cls = type(self)
        return (cls.encode is CommHook.encode and cls.decode is CommHook.decode
                and self.wire_dtype(dtype) == dtype)

    def __repr__(self) -> str:
        return f"<comm hook {self.name}>"


class CastHook(CommHook):
    """Send floating-point gradients as ``dtype`` (rounded to nearest); other dtypes travel unchanged.

    Sums are taken in ``dtype`` on the wire: with float16, keep the summed
    gradients below 65504 (scale the loss down, or use bfloat16, whose range is
    float32's at 8 bits of precision).
    """

    def __init__(self, dtype: torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"CastHook casts to a floating-point dtype, got {dtype}")
        self.dtype = dtype
        self.name = f"cast-{str(dtype).replace('torch.', '')}"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if dtype.is_floating_point else dtype


class ReduceInFloat32(CommHook):
    """bfloat16 and float16 gradients are summed over ranks in float32 (as Megatron-core's
    ``grad_reduce_in_fp32``): each piece is widened into a float32 wire buffer, reduced, and rounded back once.
    Twice the bytes of such a bucket on the wire and a float32 copy of it in memory; other dtypes travel as they
    are, at no cost.  ``DistOptim``'s default (``comm_hook="auto"``); ``comm_hook=None`` reduces in the
    parameters' own dtype (less memory and traffic, a sum rounded at every step of the ring)."""

    name = "reduce-fp32"

    def __init__(self, auto: bool = False):
        self.auto = auto  # chosen by default, not by the user

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype in LOW_PRECISION else dtype


def fp16_compress() -> CastHook:
    """Gradients travel as float16 (half the bytes; ~3 decimal digits; range +-65504)."""
    return CastHook(torch.float16)


def bf16_compress() -> CastHook:
    """Gradients travel as bfloat16 (half the bytes; ~2 decimal digits; float32's range)."""
    return CastHook(torch.bfloat16)


_BY_NAME = {"fp16": fp16_compress, "bf16": bf16_compress, "fp32": ReduceInFloat32,
            "auto": lambda: ReduceInFloat32(auto=True)}


def resolve_comm_hook(hook) -> "CommHook | None":
    """``"auto"`` -> bfloat16/float16 gradients reduced in float32, others as they are; ``None``/``"none"`` ->
    None (gradients travel as they are); ``"fp16"``/``"bf16"`` -> a cast; ``"fp32"``: as ``"auto"``; or a
    CommHook."""
    if hook is None or hook == "none":
        return None
    if isinstance(hook, str):
        if hook not in _BY_NAME:
            raise ValueError(f"comm_hook must be 'auto', None, 'fp16', 'bf16', 'fp32' or a dearopt.CommHook, got "
                             f"{hook!r}")
        return _BY_NAME[hook]()
    if not isinstance(hook, (CommHook, Sparsify)):
        raise TypeError(f"comm_hook must be 'auto', None, 'fp16', 'bf16', 'fp32', a dearopt.CommHook or a "
                        f"dearopt.Sparsify, got {type(hook).__name__}")
    return hook
