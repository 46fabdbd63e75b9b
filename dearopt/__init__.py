"""dearopt: communication scheduling for data-parallel PyTorch training.

The public API::

    import dearopt
    dearopt.init()
    optimizer = dearopt.DistOptim(torch.optim.AdamW(model.parameters()), model)
"""

from dearopt.errors import CollectiveTimeoutError, DearoptError, PeerLostError, UsageError
from dearopt.collectives import broadcast_object, broadcast_optimizer_state, broadcast_parameters, no_sync
from dearopt.backends.runtime import init, is_initialized, local_rank, local_size, rank, shutdown, size

__version__ = "0.1.0"
import dearopt.backends as backends  # noqa: F401  (subpackages reached as dearopt.backends, ...)
import dearopt.planning as planning  # noqa: F401
import dearopt.errors as errors  # noqa: F401
import dearopt.collectives as collectives  # noqa: F401
import dearopt.schedules as schedules
import dearopt.checkpoint as checkpoint
from dearopt.compression.hooks import CommHook, bf16_compress, fp16_compress
from dearopt.optimizer import DistOptim
from dearopt.engine.options import Options
from dearopt.schedules import RSAG, WFBP, ByteScheduler, DeAR, DeFT, Prophet
from dearopt.engine.sharding import register_elementwise
from dearopt.compression.sparsify import Sparsify

# The public names (what the API reference and tests/test_docstrings.py cover), a user's screen: the runtime, the
# optimizer and its options, the schedules, the comm hooks, the helpers a training script calls and the errors a
# script catches.  The rest lives in its subpackage: dearopt.errors (every error), dearopt.backends (the collective
# interface), dearopt.planning (plans and tuners), dearopt.schedules (the registry, Schedule, Preserver),
# dearopt.collectives (allreduce, check_same_model).  A new export is added here too.
__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "DistOptim",
    "Options",
    "schedules",
    "DeAR",
    "WFBP",
    "RSAG",
    "ByteScheduler",
    "Prophet",
    "DeFT",
    "CommHook",
    "Sparsify",
    "bf16_compress",
    "fp16_compress",
    "register_elementwise",
    "no_sync",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "checkpoint",
    "DearoptError",
    "UsageError",
    "PeerLostError",
    "CollectiveTimeoutError",
]

# The reference and reprs show where a public class is imported from, not the module that defines it (as torch does).
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and _obj.__module__.startswith("dearopt."):
        _obj.__module__ = "dearopt"
del _name, _obj
