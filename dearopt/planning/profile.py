"""The one-time profile a priority plan is ordered by.

With ``priority=True``, ``dear``'s ``allreduce="auto"`` or a schedule that forms
its buckets from the profile (``prophet``), rank 0 records during the
:data:`ReadyProfile.STEPS` steps from :data:`ReadyProfile.STEP` on when each
gradient becomes ready (seconds after backward starts), how long backward took
and the bandwidth its reductions achieved while the link was busy, and how long
the forward computed (its waits for all-gathers left out).  One step
is one sample of a noisy machine (the same ResNet-50 cell formed 20 to 43
Prophet blocks from single steps), so the measurement is their per-gradient
median, and the bandwidth and fixed cost are fitted over every reduction of
the window (:func:`fit_link`); the fixed cost is at least that of a few
tiny collectives timed at the window's end.  At the window's last ``step()`` rank 0 broadcasts the numbers once
over the control channel; every rank then re-plans from the same numbers at
the next backward, so the order stays identical everywhere.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from dearopt.backends.base import CollectiveBackend

__all__ = ["ReadyProfile", "Measurement", "LinkMonitor", "fit_latency", "fit_link"]


class Measurement(NamedTuple):
    """Rank 0's measurement of a window of steps, shared with every rank."""

    ready: List[float]  # seconds after backward starts at which each parameter's gradient was ready (median)
    bandwidth: float  # bytes/s of the reductions on the link, beyond their fixed cost (fit_link)
    backward: float  # seconds of backward (median)
    latency: float  # fixed seconds per reduction (fit_link), 0.0 where it could not be told
    forward: Optional[float] = None  # seconds of forward computation (median), its waits for all-gathers left out


def fit_latency(services: Sequence[Tuple[int, float]], bandwidth: float) -> float:
    """The fixed cost per collective in ``seconds = latency + bytes / bandwidth``, from each reduction's
    ``(bytes, seconds)`` on the link: the median of ``seconds - bytes / bandwidth``, at least 0."""
    if not services or not bandwidth > 0:
        return 0.0
    return max(0.0, statistics.median(t - n / bandwidth for n, t in services))


