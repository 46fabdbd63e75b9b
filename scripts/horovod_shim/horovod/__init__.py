"""A stand-in ``horovod`` package whose ``horovod.torch`` is ``dearopt.integrations.horovod``.

Used by ``scripts/horovod_suite`` to run Horovod's own test suite against
dearopt; not installed with the library.
"""

import sys

import dearopt.integrations.horovod as torch  # noqa: F401  (``import horovod.torch as hvd``)

sys.modules[__name__ + ".torch"] = torch
