"""The ``cuda-relay`` test backend: CUDA tensors, NCCL's stream contract, host memory and gloo underneath.

One GPU cannot host two NCCL ranks (NCCL refuses two ranks on one device),
so the engine's multi-rank paths with CUDA tensors, streams and the caching
allocator could not run anywhere but on a multi-GPU machine.  This backend
gives each rank the contract of the NCCL backends while moving the bytes
through pinned host buffers and a gloo process group, so that 2 or 3 ranks
share one GPU:

- an op waits for the work queued so far on the caller's current stream
  (an event recorded at issue, waited on by the relay's own stream);
- it runs on the relay's own CUDA stream (device-to-host copy, gloo on the
  host copies, host-to-device copy), one op after another in issue order,
  which is the order the ranks match collectives in;
- :meth:`RelayHandle.wait` orders the caller's current stream after the op's
  completion event (the host waits only until the op has been *queued*, as
  the relay's worker thread must record that event first);
- :meth:`RelayHandle.synchronize` waits on the host until the op is done;
- tensors handed to an op are recorded on the relay stream
  (``Tensor.record_stream``) and held by the handle until it completes.

It is a test backend (``dearopt.init(backend="cuda-relay")``): it is slow
(every op crosses PCIe twice and the host once) and exists so that the
multi-rank tests run with CUDA tensors on a single GPU.  With ``device`` on
the CPU it relays CPU tensors the same way (worker thread, issue order,
timeouts) without streams, which is how its logic is tested without a GPU.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from dearopt.backends.base import CollectiveBackend, CompletedHandle, Handle
from dearopt.errors import CollectiveError, CollectiveTimeoutError

__all__ = ["HostRelayBackend", "RelayHandle"]


class RelayHandle(Handle):
    """An op queued on the relay; ``wait`` orders the current stream after it, ``synchronize`` waits on the host."""

    def __init__(
        self,
        backend: "HostRelayBackend",
        future: concurrent.futures.Future,
        op: str,
        where: dict,
        tensors: Sequence[torch.Tensor],
    ):
        self._backend = backend
        self._future = future
        self.op = op
        self._where = where
        self._tensors: Tuple[torch.Tensor, ...] = tuple(tensors)  # alive until the op is done
        self._finished = False

    def _queued(self, timeout: Optional[float]):
        """The op's completion event (None on the CPU) once the worker has queued its last copy."""
        seconds = self._backend.timeout if timeout is None else float(timeout)
        try:
            return self._future.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeoutError(
                f"{self.op} did not finish in {seconds:g} s (cuda-relay)",
                rank=self._backend.rank,
                op=self.op,
                **self._where,
            ) from None

    def wait(self, timeout: Optional[float] = None) -> None:
        event = self._queued(timeout)
        if event is None:
            self._done()
        else:
            torch.cuda.current_stream(self._backend.device).wait_event(event)

    def synchronize(self, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (self._backend.timeout if timeout is None else float(timeout))
        event = self._queued(timeout)
        while event is not None and not event.query():
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"{self.op} did not finish in time (cuda-relay)", rank=self._backend.rank, op=self.op, **self._where
                )
            time.sleep(0.0002)
        self._done()

    def is_completed(self) -> bool:
        if self._finished:
            return True
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True  # wait() raises it
        event = self._future.result()
        if event is None or event.query():
            self._done()
        return self._finished

    def _done(self) -> None:
        self._finished = True
        self._tensors = ()