def fit_link(services: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """``(bandwidth, latency)`` of ``seconds = latency + bytes / bandwidth`` fitted to each reduction's
    ``(bytes, seconds)`` on the link.

    The slope is Theil-Sen's (the median of the slopes between every two reductions of different sizes),
    robust to the one op whose end was observed late, and it does not depend on how the bytes were cut
    into ops: ``bytes / busy seconds`` counts every op's fixed cost as link time, so a plan of more, smaller
    blocks made the same link look slower (ResNet-50 at 3 Gbit/s: 286 MB/s with 27 blocks, 161 MB/s with 16)
    and the link monitor re-planned on that.  Where sizes do not differ enough to tell (fewer than two
    sizes, or a slope that is not positive) the bandwidth is ``bytes / busy seconds`` and the latency
    :func:`fit_latency`'s.  No reductions: 1 GB/s and no latency.
    """
    nbytes, busy = sum(n for n, _ in services), sum(t for _, t in services)
    if not services or busy <= 0:
        return 1e9, 0.0
    slopes = [(tj - ti) / (nj - ni) for k, (ni, ti) in enumerate(services) for nj, tj in services[k + 1 :] if nj != ni]
    slope = statistics.median(slopes) if slopes else 0.0
    if slope <= 0:
        bandwidth = nbytes / busy
        return bandwidth, fit_latency(services, bandwidth)
    return 1.0 / slope, max(0.0, statistics.median(t - n * slope for n, t in services))


class ReadyProfile:
    STEP = 1
    """The first step that is profiled (step 0 builds the plan and is not typical)."""
    STEPS = 3
    """Steps per measurement: the first one's, and each of the link monitor's."""

    def __init__(self, enabled: bool, every: Optional[int] = None, steps: int = STEPS):
        if steps < 1:
            raise ValueError(f"a measurement needs at least one step, got steps={steps!r}")
        self.enabled = enabled
        self.every = every  # start a new measurement every this many steps after STEP (the link monitor), or never
        self.steps = steps
        self.start = self.STEP  # the first step of the first measurement
        self.result: Optional[Measurement] = None  # what the plan uses
        self.fresh = False  # a result arrived that the plan does not use yet
        self.latest: Optional[Measurement] = None  # the newest measurement shared
        self.remeasured = False  # a measurement after the first arrived, not yet looked at
        self._times: Optional[List[float]] = None
        self.recording = False  # a step is being recorded (_times is not None): read at every hook, so an attribute
        self._t0 = 0.0
        self._backward = 0.0
        self._forward_start: Optional[float] = None  # this step's training forward: when it began
        self._forward_waited = 0.0  # ... and how long it waited for collectives
        self._forward = 0.0
        self._left = 0  # steps of the measurement under way still to record
        self._window: List[Tuple[List[float], float, Sequence[Tuple[int, float]]]] = []  # (ready, backward, services)

    def begin_forward(self) -> None:
        """A training forward starts (its computation is timed for the profile's ``forward``)."""
        if self.enabled:
            self._forward_start, self._forward_waited = time.perf_counter(), 0.0

    def forward_waited(self, seconds: float) -> None:
        """The forward waited this long for collectives (left out of its computation time)."""
        self._forward_waited += seconds

    def begin_backward(self, step: int, n_params: int) -> None:
        if not self.enabled:
            return
        started, self._forward_start = self._forward_start, None
        self._forward = time.perf_counter() - started - self._forward_waited if started is not None else math.nan
        if self._left == 0:
            again = (
                self.every is not None
                and self.result is not None
                and step > self.STEP
                and (step - self.STEP) % self.every == 0
            )
            if not (self.result is None and step == self.start or again):
                return
            self._left, self._window = self.steps, []
        elif self._window and len(self._window[0][0]) != n_params:  # a parameter was unfrozen: start again
            self._left, self._window = self.steps, []
        self._times = [math.inf] * n_params
        self.recording = True
        self._t0 = time.perf_counter()

    def forget(self, start: int) -> None:
        """Drop every measurement (they were of another set of parameters) and measure again from step
        ``start`` on (called on every rank at the same step)."""
        self.start = start
        self.result = self.latest = None
        self.fresh = self.remeasured = False
        self._times, self._left, self._window = None, 0, []
        self.recording = False

    def grad_ready(self, position: int) -> None:
        if self._times is not None:
            self._times[position] = time.perf_counter() - self._t0

    def arrived(self, arrivals) -> None:
        """Every gradient's arrival at once: ``(position, perf_counter seconds)`` pairs (noted in C++)."""
        if self._times is not None:
            times, t0 = self._times, self._t0
            for position, when in arrivals:
                times[position] = when - t0

    def end_backward(self) -> None:
        if self._times is not None:
            self._backward = time.perf_counter() - self._t0

    PROBES = 3
    """Tiny collectives timed at the end of each measurement (their median is the fixed cost per op at least)."""

    def _probe(self, control: CollectiveBackend, step: int) -> float:
        """The fixed cost of one collective, timed directly: the median of :data:`PROBES` one-element
        all-reduces (every rank runs them).  A fit over the job's own reductions cannot tell it where their
        sizes are alike (25 MB buckets), and on the degraded machine of 2026-11-25 it is 22 ms, not the
        1 ms floor: Prophet then formed 35 blocks where 11 ran faster."""
        one = torch.zeros(1, device=control.device)
        times = []
        for _ in range(self.PROBES):
            t0 = time.perf_counter()
            control.all_reduce(one, step=step).wait()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def share(self, control: CollectiveBackend, services: Sequence[Tuple[int, float]], step: int) -> None:
        """Broadcast rank 0's profile (called on every rank at the profiled step's ``step()``).

        ``services``: ``(bytes, seconds)`` of each reduction on the link (from its start, or the end of the one
        before it, to its observed end).
        """
        if self._times is None:
            return
        self._window.append(
            ([t if math.isfinite(t) else 0.0 for t in self._times], self._backward, list(services), self._forward)
        )
        self._times = None
        self.recording = False
        self._left -= 1
        if self._left > 0:
            return  # the measurement goes on at the next step; nothing is shared before its last
        ready, backward, services, forward = _summarise(self._window)
        self._window = []
        bandwidth, latency = fit_link(services)
        latency = max(latency, self._probe(control, step))
        profile = torch.tensor(
            ready + [bandwidth, backward, latency, forward], dtype=torch.float64, device=control.device
        )
        control.broadcast(profile, 0, step=step).wait()
        values = profile.tolist()
        self.latest = Measurement(
            values[:-4], values[-4], values[-3], values[-2], values[-1] if math.isfinite(values[-1]) else None
        )
        if self.result is None:
            self.result = self.latest
            self.fresh = True
        else:
            self.remeasured = True


def _summarise(window):
    """One measurement from several steps': each gradient's median ready time, the median backward, every
    step's reductions together (the bandwidth and the fixed cost are fitted over all of them) and the median
    forward computation (NaN where no step timed its forward)."""
    # statistics.median's value, one comprehension for every gradient (not one call per gradient: this runs at
    # every measurement of the link monitor, on the step's hot path)
    half = len(window) // 2
    if len(window) % 2:
        ready = [sorted(times)[half] for times in zip(*(w[0] for w in window))]
    else:
        ready = [(s[half - 1] + s[half]) / 2 for s in map(sorted, zip(*(w[0] for w in window)))]
    forwards = [w[3] for w in window if math.isfinite(w[3])]
    return (
        ready,
        statistics.median(w[1] for w in window),
        [s for w in window for s in w[2]],
        statistics.median(forwards) if forwards else math.nan,
    )


class LinkMonitor:
    """When the link's bandwidth has changed: Prophet's network bandwidth monitor, on the job's own reductions.

    Every ``link_check_every`` steps rank 0 re-measures (:class:`ReadyProfile`) and shares the numbers, so every
    rank calls :meth:`observe` with the same values and takes the same decision.  The bandwidth counts as changed
    when it differs from the one the plan was made with by more than ``threshold`` (relative) in ``patience``
    measurements in a row, all on the same side and each within ``threshold`` of the one before it; one slow or fast
    step does not re-plan, nor do readings that scatter (on an unshaped, loaded loopback they ranged from 32 MB/s to
    315 GB/s, and two in a row on the same side re-planned every 60 steps: ~2,500 operator dispatches and a new set
    of buckets each time, for no change of the link).
    """

    def __init__(self, threshold: float = 0.25, patience: int = 2):
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience!r}")
        self.threshold, self.patience = threshold, patience
        self._streak = 0
        self._side = 0
        self._last = 0.0  # the streak's latest measurement
        self.changes: List[Tuple[int, float, float]] = []  # (step, planned bytes/s, new bytes/s) adopted

    def observe(self, step: int, planned: float, measured: float) -> bool:
        """Whether the plan should now be re-made with ``measured`` bytes/s (it was made with ``planned``)."""
        ratio = measured / planned if planned > 0 else math.inf
        side = 1 if ratio > 1 + self.threshold else -1 if ratio < 1 / (1 + self.threshold) else 0
        agrees = self._last > 0 and 1 / (1 + self.threshold) <= measured / self._last <= 1 + self.threshold
        if side == 0 or side != self._side or not agrees:
            self._streak = 0
        self._side, self._last = side, measured
        if side == 0:
            return False
        self._streak += 1
        if self._streak < self.patience:
            return False
        self._streak, self._side = 0, 0
        self.changes.append((step, planned, measured))
        return True
