"""Online Bayesian optimization of DistOptim's knobs (DeAR paper, section IV.B).

Three pieces, all independent of ``torch.distributed``:

* :class:`BayesianTuner` -- an ask/tell loop over one or more :class:`Knob`
  objects, built on the ``bayes_opt`` package: a Gaussian process (Matern 5/2)
  fitted to the observed throughputs and the expected-improvement acquisition
  with ``xi = 0.1`` (the paper's value).  The first suggestion is the knobs'
  initial values (25 MB for the fusion buffer), the search runs in log space
  for log-scale knobs (1 MB .. 100 MB for the buffer), and it stops after
  ``budget`` trials or earlier once no point of the space is expected to
  improve on the best throughput by more than ``min_improvement`` (relative).

* :class:`ChoiceTuner` -- the same ask/tell protocol over a few discrete
  candidates, each tried once (``dear``'s measured choice of plan).

* :class:`TuningController` -- drives the trials from inside a training loop:
  call :meth:`TuningController.on_step_end` once per optimizer step on every
  rank; it times steps, and at each trial boundary rank 0 asks the tuner for the
  next knobs and broadcasts the decision so that every rank re-plans with the
  same knobs at the same step.

Units.  Inside the tuner every knob is mapped to ``[0, 1]`` (through ``log``
for log-scale knobs) so that the GP's length scales are comparable across
knobs, and every throughput ``y`` is registered as ``y / y_first - 1`` (its
relative gain over the first trial's throughput), so that ``xi``, ``noise``
and the GP's amplitude are fractions of it: ``xi = 0.1`` means
"an improvement of 10 % of the initial configuration's throughput", whatever
the unit (steps/s or samples/s).  The paper does not say which unit its
``xi`` is in; relative is the only choice that does not depend on the model.

The library never prints; it logs to ``logging.getLogger("dearopt.planning.tuner")``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Knob", "BayesianTuner", "ChoiceTuner", "TuningController", "buffer_size_knob"]

logger = logging.getLogger("dearopt.planning.tuner")

MB = 2**20

Knobs = Dict[str, float]


@dataclasses.dataclass(frozen=True)
class Knob:
    """One tunable parameter.

    Args:
        name: the keyword the knob is passed as (e.g. ``"buffer_size"``).
        low, high: the search range, ``low < high`` (inclusive).
        log: search uniformly in ``log(value)`` (requires ``low > 0``).
        initial: the first trial's value; default the (geometric, if ``log``)
            middle of the range.
        integer: values are rounded to integers (suggestions are ``int``).
    """

    name: str
    low: float
    high: float
    log: bool = False
    initial: Optional[float] = None
    integer: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Knob name must be a non-empty string, got {self.name!r}")
        for attr in ("low", "high"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Knob {self.name!r}: {attr} must be a finite number, got {v!r}")
        if not self.low < self.high:
            raise ValueError(f"Knob {self.name!r}: low must be < high, got low={self.low!r}, high={self.high!r}")
        if self.log and self.low <= 0:
            raise ValueError(f"Knob {self.name!r}: a log-scale knob needs low > 0, got low={self.low!r}")
        if self.integer and math.ceil(self.low) > math.floor(self.high):
            raise ValueError(f"Knob {self.name!r}: no integer in [{self.low!r}, {self.high!r}]")
        if self.initial is None:
            mid = math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2
            object.__setattr__(self, "initial", self._snap(mid))
        else:
            v = self.initial
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Knob {self.name!r}: initial must be a finite number, got {v!r}")
            if not self.low <= v <= self.high:
                raise ValueError(f"Knob {self.name!r}: initial={v!r} is outside [{self.low!r}, {self.high!r}]")
            object.__setattr__(self, "initial", self._snap(v))

    def _snap(self, value: float):
        """Clip to the range and, for an integer knob, round to an int inside it."""
        value = min(max(float(value), self.low), self.high)
        if self.integer:
            value = int(round(value))
            value = max(value, math.ceil(self.low))
            value = min(value, math.floor(self.high))
        return value

    def to_unit(self, value: float) -> float:
        """The value's position in ``[0, 1]`` (log-scaled for a log knob)."""
        if self.log:
            return (math.log(value) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
        return (value - self.low) / (self.high - self.low)

    def from_unit(self, u: float):
        """Inverse of :meth:`to_unit`, snapped (clipped, rounded for an integer knob)."""
        u = min(max(float(u), 0.0), 1.0)
        if self.log:
            value = math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        else:
            value = self.low + u * (self.high - self.low)
        return self._snap(value)

    def format(self, value) -> str:
        """``value`` as text for a log line: sizes in MB, integers as integers, else 4 significant digits."""
        if self.name.endswith("size") and self.log and self.low >= 1024:
            return f"{value / MB:.2f}MB"
        if self.integer:
            return str(int(value))
        return f"{value:.4g}"


def buffer_size_knob(low: int = 1 * MB, high: int = 100 * MB, initial: int = 25 * MB) -> Knob:
    """The fusion buffer size in bytes, as in the paper: 1 MB .. 100 MB, log scale, first trial 25 MB."""
    return Knob("buffer_size", low, high, log=True, initial=initial, integer=True)


def _one_blas_thread():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(limits=1)


def _check_number(name: str, value, *, minimum=None, integer=False) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float))
    if not bad and not integer:
        bad = not math.isfinite(value)
    if bad or (minimum is not None and value < minimum):
        kind = "an integer" if integer else "a finite number"
        lim = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be {kind}{lim}, got {value!r}")


