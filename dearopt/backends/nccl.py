"""The ``nccl-native`` backend: collectives over the csrc NCCL extension.

``dearopt.init(backend="nccl-native")`` keeps a gloo process group for control
traffic and runs every collective on an NCCL communicator owned by
``dearopt.backends._nccl`` (csrc/nccl_comm.cpp), whose unique id rank 0 creates and
broadcasts over that gloo group.

Streams and waiting
-------------------
Each op is issued on the communicator's own CUDA stream after that stream
waited (``cudaStreamWaitEvent``) for the work queued so far on the caller's
current torch stream, so a gradient is never sent before it is computed.

``Handle.wait(timeout)`` by default does **not** block the host: it makes the
caller's current torch CUDA stream wait on the op's completion event, so any
later work on that stream (``div_``, the optimizer, ``.item()``) sees the
result.  The timeout is still enforced: a watchdog thread in the extension
aborts the communicator (``ncclCommAbort``) when an op is not finished
``timeout`` seconds after ``wait`` (or the backend's timeout after the op
started), and the next call on the backend raises
:class:`~dearopt.errors.CollectiveTimeoutError`.  Pass ``blocking=True`` (or set
``DEAROPT_NCCL_BLOCKING_WAIT=1``) to block the host until the op is done and
raise the timeout error from ``wait`` itself.

Tensors given to an op are kept alive by its handle and recorded on the
communication stream (``Tensor.record_stream``), so the caching allocator does
not reuse their memory while NCCL still reads or writes it.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from dearopt.backends.base import REDUCE_OPS, CollectiveBackend, CompletedHandle, Handle, translate_error
from dearopt.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError

try:
    from dearopt.backends import _nccl
except ImportError as _exc:  # pragma: no cover - depends on how dearopt was installed
    raise ImportError(
        "dearopt.backends.nccl needs the compiled extension dearopt.backends._nccl, which is not importable "
        f"({_exc}). Build it with the CUDA toolkit (nvcc) and NCCL (pip install nvidia-nccl-cu13 pybind11) "
        "present: DEAROPT_WITH_NCCL=1 pip install --no-build-isolation -e ."
    ) from _exc

__all__ = ["NcclNativeBackend", "NcclHandle", "nccl_version", "torch_dtype_code"]

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}
for _name in ("uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name


def torch_dtype_code(dtype: torch.dtype) -> int:
    """The extension's (NCCL's) code for a torch dtype; TypeError when NCCL has none."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise TypeError(
            f"nccl-native: dtype {dtype} is not supported; use one of {sorted(str(d) for d in _DTYPE_NAMES)}"
        )
    return _nccl.DTYPES[name]


def nccl_version() -> tuple:
    """The NCCL library's version as ``(major, minor, patch)``."""
    code = _nccl.nccl_version()
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def _blocking_default() -> bool:
    return os.environ.get("DEAROPT_NCCL_BLOCKING_WAIT", "").strip().lower() in ("1", "true", "yes", "on")