class HostRelayBackend(CollectiveBackend):
    """Collectives on ``device`` tensors relayed through host memory and ``inner`` (a gloo backend)."""

    name = "cuda-relay"
    host_waits = False

    def __init__(self, inner: CollectiveBackend, device: torch.device):
        super().__init__(inner.rank, inner.size, inner.timeout)
        self.inner = inner
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dearopt-relay")
        self._last: Optional[concurrent.futures.Future] = None
        self._failure: Optional[BaseException] = None
        self._lock = threading.Lock()

    @property
    def stream(self):
        """The relay's own CUDA stream (None on the CPU)."""
        return self._stream

    # ------------------------------------------------------------ plumbing
    def _submit(
        self,
        op: str,
        where: dict,
        reads: Sequence[torch.Tensor],
        writes: Sequence[torch.Tensor],
        run: Callable[[List[torch.Tensor], List[torch.Tensor]], Handle],
    ) -> Handle:
        """Queue ``run(host_reads, host_writes)`` (which starts the op on ``inner`` and returns its handle).

        ``reads`` are copied to the host after the caller's current stream's work so far; ``writes`` are
        copied back on the relay stream afterwards (a tensor in both is copied once each way).
        """
        self._check_open(op, where)
        where = dict(where)
        op = where.pop("op", op)
        for t in list(reads) + list(writes):
            if t.device != self.device:
                raise ValueError(
                    f"{op}: the tensor is on {t.device}, but this cuda-relay backend uses {self.device}"
                    " (backend.device)"
                )
        tensors = tuple({id(t): t for t in list(reads) + list(writes)}.values())
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for t in tensors:
                t.record_stream(self._stream)

        def job():
            if self._failure is not None:  # the transport broke on an earlier op: later ones cannot match
                raise CollectiveError(
                    f"{op}: an earlier op on this cuda-relay backend failed ({self._failure})",
                    rank=self.rank,
                    op=op,
                    **where,
                )
            try:
                return self._relay(op, where, reads, writes, run, ready)
            except BaseException as exc:
                self._failure = exc
                raise

        with self._lock:
            future = self._worker.submit(job)
            self._last = future
        return RelayHandle(self, future, op, where, tensors)

    def _relay(self, op, where, reads, writes, run, ready):
        if not self._cuda:
            run(list(reads), list(writes)).wait()
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            host = {}
            for t in list(reads) + list(writes):
                if id(t) not in host:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    if any(t is r for r in reads):
                        h.copy_(t, non_blocking=True)
                    host[id(t)] = h
            self._stream.synchronize()
        run([host[id(t)] for t in reads], [host[id(t)] for t in writes]).wait()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            for t in writes:
                # through .data: a collective's result is not an in-place change by autograd's bookkeeping (the
                # NCCL backends write from C++, which no version counter sees; the engine watches the counters)
                t.data.copy_(host[id(t)], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    # ----------------------------------------------------------------- ops
    def reduce_scatter(self, out_shard, in_full, **where) -> Handle:
        self.check_shapes("reduce_scatter", in_full, out_shard)
        if self.size == 1:
            out_shard.copy_(in_full)
            return CompletedHandle("reduce_scatter")
        return self._submit(
            "reduce_scatter", where, [in_full], [out_shard], lambda r, w: self.inner.reduce_scatter(w[0], r[0], **where)
        )

    def all_gather(self, out_full, in_shard, **where) -> Handle:
        self.check_shapes("all_gather", out_full, in_shard)
        if self.size == 1:
            out_full.copy_(in_shard)
            return CompletedHandle("all_gather")
        return self._submit(
            "all_gather", where, [in_shard], [out_full], lambda r, w: self.inner.all_gather(w[0], r[0], **where)
        )

    def all_reduce(self, tensor, op: str = "sum", **where) -> Handle:
        if self.size == 1:
            self.inner.all_reduce(tensor, op, **where)  # validates op
            return CompletedHandle("all_reduce")
        return self._submit(
            "all_reduce", where, [tensor], [tensor], lambda r, w: self.inner.all_reduce(w[0], op, **where)
        )

    def broadcast(self, tensor, root: int = 0, **where) -> Handle:
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of a world of size {self.size}")
        if self.size == 1:
            return CompletedHandle("broadcast")
        return self._submit(
            "broadcast", where, [tensor], [tensor], lambda r, w: self.inner.broadcast(w[0], root, **where)
        )

    # ------------------------------------------------------- communicators
    def members(self):
        return self.inner.members()

    def fork(self) -> "HostRelayBackend":
        self._check_open("fork", {})
        return self._track_fork(HostRelayBackend(self.inner.fork(), self.device))

    def second_link(self) -> "HostRelayBackend":
        self._check_open("second_link", {})
        return self._track_fork(HostRelayBackend(self.inner.second_link(), self.device))

    def release_workspace(self) -> None:
        self.inner.release_workspace()

    def close(self) -> None:
        """Let queued ops finish (up to the timeout, at most 10 s), then close the gloo group underneath."""
        if self._closed:
            return
        super().close()
        last = self._last
        if last is not None:
            try:
                last.exception(timeout=min(self.timeout, 10.0))
            except Exception:  # still running: cancelled with the group below
                pass
        self._worker.shutdown(wait=False, cancel_futures=True)
        self.inner.close()

    def __repr__(self) -> str:
        return f"HostRelayBackend(rank={self.rank}, size={self.size}, device={self.device})"
