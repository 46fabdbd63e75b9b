"""Gradient compression as ``horovod.torch.Compression`` defines it.

A compressor is a class with two static methods: ``compress(tensor)`` returns
``(compressed, ctx)`` and ``decompress(compressed, ctx)`` undoes it.  Both are
usable before :func:`dearopt.integrations.horovod.init` and are differentiable (they are
plain dtype conversions).
"""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Interface: compress a tensor before communication, decompress after."""

    @staticmethod
    def compress(tensor):
        """Return ``(compressed_tensor, ctx)``; ``ctx`` is handed to :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor in its original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor):
        """Return ``(tensor, None)``: the tensor unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Return ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype.

    Non-floating tensors (integers, bool) are left alone.  The round trip
    costs float16's precision: a relative error up to 2**-11 per element
    (plus the rounding of the reduction itself in float16), and values beyond
    65504 overflow to inf, which is what ``gradient_predivide_factor`` helps
    to avoid.
    """

    @staticmethod
    def compress(tensor):
        """Return ``(tensor as float16, its dtype)``; a float16 or non-floating tensor is returned as it is."""
        ctx = tensor.dtype
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.type(torch.float16), ctx
        return tensor, ctx

    @staticmethod
    def decompress(tensor, ctx):
        """Return ``tensor`` cast back to the floating dtype ``ctx`` it had before :meth:`compress`."""
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
