"""What a collective costs: the alpha-beta model of DeAR's Eq. 3-5, fitted to measurements.

For ``P`` ranks and a message of ``n`` bytes (ring or pairwise exchange):

* reduce-scatter, all-gather: ``(P - 1) * (alpha + n / P * beta)``  (Eq. 3, 4)
* all-reduce: ``2 * (P - 1) * alpha + 2 * (P - 1) / P * n * beta``   (Eq. 5)
* broadcast (pipelined tree): ``ceil(log2 P) * alpha + n * beta``

``alpha`` is the latency of one step, ``beta`` the seconds per byte of the
slowest link (``1 / bandwidth``).  A fit from timings taken with ``P0`` ranks
(:func:`fit`) gives ``alpha`` and ``beta``; :meth:`CommCost.time` then
predicts any ``P``, and :meth:`CommCost.on_link` swaps in another link.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence, Tuple

__all__ = ["CommCost", "fit", "op_steps", "parse_link", "KINDS"]

KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast")


def op_steps(kind: str, world: int) -> Tuple[float, float]:
    """(latency steps, bytes fraction) of one op of ``kind`` on ``world`` ranks."""
    if world <= 1:
        return 0.0, 0.0
    if kind in ("reduce_scatter", "all_gather"):
        return world - 1, (world - 1) / world
    if kind == "all_reduce":
        return 2 * (world - 1), 2 * (world - 1) / world
    if kind == "broadcast":
        return math.ceil(math.log2(world)), 1.0
    raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


@dataclasses.dataclass(frozen=True)
class CommCost:
    kind: str
    alpha: float  # seconds per step
    beta: float  # seconds per byte

    def time(self, nbytes: float, world: int) -> float:
        """Predicted seconds of this op on ``nbytes`` among ``world`` ranks: steps times alpha plus the bytes each rank
        sends times beta."""
        steps, fraction = op_steps(self.kind, world)
        return steps * self.alpha + fraction * nbytes * self.beta

    def on_link(self, bandwidth_bits: float, latency: float = None) -> "CommCost":
        """The same op on a link of ``bandwidth_bits`` bit/s (and ``latency`` s per step, if given)."""
        return dataclasses.replace(self, beta=8.0 / bandwidth_bits, alpha=self.alpha if latency is None else latency)


def fit(kind: str, samples: Sequence[Tuple[float, float]], world: int) -> CommCost:
    """``alpha``, ``beta`` from ``(nbytes, seconds)`` measured on ``world`` ranks: ``beta`` the least-squares
    slope, ``alpha`` the intercept or, where that is not positive (the large messages decide a least-squares
    line, and a shaped link sends small ones within its burst), what the smallest message took beyond its
    bytes' share."""
    if world < 2:
        raise ValueError("a collective's cost can only be measured with 2 or more ranks")
    if len({n for n, _ in samples}) < 2:
        raise ValueError(f"fitting {kind} needs timings at two or more sizes, got {samples}")
    steps, fraction = op_steps(kind, world)
    xs = [n for n, _ in samples]
    ys = [t for _, t in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if intercept <= 0:
        n0, t0 = min(samples)
        intercept = max(t0 - max(slope, 0.0) * n0, 0.0)
    return CommCost(kind, alpha=intercept / steps, beta=max(slope, 0.0) / fraction)


def parse_link(text: str) -> float:
    """``"10gbit"`` -> 1e10 bit/s (also ``100gbit``, ``800mbit``)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", text.lower())
    if not match:
        raise ValueError(f"link {text!r} is not of the form '<number>[k|m|g]bit', e.g. '10gbit'")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
