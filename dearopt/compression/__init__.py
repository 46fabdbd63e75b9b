"""Communication hooks: what travels for a bucket (casts, float32 sums, ``Sparsify``, embedding rows)."""

from __future__ import annotations

from dearopt.compression.hooks import CommHook, ReduceInFloat32, bf16_compress, fp16_compress
from dearopt.compression.sparsify import Sparsify

__all__ = ["CommHook", "Sparsify", "bf16_compress", "fp16_compress", "resolve_comm_hook"]

_BY_NAME = {
    "fp16": fp16_compress,
    "bf16": bf16_compress,
    "fp32": ReduceInFloat32,
    "auto": lambda: ReduceInFloat32(auto=True),
}


def resolve_comm_hook(hook) -> "CommHook | None":
    """``"auto"`` -> bfloat16/float16 gradients reduced in float32, others as they are; ``None``/``"none"`` ->
    None (gradients travel as they are); ``"fp16"``/``"bf16"`` -> a cast; ``"fp32"``: as ``"auto"``; or a
    CommHook."""
    if hook is None or hook == "none":
        return None
    if isinstance(hook, str):
        if hook not in _BY_NAME:
            raise ValueError(
                f"comm_hook must be 'auto', None, 'fp16', 'bf16', 'fp32' or a dearopt.CommHook, got {hook!r}"
            )
        return _BY_NAME[hook]()
    if not isinstance(hook, (CommHook, Sparsify)):
        raise TypeError(
            f"comm_hook must be 'auto', None, 'fp16', 'bf16', 'fp32', a dearopt.CommHook or a "
            f"dearopt.Sparsify, got {type(hook).__name__}"
        )
    return hook
