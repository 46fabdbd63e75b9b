"""Chrome trace events (``chrome://tracing``, Perfetto) of what each rank did.

Enabled by ``DEAROPT_TIMELINE=path.json`` or ``DistOptim(..., timeline=path)``.
Rank ``r`` writes ``path`` with ``.rank<r>`` before the suffix.  Events: forward
and backward phases, each collective from start to completion (as seen by the
waiting side), every wait, and each bucket's optimizer update; for ``prophet``,
each block's reduction as its link model predicted it (``predicted`` lane).  When disabled,
every method is a no-op costing one attribute check.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

__all__ = ["Timeline", "timeline_path_for_rank"]


def timeline_path_for_rank(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    def __init__(self, path: Optional[str], rank: int):
        self.enabled = bool(path)
        self.rank = rank
        self.path = timeline_path_for_rank(path, rank) if path else None
        self._events = []
        self._open = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def begin(self, key, name: str, cat: str, **args) -> None:
        if self.enabled:
            self._open[key] = (name, cat, self._now_us(), args)

    def end(self, key) -> None:
        if self.enabled and key in self._open:
            name, cat, start, args = self._open.pop(key)
            self._add(name, cat, start, self._now_us() - start, args)

    def span(self, name: str, cat: str, start_us: float, **args) -> None:
        if self.enabled:
            self._add(name, cat, start_us, self._now_us() - start_us, args)

    def span_at(self, name: str, cat: str, start_us: float, dur_us: float, **args) -> None:
        """A span at given times (microseconds on this timeline's clock): a prediction placed beside what ran."""
        if self.enabled:
            self._add(name, cat, start_us, dur_us, args)

    def now(self) -> float:
        return self._now_us() if self.enabled else 0.0

    def instant(self, name: str, cat: str, **args) -> None:
        if self.enabled:
            with self._lock:
                self._events.append(
                    {
                        "name": name,
                        "cat": cat,
                        "ph": "i",
                        "s": "t",
                        "ts": self._now_us(),
                        "pid": self.rank,
                        "tid": 0,
                        "args": args,
                    }
                )

    def _add(self, name, cat, start, dur, args):
        tid = {"compute": 0, "wait": 0, "update": 0, "comm": 1, "predicted": 2}.get(cat, 0)
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "ts": start,
                    "dur": max(dur, 0.0),
                    "pid": self.rank,
                    "tid": tid,
                    "args": args,
                }
            )

    def flush(self) -> None:
        """Write every event so far (the file is rewritten whole; it stays valid JSON)."""
        if not self.enabled:
            return
        with self._lock:
            events = list(self._events)
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "communication"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 2, "args": {"name": "predicted"}},
        ]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, fh)
        os.replace(tmp, self.path)