class NcclHandle(Handle):
    """An op in flight on the native communicator; holds its tensors until it is done."""

    def __init__(
        self, backend: "NcclNativeBackend", handle: int, op: str, where: dict, tensors: Sequence[torch.Tensor]
    ):
        self._backend = backend
        self._id = handle
        self.op = op
        self._where = where
        self._tensors = tuple(tensors)
        self._done = False
        self._error: Optional[CollectiveError] = None

    @property
    def id(self) -> int:
        return self._id

    def _complete(self) -> None:
        self._done = True
        self._tensors = ()

    def is_completed(self) -> bool:
        if self._done or self._error is not None:
            return True
        try:
            done = self._backend._require_comm(self.op, self._where).poll(self._id)
        except Exception as exc:  # reported by wait()
            self._error = self._backend._translate(exc, self.op, self._where)
            return True
        if done:
            self._complete()
        return bool(done)

    def wait(self, timeout: Optional[float] = None, blocking: Optional[bool] = None) -> None:
        """Make the result usable on the current CUDA stream (see the module docstring).

        Args:
            timeout: seconds; default the backend's timeout.
            blocking: block the host until the op is done (default
                ``DEAROPT_NCCL_BLOCKING_WAIT``, else False: stream wait only).
        """
        if self._error is not None:
            raise self._error
        if self._done:
            return
        backend = self._backend
        seconds = backend.timeout if timeout is None else float(timeout)
        if not seconds > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        blocking = backend.blocking_wait if blocking is None else bool(blocking)
        try:
            comm = backend._require_comm(self.op, self._where)
            if blocking:
                comm.synchronize(self._id, seconds)
                self._complete()
            else:
                comm.wait(self._id, torch.cuda.current_stream(backend.device).cuda_stream, seconds)
        except CollectiveError:
            raise
        except Exception as exc:
            self._error = backend._translate(exc, self.op, self._where)
            raise self._error from exc

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the host until the op has finished on the GPU."""
        self.wait(timeout, blocking=True)

    def __repr__(self) -> str:
        state = "done" if self._done else ("failed" if self._error else "in flight")
        return f"NcclHandle({self.op}, id={self._id}, {state})"


def _close_quietly(ref) -> None:
    backend = ref()
    if backend is not None:
        try:
            backend.close(timeout=min(backend.timeout, 10.0))  # do not hold up interpreter exit
        except Exception:
            pass


class NcclNativeBackend(CollectiveBackend):
    """Collectives on a communicator of the ``dearopt.backends._nccl`` extension (one CUDA device per rank)."""

    name = "nccl-native"

    def __init__(
        self,
        comm,
        rank: int,
        size: int,
        timeout: float,
        device: torch.device,
        group=None,
        blocking_wait: Optional[bool] = None,
    ):
        super().__init__(rank, size, timeout)
        self._comm = comm
        self._group = group
        self.device = device
        self.blocking_wait = _blocking_default() if blocking_wait is None else bool(blocking_wait)
        self._comm_stream_obj = None
        atexit.register(_close_quietly, weakref.ref(self))

    # ------------------------------------------------------------ creation
    @classmethod
    def create(
        cls,
        rank: int,
        size: int,
        timeout: float,
        group=None,
        device: Optional[torch.device] = None,
        blocking_wait: Optional[bool] = None,
    ) -> "NcclNativeBackend":
        """Make a communicator of ``size`` ranks; collective over ``torch.distributed`` when ``size > 1``.

        Rank 0 creates the NCCL unique id and broadcasts it over ``group``
        (default: the default process group, gloo under
        ``dearopt.init(backend="nccl-native")``).  The device is ``device`` or
        ``cuda:<local rank % device count>``, which becomes torch's current device.
        """
        if not torch.cuda.is_available():
            raise BackendUnavailableError("backend 'nccl-native' needs a CUDA GPU, and torch sees none; use 'gloo'")
        try:
            count = _nccl.cuda_device_count()
        except _nccl.CudaError as exc:
            raise BackendUnavailableError(f"backend 'nccl-native': the extension cannot use CUDA: {exc}") from exc
        if count < 1:
            raise BackendUnavailableError("backend 'nccl-native': the extension sees no CUDA device")
        device = cls._pick_device(rank, device)
        torch.cuda.set_device(device)
        return cls._build(rank, size, timeout, group, device, blocking_wait)

    @staticmethod
    def _pick_device(rank: int, device) -> torch.device:
        if device is not None:
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"nccl-native needs a CUDA device, got {device}")
            return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        try:
            from dearopt.backends.launch import detect_launch

            local = detect_launch(os.environ).local_rank
        except Exception:  # an incomplete launcher environment: fall back to the global rank
            local = rank
        return torch.device("cuda", local % torch.cuda.device_count())

    @classmethod
    def _build(cls, rank, size, timeout, group, device, blocking_wait) -> "NcclNativeBackend":
        unique_id = cls._share_unique_id(rank, size, group, device)
        try:
            comm = _nccl.Communicator(unique_id, rank, size, device.index, float(timeout))
        except _nccl.CudaError as exc:
            raise BackendUnavailableError(f"backend 'nccl-native' cannot use {device}: {exc}") from exc
        except _nccl.NcclTimeoutError as exc:
            raise CollectiveTimeoutError(
                f"creating the NCCL communicator timed out: {exc}", rank=rank, op="init"
            ) from exc
        except _nccl.NcclError as exc:
            raise translate_error(exc, rank=rank, op="init") from exc
        return cls(comm, rank, size, timeout, device, group=group, blocking_wait=blocking_wait)

    @staticmethod
    def _share_unique_id(rank: int, size: int, group, device: torch.device) -> bytes:
        if size == 1:
            return _nccl.get_unique_id()
        if not (dist.is_available() and dist.is_initialized()):
            raise BackendUnavailableError(
                "backend 'nccl-native' with more than one rank needs torch.distributed initialized "
                "(dearopt.init does it) to share the NCCL unique id"
            )
        n = _nccl.UNIQUE_ID_BYTES
        payload = torch.zeros(1 + n, dtype=torch.uint8)
        failure = None
        if rank == 0:
            try:
                payload[1:] = torch.frombuffer(bytearray(_nccl.get_unique_id()), dtype=torch.uint8)
                payload[0] = 1
            except _nccl.NcclError as exc:  # still broadcast, so the other ranks do not hang
                failure = exc
        on_gpu = dist.get_backend(group) == "nccl"
        wire = payload.to(device) if on_gpu else payload
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(wire, src=src, group=group)
        payload = wire.cpu() if on_gpu else wire
        if int(payload[0]) != 1:
            raise CollectiveError(
                f"rank 0 could not create an NCCL unique id: {failure or 'see rank 0'}", rank=rank, op="init"
            )
        return payload[1:].numpy().tobytes()

    def fork(self) -> "NcclNativeBackend":
        """A second communicator over the same ranks and device (collective: every rank must call it)."""
        self._check_open("fork", {})
        return self._track_fork(
            self._build(self.rank, self.size, self.timeout, self._group, self.device, self.blocking_wait)
        )

    # --------------------------------------------------------------- state
    @property
    def comm(self):
        """The extension's ``Communicator``."""
        return self._comm

    @property
    def comm_stream(self) -> torch.cuda.Stream:
        """The communication stream as a torch stream (for events and ``record_stream``)."""
        if self._comm_stream_obj is None:
            self._comm_stream_obj = torch.cuda.ExternalStream(self._comm.stream, device=self.device)
        return self._comm_stream_obj

    def _require_comm(self, op: str, where: dict):
        self._check_open(op, where)
        return self._comm

    def _translate(self, exc: BaseException, op: str, where: dict) -> BaseException:
        if isinstance(exc, CollectiveError):
            return exc
        if isinstance(exc, _nccl.NcclTimeoutError):
            return CollectiveTimeoutError(f"{op} did not complete in time: {exc}", rank=self.rank, op=op, **where)
        if isinstance(exc, (ValueError, TypeError)):
            return exc
        return translate_error(exc, rank=self.rank, op=op, **where)

    def close(self, timeout: Optional[float] = None) -> None:
        """Flush in-flight ops (up to ``timeout``, default the backend's) and destroy the communicator.

        Past the timeout the communicator is aborted instead.  Idempotent.
        """
        if self._closed:
            return
        super().close()
        try:
            self._comm.close(self.timeout if timeout is None else float(timeout))
        except Exception:
            pass

    def abort(self) -> None:
        """Abort the communicator now (in-flight ops are cancelled); the backend is unusable afterwards."""
        self._closed = True
        self._comm.abort()

    # ----------------------------------------------------------------- ops
    def _check_tensor(self, op: str, tensor: torch.Tensor) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != self.device:
            raise ValueError(
                f"{op}: the tensor is on {tensor.device}, but this nccl-native backend uses "
                f"{self.device} (backend.device)"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: tensors must be contiguous")
        return torch_dtype_code(tensor.dtype)

    def _issue(self, op: str, where: dict, tensors: Sequence[torch.Tensor], start: Callable[[int], int]) -> Handle:
        self._require_comm(op, where)
        producer = torch.cuda.current_stream(self.device).cuda_stream
        try:
            handle = start(producer)
        except (ValueError, TypeError):
            raise
        except Exception as exc:
            raise self._translate(exc, op, where) from exc
        stream = self.comm_stream
        for tensor in tensors:
            tensor.record_stream(stream)
        return NcclHandle(self, handle, op, where, tensors)

    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor, **where) -> Handle:
        op = "reduce_scatter"
        self.check_shapes(op, in_full, out_shard)
        code = self._check_tensor(op, in_full)
        self._check_tensor(op, out_shard)
        if out_shard.numel() == 0:
            return CompletedHandle(op)
        send, recv, n = in_full.data_ptr(), out_shard.data_ptr(), out_shard.numel()
        return self._issue(op, where, (out_shard, in_full), lambda s: self._comm.reduce_scatter(send, recv, n, code, s))

    def all_gather(self, out_full: torch.Tensor, in_shard: torch.Tensor, **where) -> Handle:
        op = "all_gather"
        self.check_shapes(op, out_full, in_shard)
        code = self._check_tensor(op, in_shard)
        self._check_tensor(op, out_full)
        if in_shard.numel() == 0:
            return CompletedHandle(op)
        send, recv, n = in_shard.data_ptr(), out_full.data_ptr(), in_shard.numel()
        return self._issue(op, where, (out_full, in_shard), lambda s: self._comm.all_gather(send, recv, n, code, s))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", **where) -> Handle:
        name = "all_reduce"
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {REDUCE_OPS}")
        code = self._check_tensor(name, tensor)
        if op == "avg" and not tensor.is_floating_point():
            raise TypeError(f"all_reduce: op 'avg' needs a floating-point tensor, got {tensor.dtype}")
        if tensor.numel() == 0:
            return CompletedHandle(name)
        ptr, n, red = tensor.data_ptr(), tensor.numel(), _nccl.REDUCE_OPS[op]
        return self._issue(name, where, (tensor,), lambda s: self._comm.all_reduce(ptr, ptr, n, code, red, s))

    def broadcast(self, tensor: torch.Tensor, root: int = 0, **where) -> Handle:
        op = "broadcast"
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of a world of size {self.size}")
        code = self._check_tensor(op, tensor)
        if tensor.numel() == 0:
            return CompletedHandle(op)
        ptr, n = tensor.data_ptr(), tensor.numel()
        return self._issue(op, where, (tensor,), lambda s: self._comm.broadcast(ptr, ptr, n, code, root, s))

    def __repr__(self) -> str:
        return f"NcclNativeBackend(rank={self.rank}, size={self.size}, device={self.device})"
