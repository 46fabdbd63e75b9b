"""dearopt: communication scheduling for data-parallel PyTorch training.

The public API::

    import dearopt
    dearopt.init()
    optimizer = dearopt.DistOptim(torch.optim.AdamW(model.parameters()), model)
"""

from dearopt.backends.base import CollectiveBackend, Handle, padded_numel
from dearopt.errors import (
    BackendUnavailableError,
    CheckpointMismatchError,
    CollectiveError,
    CollectiveTimeoutError,
    DearoptError,
    InternalError,
    LaunchEnvironmentError,
    NonFiniteGradientError,
    NotElementwiseError,
    NotInitializedError,
    PeerFailedError,
    PeerLostError,
    PlanMismatchError,
    StepMismatchError,
    UsageError,
)
from dearopt.collectives import (
    allreduce,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    check_same_model,
    no_sync,
)
from dearopt.backends.runtime import (
    get_backend,
    get_timeout,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

__version__ = "0.1.0"
import dearopt.schedules as schedules
import dearopt.checkpoint as checkpoint
from dearopt.compression.hooks import CommHook, bf16_compress, fp16_compress
from dearopt.optimizer import DistOptim
from dearopt.engine.options import Options
from dearopt.planning.plan import Plan, build_plan, parse_size
from dearopt.schedules import RSAG, WFBP, ByteScheduler, DeAR, DeFT, Prophet, ProphetAllReduce, Schedule
from dearopt.schedules.deft.schedule import Preserver
from dearopt.engine.sharding import register_elementwise
from dearopt.compression.sparsify import Sparsify
from dearopt.planning.tuner import BayesianTuner, ChoiceTuner, Knob, TuningController

# the public names (what the API reference and tests/test_docstrings.py cover); a new export is added here too
__all__ = [
    "CollectiveBackend",
    "Handle",
    "padded_numel",
    "BackendUnavailableError",
    "CheckpointMismatchError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DearoptError",
    "InternalError",
    "LaunchEnvironmentError",
    "NonFiniteGradientError",
    "NotElementwiseError",
    "NotInitializedError",
    "PeerFailedError",
    "PeerLostError",
    "PlanMismatchError",
    "StepMismatchError",
    "UsageError",
    "allreduce",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "check_same_model",
    "no_sync",
    "get_backend",
    "get_timeout",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
    "schedules",
    "CommHook",
    "bf16_compress",
    "fp16_compress",
    "DistOptim",
    "Options",
    "Plan",
    "build_plan",
    "parse_size",
    "Preserver",
    "register_elementwise",
    "Sparsify",
    "BayesianTuner",
    "ChoiceTuner",
    "Knob",
    "TuningController",
    "Schedule",
    "DeAR",
    "WFBP",
    "RSAG",
    "ByteScheduler",
    "Prophet",
    "ProphetAllReduce",
    "DeFT",
    "checkpoint",
]