class _Trials:
    """What every tuner keeps: its observations in order, and the best of them.  The protocol a
    :class:`TuningController` drives is this plus ``initial``, ``suggest``, ``observe``, ``done`` and ``describe``."""

    _history: List[Tuple[Knobs, float]]

    @property
    def best(self) -> Optional[Tuple[Knobs, float]]:
        """The observed ``(knobs, throughput)`` with the highest throughput (first on ties), or None."""
        if not self._history:
            return None
        knobs, throughput = max(self._history, key=lambda entry: entry[1])  # max keeps the first of equals
        return dict(knobs), throughput

    @property
    def history(self) -> List[Tuple[Knobs, float]]:
        """Every observation ``(knobs, throughput)`` in order."""
        return [(dict(k), t) for k, t in self._history]


class BayesianTuner(_Trials):
    """Ask/tell Bayesian optimization (GP + expected improvement) of throughput over ``knobs``.

    Usage::

        tuner = BayesianTuner([buffer_size_knob()])
        while not tuner.done:
            knobs = tuner.suggest()           # first: the initial values (25 MB)
            tuner.observe(knobs, measure(**knobs))
        best_knobs, best_throughput = tuner.best

    Args:
        knobs: the :class:`Knob` objects (distinct names), searched jointly.
        budget: at most this many trials (observations), the initial one included.
        xi: the expected-improvement exploration parameter, as a fraction of the
            first observed throughput (the paper uses 0.1, favouring exploration).
        seed: seeds ``bayes_opt``'s random state and the candidate set; the same
            seed and the same observations give the same suggestions.
        min_improvement: stop early (``done``) once the largest expected
            improvement (pure EI, ``xi = 0``, under the GP) over the space (a
            fixed grid of 200 points for one knob, ``n_candidates`` seeded
            random points for more, plus the EI maximizer) is below this fraction of the best observed throughput after
            two observations in a row; default 0.005 (0.5 %, under the noise of a
            few-step throughput average: a trial expected to gain less cannot
            even be told apart from noise).  Never before ``min_trials``
            observations.  0 disables the early stop.
        min_trials: observations needed before the early stop may trigger
            (default ``3 + 2 * number of knobs``: 5 for the buffer size alone).
        noise: the relative standard deviation of one throughput measurement
            (an average over a few steps), default 0.02 (2 %); the GP's
            ``alpha`` is its square.
        steps_per_trial: iterations ``DistOptim`` measures per trial (after one discarded iteration).
        dedup_tol: a suggestion closer than this (Euclidean, in the unit cube
            where every knob spans [0, 1]) to an observed point counts as a
            repeat and is replaced by the best non-repeated candidate (see
            :meth:`suggest`).  0.01 is a factor 1.047 for a 1..100 MB buffer.
    """

    def __init__(
        self,
        knobs: Sequence[Knob],
        *,
        budget: int = 10,
        xi: float = 0.1,
        seed: int = 0,
        min_improvement: float = 0.005,
        min_trials: Optional[int] = None,
        noise: float = 0.02,
        dedup_tol: float = 0.01,
        n_candidates: int = 2000,
        steps_per_trial: int = 10,
    ):
        _check_number("steps_per_trial", steps_per_trial, minimum=1, integer=True)
        self.steps_per_trial = int(steps_per_trial)
        if isinstance(knobs, Knob):
            knobs = [knobs]
        knobs = list(knobs)
        if not knobs:
            raise ValueError("knobs must name at least one Knob")
        for k in knobs:
            if not isinstance(k, Knob):
                raise ValueError(f"knobs must be Knob objects, got {k!r}")
        names = [k.name for k in knobs]
        for n in names:
            if names.count(n) > 1:
                raise ValueError(f"knob name {n!r} appears more than once")
        _check_number("budget", budget, minimum=1, integer=True)
        _check_number("xi", xi, minimum=0)
        _check_number("seed", seed, minimum=0, integer=True)
        _check_number("min_improvement", min_improvement, minimum=0)
        if min_trials is not None:
            _check_number("min_trials", min_trials, minimum=1, integer=True)
        _check_number("noise", noise, minimum=0)
        _check_number("dedup_tol", dedup_tol, minimum=0)
        _check_number("n_candidates", n_candidates, minimum=1, integer=True)

        self.knobs: Tuple[Knob, ...] = tuple(knobs)
        self.budget = budget
        self.xi = float(xi)
        self.seed = seed
        self.min_improvement = float(min_improvement)
        self.min_trials = min_trials if min_trials is not None else 3 + 2 * len(knobs)
        self.dedup_tol = float(dedup_tol)
        self._dim = len(knobs)

        # Imported here so that `import dearopt` does not need bayes_opt/sklearn.
        from bayes_opt import BayesianOptimization, acquisition
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern

        self._acq = acquisition.ExpectedImprovement(xi=self.xi)
        self._bo = BayesianOptimization(
            f=None,
            pbounds={k.name: (0.0, 1.0) for k in self.knobs},
            acquisition_function=self._acq,
            random_state=seed,
            verbose=0,
            allow_duplicate_points=False,
        )
        # Length scales bounded to the unit cube's scale: a handful of points
        # cannot identify a scale far below their spacing or far beyond the range.
        # Targets are relative deviations from the first throughput (see the
        # module doc), so the GP's zero prior mean is "as fast as the initial
        # knobs" and its amplitude and noise are fractions of that throughput
        # (normalize_y would make them meaningless when all targets are equal).
        self._bo.set_gp_params(
            kernel=ConstantKernel(0.1, (1e-4, 10.0))
            * Matern(length_scale=[0.3] * self._dim, length_scale_bounds=(0.05, 1.0), nu=2.5),
            alpha=max(float(noise) ** 2, 1e-8),
            normalize_y=False,
        )
        rng = np.random.RandomState(seed + 7919)
        if self._dim == 1:
            cand = np.linspace(0.0, 1.0, max(n_candidates // 10, 101)).reshape(-1, 1)
        else:
            cand = rng.uniform(0.0, 1.0, size=(n_candidates, self._dim))
        self._candidates = cand
        self._fallback_rng = rng

        self._history: List[Tuple[Knobs, float]] = []
        self._x: List[np.ndarray] = []  # unit-cube points, parallel to _history
        self._y_ref: Optional[float] = None  # first observed throughput
        self._pending: Optional[Knobs] = None  # the suggestion awaiting observe()
        self._converged = False
        self._below = 0  # consecutive checks under min_improvement
        self.last_max_ei: Optional[float] = None  # relative to the best, after the last observe()

    # ------------------------------------------------------------------ public

    @property
    def initial(self) -> Knobs:
        """The knobs' initial values (the first suggestion)."""
        return {k.name: k.initial for k in self.knobs}

    @property
    def done(self) -> bool:
        """True once ``budget`` trials are observed or no trial is expected to gain ``min_improvement``."""
        return len(self._history) >= self.budget or self._converged

    def suggest(self) -> Knobs:
        """The knobs to try next (the same dict again until :meth:`observe` is called).

        The first suggestion is the initial values.  Later ones maximize EI
        (``bayes_opt``'s ``suggest()``); a suggestion within ``dedup_tol`` of an
        observed point (which ``bayes_opt`` can return when the GP is flat, or
        after rounding integer knobs) is replaced by the candidate of highest EI
        among those at least ``dedup_tol`` from every observed point, so the
        tuner never proposes a point it has already measured.

        Raises:
            RuntimeError: if :attr:`done`.
        """
        if self._pending is not None:
            return dict(self._pending)
        if self.done:
            raise RuntimeError("the tuner is done; use .best")
        if not self._history:
            knobs = self.initial
        else:
            knobs = self._next_point()
        self._pending = knobs
        return dict(knobs)

    def observe(self, knobs: Mapping[str, float], throughput: float) -> None:
        """Record that ``knobs`` gave ``throughput`` (higher is better, > 0)."""
        knobs = self._validate_knobs(knobs)
        if (
            isinstance(throughput, bool)
            or not isinstance(throughput, (int, float, np.floating))
            or not math.isfinite(throughput)
            or throughput <= 0
        ):
            raise ValueError(f"throughput must be a finite number > 0, got {throughput!r}")
        if self.done:
            raise RuntimeError("the tuner is done; no more observations")
        throughput = float(throughput)
        if self._y_ref is None:
            self._y_ref = throughput
        x = self._encode(knobs)
        reg = x.copy()
        # bayes_opt refuses exact duplicates; a repeated measurement is registered
        # a hair away (the GP's noise term treats the two as the same point).
        while reg.tobytes() in {p.tobytes() for p in self._x}:
            reg = np.clip(reg + 1e-9, 0.0, 1.0) if reg.max() < 1.0 else reg - 1e-9
        self._bo.register(params=self._to_params(reg), target=throughput / self._y_ref - 1.0)
        self._history.append((knobs, throughput))
        self._x.append(reg)
        self._pending = None
        logger.debug("observed %s -> %.6g (trial %d)", self._describe(knobs), throughput, len(self._history))
        if len(self._history) < self.budget:
            # The GP has at most tens of points: one BLAS thread is fastest and
            # does not fight the training process's threads (4x faster on 2 busy cores).
            with _one_blas_thread():
                self._pending = self._next_point()
                self._check_converged()

    def describe(self, knobs: Mapping[str, float]) -> str:
        """``"buffer_size=25.00MB"``-style text for logs."""
        return self._describe(knobs)

    # ----------------------------------------------------------------- private

    def _validate_knobs(self, knobs: Mapping[str, float]) -> Knobs:
        if not isinstance(knobs, Mapping):
            raise ValueError(f"knobs must be a dict of knob name -> value, got {knobs!r}")
        by_name = {k.name: k for k in self.knobs}
        for name in knobs:
            if name not in by_name:
                raise ValueError(f"unknown knob {name!r}; the tuner's knobs are {sorted(by_name)}")
        out: Knobs = {}
        for k in self.knobs:
            if k.name not in knobs:
                raise ValueError(f"knob {k.name!r} is missing from {dict(knobs)!r}")
            v = knobs[k.name]
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                raise ValueError(f"knob {k.name!r} must be a finite number, got {v!r}")
            if not k.low <= v <= k.high:
                raise ValueError(f"knob {k.name!r}={v!r} is outside [{k.low!r}, {k.high!r}]")
            out[k.name] = int(v) if k.integer and float(v).is_integer() else (k._snap(v) if k.integer else float(v))
        return out

    def _encode(self, knobs: Mapping[str, float]) -> np.ndarray:
        return np.array([k.to_unit(knobs[k.name]) for k in self.knobs], dtype=float)

    def _decode(self, x: np.ndarray) -> Knobs:
        return {k.name: k.from_unit(u) for k, u in zip(self.knobs, x)}

    def _to_params(self, x: np.ndarray) -> Dict[str, float]:
        return {k.name: float(u) for k, u in zip(self.knobs, x)}

    def _describe(self, knobs: Mapping[str, float]) -> str:
        return ", ".join(f"{k.name}={k.format(knobs[k.name])}" for k in self.knobs)

    def _min_dist(self, x: np.ndarray) -> np.ndarray:
        """Distance of each row of ``x`` to the nearest observed point."""
        obs = np.asarray(self._x)
        return np.min(np.linalg.norm(x[:, None, :] - obs[None, :, :], axis=-1), axis=1)

    def _ei(self, x: np.ndarray, xi: float) -> np.ndarray:
        """EI at the rows of ``x`` under the fitted GP, in units of the first throughput."""
        from scipy.stats import norm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mean, std = self._bo._gp.predict(x, return_std=True)
        y_max = float(np.max(self._bo.space.target))
        std = np.maximum(std, 1e-12)
        a = mean - y_max - xi
        z = a / std
        return a * norm.cdf(z) + std * norm.pdf(z)

    def _next_point(self) -> Knobs:
        """bayes_opt's EI maximizer, snapped to the knobs' grids, de-duplicated."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = self._bo.suggest()  # fits the GP on every observation
        x = self._encode(self._decode(np.array([raw[k.name] for k in self.knobs], dtype=float)))
        if self._min_dist(x[None, :])[0] >= self.dedup_tol:
            return self._decode(x)
        # A repeat: take the best-EI candidate that is not one.
        cand = np.array([self._encode(self._decode(c)) for c in self._candidates])
        ok = self._min_dist(cand) >= self.dedup_tol
        if ok.any():
            ei = np.where(ok, self._ei(cand, self.xi), -np.inf)
            if np.max(ei) > 0:
                choice = cand[int(np.argmax(ei))]
            else:  # flat acquisition: the candidate farthest from what was seen
                choice = cand[int(np.argmax(np.where(ok, self._min_dist(cand), -np.inf)))]
            logger.debug(
                "suggestion %s repeats an observed point; trying %s instead",
                self._describe(self._decode(x)),
                self._describe(self._decode(choice)),
            )
            return self._decode(choice)
        # Every candidate was observed (tiny integer grids): nothing new to try.
        logger.debug("every candidate point has been observed; stopping")
        self._converged = True
        return self._decode(x)

    def _check_converged(self) -> None:
        """Early stop: the largest pure EI anywhere is below ``min_improvement`` of the best
        after two observations in a row (one GP fit on a handful of noisy points can be
        over-confident)."""
        if self._converged:
            self._pending = None
            return
        if len(self._history) < self.min_trials or self.min_improvement <= 0:
            return
        pts = np.vstack([self._candidates, self._encode(self._pending)[None, :]])
        max_ei = float(np.max(self._ei(pts, 0.0)))
        best_rel = 1.0 + float(np.max(self._bo.space.target))
        self.last_max_ei = max_ei / best_rel
        self._below = self._below + 1 if self.last_max_ei < self.min_improvement else 0
        if self._below >= 2:
            logger.debug(
                "max expected improvement %.3g%% < %.3g%%: done", 100 * self.last_max_ei, 100 * self.min_improvement
            )
            self._converged = True
            self._pending = None


class ChoiceTuner(_Trials):
    """Ask/tell over a few discrete candidates: each is tried once, in the given order; the best is kept.

    The same protocol as :class:`BayesianTuner` (``initial``, ``suggest``,
    ``observe``, ``done``, ``best``, ``history``, ``describe``), so that a
    :class:`TuningController` drives it.  For choices a model cannot settle,
    such as which of a few equivalent plans runs fastest on this machine
    (:class:`dearopt.DistOptim`'s ``allreduce="auto"``).  Candidates are dicts
    of picklable values; ties keep the earlier candidate.

    ``rematch``: after every candidate was tried once, those within this
    fraction of the best throughput are tried once more, in the reverse order
    (a slow drift of the machine then favours none of them), and each
    candidate's throughput is the mean of its trials.  A few steps per trial
    cannot tell plans apart whose steps vary by more than they differ: on two
    cores the same plan's steps spread by +-12 % (ResNet-50 at 3 Gbit/s), and a
    plan that had won its 3-step trial by 7 % ran 5 % slower than the one it beat.
    """

    def __init__(self, candidates: Sequence[Mapping[str, object]], rematch: float = 0.0):
        candidates = [dict(c) for c in candidates]
        if not candidates:
            raise ValueError("ChoiceTuner needs at least one candidate")
        for c in candidates:
            if candidates.count(c) > 1:
                raise ValueError(f"candidate {c!r} appears more than once")
        _check_number("rematch", rematch, minimum=0.0)
        self.candidates: Tuple[Knobs, ...] = tuple(candidates)
        self.rematch = float(rematch)
        self._queue: List[Knobs] = [dict(c) for c in candidates]  # still to try, in order
        self._rematched = False
        self._history: List[Tuple[Knobs, float]] = []

    @property
    def initial(self) -> Knobs:
        """The first candidate (the first suggestion)."""
        return dict(self.candidates[0])

    @property
    def done(self) -> bool:
        """True once every candidate (and the rematch of the close ones, if any) has been observed."""
        return not self._queue

    def suggest(self) -> Knobs:
        """The candidate to try next (the same one again until :meth:`observe` is called)."""
        if self.done:
            raise RuntimeError("the tuner is done; use .best")
        return dict(self._queue[0])

    def observe(self, knobs: Mapping[str, object], throughput: float) -> None:
        """Record that the candidate on trial, ``knobs``, gave ``throughput`` (higher is better, > 0); after the last
        one, the candidates within ``rematch`` of the best are queued once more in reverse order."""
        if self.done:
            raise RuntimeError("the tuner is done; no more observations")
        if dict(knobs) != self._queue[0]:
            raise ValueError(f"observed {dict(knobs)!r}, but the candidate on trial is {self._queue[0]!r}")
        if (
            isinstance(throughput, bool)
            or not isinstance(throughput, (int, float, np.floating))
            or not math.isfinite(throughput)
            or throughput <= 0
        ):
            raise ValueError(f"throughput must be a finite number > 0, got {throughput!r}")
        self._history.append((dict(knobs), float(throughput)))
        self._queue.pop(0)
        if not self._queue and not self._rematched and self.rematch > 0:
            self._rematched = True
            best = self.best[1]
            close = [c for c in self.candidates if self._mean(c) >= (1.0 - self.rematch) * best]
            if len(close) > 1:
                self._queue = [dict(c) for c in reversed(close)]

    def _mean(self, candidate: Knobs) -> float:
        values = [t for k, t in self._history if k == candidate]
        return sum(values) / len(values) if values else -math.inf

    @property
    def best(self) -> Optional[Tuple[Knobs, float]]:
        """The candidate with the highest mean throughput over its trials (the earlier one on ties), or None."""
        if not self._history:
            return None
        tried = [c for c in self.candidates if any(k == c for k, _ in self._history)]
        knobs = max(tried, key=self._mean)  # max keeps the first of equals
        return dict(knobs), self._mean(knobs)

    def describe(self, knobs: Mapping[str, object]) -> str:
        """``"key=value, ..."`` text for logs."""
        return ", ".join(f"{k}={v!r}" for k, v in knobs.items())


class TuningController:
    """Runs tuner trials inside a training loop, one trial = ``warmup_steps + measure_steps`` steps.

    Call :meth:`on_step_end` once per completed optimizer step on EVERY rank
    (the same number of times on each).  The controller times the steps with
    ``clock``; a trial discards its first ``warmup_steps`` steps (the re-plan
    and the first step under new knobs) and measures the throughput of the
    next ``measure_steps``: one over the median of their step times (steps/s;
    a single slow step, a collection or a page-fault storm, does not decide a
    trial), times ``samples_per_step`` if given (samples/s).  Only rank 0's (``is_root``)
    timing is used -- in synchronous data-parallel training every rank runs at
    the pace of the slowest, so rank 0's wall time is the job's.

    At the end of each trial rank 0 records the throughput in the tuner, asks
    it for the next knobs (or, when it is done, takes the best), and passes the
    decision through ``broadcast(decision_or_None) -> decision`` (a function
    that broadcasts a picklable object from rank 0 to every rank; it is called
    on every rank at the same step, with ``None`` on the others).  Every rank
    then returns the new knobs (apply them before the next step), or None.

    The first trial runs the tuner's initial knobs (which the caller is
    already using), so the first calls return None.  When tuning finishes,
    the best knobs are returned once (if they differ from the current ones),
    :attr:`finished` becomes True, and every later call returns None at no
    cost (no clock read, no broadcast).  If the tuner raises on rank 0, the
    error is logged and tuning finishes with the best knobs so far, so that
    the other ranks are never left waiting in ``broadcast``.
    """

    def __init__(
        self,
        tuner: BayesianTuner,
        *,
        warmup_steps: int = 1,
        measure_steps: int = 10,
        is_root: bool,
        broadcast: Callable[[Optional[dict]], dict],
        clock: Callable[[], float] = time.perf_counter,
        samples_per_step: Optional[float] = None,
    ):
        if not isinstance(tuner, _Trials):
            raise ValueError(f"tuner must be a BayesianTuner or a ChoiceTuner, got {tuner!r}")
        _check_number("warmup_steps", warmup_steps, minimum=0, integer=True)
        _check_number("measure_steps", measure_steps, minimum=1, integer=True)
        if samples_per_step is not None:
            _check_number("samples_per_step", samples_per_step)
            if samples_per_step <= 0:
                raise ValueError(f"samples_per_step must be > 0, got {samples_per_step!r}")
        if not callable(broadcast):
            raise ValueError(f"broadcast must be callable, got {broadcast!r}")
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {clock!r}")
        self.tuner = tuner
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.is_root = bool(is_root)
        self._broadcast = broadcast
        self._clock = clock
        self.samples_per_step = samples_per_step
        self.unit = "samples/s" if samples_per_step is not None else "steps/s"

        self._current: Knobs = tuner.suggest() if self.is_root else tuner.initial
        # The very first call has no start time to measure from: with no
        # warm-up it only sets the reference point.
        self._steps = -1 if warmup_steps == 0 else 0
        self._t_start: Optional[float] = None
        self._durations: List[float] = []  # the measured steps' times in this trial
        self._history: List[Tuple[Knobs, float]] = []
        self._best: Optional[Tuple[Knobs, float]] = None
        self.finished = False

    def restart_trial(self) -> None:
        """Discard what the trial under way has measured and measure it again from the next step (every rank,
        at the same step: the job changed under it, e.g. its trainable parameters)."""
        self._steps = -1 if self.warmup_steps == 0 else 0
        self._t_start = None
        self._durations = []

    @property
    def current(self) -> Knobs:
        """The knobs in use now."""
        return dict(self._current)

    @property
    def history(self) -> List[Tuple[Knobs, float]]:
        """``(knobs, throughput)`` of every finished trial (the same on every rank)."""
        return [(dict(k), t) for k, t in self._history]

    @property
    def best(self) -> Optional[Tuple[Knobs, float]]:
        """The best trial ``(knobs, throughput)`` so far (the same on every rank), or None."""
        return None if self._best is None else (dict(self._best[0]), self._best[1])

    def on_step_end(self) -> Optional[Knobs]:
        """Account one finished step; the knobs to switch to now, or None."""
        if self.finished:
            return None
        now = self._clock()
        self._steps += 1
        if self._steps > self.warmup_steps and self._t_start is not None:
            self._durations.append(now - self._t_start)
        if self._steps >= self.warmup_steps:
            self._t_start = now  # the end of the last step: the next one is timed from here
        if self._steps < self.warmup_steps + self.measure_steps:
            return None

        decision = self._decide(now) if self.is_root else None
        decision = self._broadcast(decision)
        return self._apply(decision, self._clock() if self.warmup_steps == 0 else None)

    # ----------------------------------------------------------------- private

    def _decide(self, now: float) -> dict:
        tuner = self.tuner
        step_time = statistics.median(self._durations) if self._durations else 0.0
        throughput = (self.samples_per_step or 1.0) / step_time if step_time > 0 else float("inf")
        trial = len(self._history) + 1
        logger.info("trial %d: %s -> throughput %.4g %s", trial, tuner.describe(self._current), throughput, self.unit)
        record = (dict(self._current), throughput)
        try:
            tuner.observe(self._current, throughput)
            if tuner.done:
                best_knobs, best_thr = tuner.best
                logger.info(
                    "tuning done after %d trials: best %s -> throughput %.4g %s",
                    trial,
                    tuner.describe(best_knobs),
                    best_thr,
                    self.unit,
                )
                return {"knobs": best_knobs, "finished": True, "record": record, "best": (best_knobs, best_thr)}
            return {"knobs": tuner.suggest(), "finished": False, "record": record, "best": tuner.best}
        except Exception:  # never leave the other ranks waiting in broadcast
            logger.exception("tuner failed at trial %d; keeping the best knobs so far", trial)
            cands = list(self._history) + ([record] if math.isfinite(throughput) else [])
            best = max(cands, key=lambda r: r[1]) if cands else (dict(self._current), throughput)
            return {"knobs": dict(best[0]), "finished": True, "record": record, "best": best}

    def _apply(self, decision: dict, t_boundary: Optional[float]) -> Optional[Knobs]:
        self._history.append((dict(decision["record"][0]), decision["record"][1]))
        self._best = (dict(decision["best"][0]), decision["best"][1])
        new = dict(decision["knobs"])
        changed = new != self._current
        self._current = new
        self._steps = 0
        self._t_start = t_boundary
        self._durations = []
        if decision["finished"]:
            self.finished = True
        return dict(new) if changed else None
