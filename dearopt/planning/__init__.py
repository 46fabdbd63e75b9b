"""Planning: pure functions from a profile and knobs to a plan (buckets, ordered ops with their moments), the
profile and the tuner."""

from dearopt.planning.plan import Plan, parse_size

from dearopt.planning.build import build_plan
from dearopt.planning.tuner import BayesianTuner, ChoiceTuner, Knob, TuningController

__all__ = ["Plan", "build_plan", "parse_size", "BayesianTuner", "ChoiceTuner", "Knob", "TuningController"]
