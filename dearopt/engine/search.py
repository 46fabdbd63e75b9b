"""The plan's knobs searched while training, at step boundaries.

:class:`PlanSearch` is ``DistOptim``'s part that outlives every plan: the
online tuner of the knobs set to ``"auto"`` (DeAR section IV.B), then the
measured choice of ``dear``'s all-reduced buckets (``allreduce="auto"``),
then DDP's plan where the loop reads ``p.grad`` before every ``step()``.  Every
decision is rank 0's, broadcast, and taken at a step boundary on every rank,
so the plans stay identical.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import dearopt.collectives as functions

__all__ = ["PlanSearch", "PLAN_CHOICE_STEPS", "PLAN_CHOICE_REMATCH"]

PLAN_CHOICE_STEPS = 3
"""Steps measured per candidate plan of ``allreduce="auto"`` (after one discarded step that re-plans)."""

PLAN_CHOICE_REMATCH = 0.10
"""Candidate plans of ``allreduce="auto"`` within this fraction of the fastest are measured once more, in the
reverse order, and judged by the mean of their two trials (:class:`dearopt.planning.tuner.ChoiceTuner`)."""


class PlanSearch:
    """The tuner and the measured choice of one engine (see the module).

    It holds no engine: it is given what it decides from and answers with the re-plan to make
    (``knobs`` for :meth:`dearopt.engine.engine.Executor.replan`), which its owner carries out on every rank.

    Args:
        options: the :class:`dearopt.engine.options.Options` in force (which knobs are ``"auto"``, the profile).
        optimizer: the wrapped optimizer (the model's bytes bound the buffer tuner's range).
        control: the control channel rank 0's decisions are broadcast on.
        world: the number of ranks (the simulator's first trial).
        tuner: a :class:`dearopt.planning.tuner.BayesianTuner`, or None for the default over the ``"auto"`` knobs.
    """

    def __init__(self, options, optimizer, control, world: int, tuner):
        self.control = control
        self.plan_choice = None
        self.choice_considered = False
        self.generation = 0  # the planner's generation this search has seen
        self.tuning = self._make_tuning(options, optimizer, world, tuner)

    def _make_tuning(self, options, optimizer, world: int, tuner):
        """The online tuner of the knobs set to "auto"; None when nothing is tuned."""
        import dearopt.planning.tuner as tuning  # bayes_opt is imported only when a tuner is built

        auto = [k for k in ("buffer_size", "partition_size", "credit") if getattr(options, k) == "auto"]
        if tuner is None and not auto:
            return None
        if tuner is None:
            model_bytes = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
            mb = tuning.MB
            knobs = []
            if "buffer_size" in auto:
                high = min(100 * mb, max(model_bytes, 2 * mb))
                initial = min(25 * mb, high)
                if options.profile is not None:  # start where the simulator predicts the optimum
                    import dearopt.sim as sim

                    grid = [int(mb * 2 ** (i / 2)) for i in range(0, 15) if mb * 2 ** (i / 2) <= high]
                    initial = sim.best_buffer_size(options.profile, options.schedule, grid, ranks=world)
                knobs.append(tuning.buffer_size_knob(high=high, initial=initial))
            if "partition_size" in auto:
                knobs.append(tuning.Knob("partition_size", 256 * 1024, 16 * mb, log=True, initial=4 * mb, integer=True))
            if "credit" in auto:
                knobs.append(tuning.Knob("credit", 1 * mb, 64 * mb, log=True, initial=16 * mb, integer=True))
            tuner = tuning.BayesianTuner(knobs, budget=10 if len(knobs) == 1 else 20, steps_per_trial=10)
        if not isinstance(tuner, tuning.BayesianTuner):
            raise TypeError(f"tuner must be a dearopt.planning.tuner.BayesianTuner, got {type(tuner).__name__}")
        return tuning.TuningController(
            tuner,
            warmup_steps=1,
            measure_steps=tuner.steps_per_trial,
            is_root=self.control.rank == 0,
            broadcast=self._broadcast,
        )

    def _broadcast(self, decision):
        return functions.broadcast_object(decision, 0, backend=self.control)

    def first_trial(self) -> Optional[Dict[str, int]]:
        """The knobs of the tuner's first trial to re-plan with at once (None when nothing is tuned)."""
        return None if self.tuning is None else _sizes(self.tuning.current)

    def notice_new_inputs(self, generation: int) -> None:
        """The trainable set or the groups changed (the planner's ``generation``, noticed at a backward, on every
        rank): the measured choice and a tuning trial under way were measured on the old set; measure again."""
        if generation == self.generation:
            return
        self.generation = generation
        self.plan_choice, self.choice_considered = None, False
        if self.tuning is not None and not self.tuning.finished:
            self.tuning.restart_trial()

    def step_ended(self, profile_pending: bool, plan_choices: Callable[[], list]) -> Optional[Dict[str, Any]]:
        """At every ``step()``'s end, on every rank: the re-plan the next trial or the next candidate plan needs
        (``Executor.replan``'s knobs), or None.  ``profile_pending``: rank 0's profile is still to come;
        ``plan_choices``: the plans worth comparing (asked once, when the measured choice starts)."""
        if self.tuning is not None and not self.tuning.finished:
            knobs = self.tuning.on_step_end()
            return _sizes(knobs) if knobs else None  # every rank, at the same step boundary
        if not self.choice_considered:
            self._consider_plan_choice(profile_pending, plan_choices)
        elif self.plan_choice is not None and not self.plan_choice.finished:
            knobs = self.plan_choice.on_step_end()
            if knobs:  # every rank, at the same step boundary
                return {"allreduce": knobs["allreduce"], "blocks": knobs.get("blocks", False)}
        return None

    def adopted_ddp_plan(self) -> None:
        """The loop reads ``p.grad`` before every ``step()`` and DDP's plan was made: nothing more to choose."""
        self.plan_choice, self.choice_considered = None, True

    def _consider_plan_choice(self, profile_pending: bool, plan_choices: Callable[[], list]) -> None:
        """Once rank 0's profile is shared (and tuning is over), start measuring the plans worth comparing."""
        if profile_pending:
            return  # the profile is still to come: the same answer on every rank (it is broadcast)
        self.choice_considered = True
        choices = plan_choices()
        if not choices:
            return
        import dearopt.planning.tuner as tuning

        self.plan_choice = tuning.TuningController(
            tuning.ChoiceTuner([knobs for knobs, _ in choices], rematch=PLAN_CHOICE_REMATCH),
            warmup_steps=1,
            measure_steps=PLAN_CHOICE_STEPS,
            is_root=self.control.rank == 0,
            broadcast=self._broadcast,
        )

    @property
    def settled(self) -> bool:
        """Whether tuning and the measured choice are over (the same on every rank)."""
        if self.tuning is not None and not self.tuning.finished:
            return False
        return self.choice_considered and (self.plan_choice is None or self.plan_choice.finished)


def _sizes(knobs) -> Dict[str, int]:
    return {k: int(v) for k, v in knobs.items()}
