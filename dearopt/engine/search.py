"""The plan's knobs searched while training, at step boundaries.

:class:`PlanSearch` is ``DistOptim``'s part that outlives every plan: the
online tuner of the knobs set to ``"auto"`` (DeAR section IV.B), then the
measured choice of ``dear``'s all-reduced buckets (``allreduce="auto"``),
then DDP's plan where the loop reads ``p.grad`` before every ``step()``.  Every
decision is rank 0's, broadcast, and taken at a step boundary on every rank,
so the plans stay identical.
"""

from __future__ import annotations


import dearopt.collectives as functions

__all__ = ["PlanSearch", "PLAN_CHOICE_STEPS", "PLAN_CHOICE_REMATCH"]

PLAN_CHOICE_STEPS = 3
"""Steps measured per candidate plan of ``allreduce="auto"`` (after one discarded step that re-plans)."""

PLAN_CHOICE_REMATCH = 0.10
"""Candidate plans of ``allreduce="auto"`` within this fraction of the fastest are measured once more, in the
reverse order, and judged by the mean of their two trials (:class:`dearopt.planning.tuner.ChoiceTuner`)."""


class PlanSearch:
    """The tuner and the measured choice of one engine (see the module)."""

    def __init__(self, executor, tuner):
        self.executor = executor
        self.plan_choice = None
        self.choice_considered = False
        self.generation = 0  # the planner's generation this search has seen
        self.tuning = self._make_tuning(tuner)

    def _make_tuning(self, tuner):
        """The online tuner of the knobs set to "auto"; None when nothing is tuned."""
        import dearopt.planning.tuner as tuning  # bayes_opt is imported only when a tuner is built

        e = self.executor
        auto = [k for k in ("buffer_size", "partition_size", "credit") if getattr(e.options, k) == "auto"]
        if tuner is None and not auto:
            return None
        if tuner is None:
            model_bytes = sum(p.numel() * p.element_size() for g in e.optimizer.param_groups for p in g["params"])
            mb = tuning.MB
            knobs = []
            if "buffer_size" in auto:
                high = min(100 * mb, max(model_bytes, 2 * mb))
                initial = min(25 * mb, high)
                if e.options.profile is not None:  # start where the simulator predicts the optimum
                    import dearopt.sim as sim

                    grid = [int(mb * 2 ** (i / 2)) for i in range(0, 15) if mb * 2 ** (i / 2) <= high]
                    initial = sim.best_buffer_size(e.options.profile, e.options.schedule, grid, ranks=e.world)
                knobs.append(tuning.buffer_size_knob(high=high, initial=initial))
            if "partition_size" in auto:
                knobs.append(tuning.Knob("partition_size", 256 * 1024, 16 * mb, log=True, initial=4 * mb, integer=True))
            if "credit" in auto:
                knobs.append(tuning.Knob("credit", 1 * mb, 64 * mb, log=True, initial=16 * mb, integer=True))
            tuner = tuning.BayesianTuner(knobs, budget=10 if len(knobs) == 1 else 20, steps_per_trial=10)
        if not isinstance(tuner, tuning.BayesianTuner):
            raise TypeError(f"tuner must be a dearopt.planning.tuner.BayesianTuner, got {type(tuner).__name__}")
        control = e.control
        controller = tuning.TuningController(
            tuner,
            warmup_steps=1,
            measure_steps=tuner.steps_per_trial,
            is_root=control.rank == 0,
            broadcast=lambda decision: functions.broadcast_object(decision, 0, backend=control),
        )
        self._apply(controller.current)
        return controller

    def _apply(self, knobs) -> None:
        self.executor.replan(**{k: int(v) for k, v in knobs.items()})

    def notice_new_inputs(self) -> None:
        """The trainable set or the groups changed (noticed at a backward, on every rank): the measured choice and
        a tuning trial under way were measured on the old set; measure again."""
        generation = self.executor.planner.generation
        if generation == self.generation:
            return
        self.generation = generation
        self.plan_choice, self.choice_considered = None, False
        if self.tuning is not None and not self.tuning.finished:
            self.tuning.restart_trial()

    def step_ended(self) -> None:
        """At every ``step()``'s end, on every rank: the next trial, the next candidate plan, or DDP's plan."""
        e = self.executor
        if self.tuning is not None and not self.tuning.finished:
            knobs = self.tuning.on_step_end()
            if knobs:
                self._apply(knobs)  # every rank, at the same step boundary
        elif not self.choice_considered:
            self._consider_plan_choice()
        elif self.plan_choice is not None and not self.plan_choice.finished:
            knobs = self.plan_choice.on_step_end()
            if knobs:  # every rank, at the same step boundary
                e.replan(allreduce=knobs["allreduce"], blocks=knobs.get("blocks", False))
        if e.adapt_to_gradient_reads():  # the loop reads p.grad before every step(): DDP's plan
            self.plan_choice, self.choice_considered = None, True

    def _consider_plan_choice(self) -> None:
        """Once rank 0's profile is shared (and tuning is over), start measuring the plans worth comparing."""
        e = self.executor
        if e.profile.enabled and e.profile.result is None:
            return  # the profile is still to come: the same answer on every rank (it is broadcast)
        self.choice_considered = True
        choices = e.plan_choices()
        if not choices:
            return
        import dearopt.planning.tuner as tuning

        control = e.control
        self.plan_choice = tuning.TuningController(
            tuning.ChoiceTuner([knobs for knobs, _ in choices], rematch=PLAN_CHOICE_REMATCH),
            warmup_steps=1,
            measure_steps=PLAN_CHOICE_STEPS,
            is_root=control.rank == 0,
            broadcast=lambda decision: functions.broadcast_object(decision, 0, backend=control),
        )

    @property
    def settled(self) -> bool:
        """Whether tuning and the measured choice are over (the same on every rank)."""
        if self.tuning is not None and not self.tuning.finished:
            return False
        return self.choice_considered and (self.plan_choice is None or self.plan_choice.finished)
