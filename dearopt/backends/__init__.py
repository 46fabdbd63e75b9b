"""Collective backends: one asynchronous interface (start, handle, wait on the stream, synchronize on the host)
over torch.distributed and the csrc NCCL extension; the runtime (``init``) and launcher detection."""

from dearopt.backends.base import CollectiveBackend, Handle, padded_numel
from dearopt.backends.runtime import get_backend, get_timeout

__all__ = ["CollectiveBackend", "Handle", "padded_numel", "get_backend", "get_timeout"]
