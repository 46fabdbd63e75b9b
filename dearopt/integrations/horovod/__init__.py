"""Horovod's PyTorch API on dearopt: ``import dearopt.integrations.horovod as hvd`` runs a Horovod script unchanged.

Every name of ``horovod.torch`` (0.28) is here; the ones dearopt does not
support raise :class:`NotImplementedError` saying what to use instead.  See
``docs/horovod.md`` for the table.
"""

import torch as _torch

import dearopt.integrations.horovod.elastic as elastic
from dearopt.integrations.horovod.compression import Compression, Compressor, FP16Compressor, NoneCompressor
from dearopt.integrations.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from dearopt.integrations.horovod.mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    HorovodJoinedError,
    HorovodMismatchError,
    HorovodNotInitializedError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from dearopt.integrations.horovod.optimizer import DistributedOptimizer


class SyncBatchNorm(_torch.nn.SyncBatchNorm):
    """``hvd.SyncBatchNorm``: torch's ``SyncBatchNorm`` over the process group dearopt set up (GPU only).

    Same arguments as ``nn.BatchNorm*d``.  Training on CPU tensors is not
    supported (torch's implementation needs a GPU); use ``nn.BatchNorm2d``
    there, whose statistics are per rank.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(
            num_features, eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats
        )

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        """Batch normalization over every rank's batch (torch's ``SyncBatchNorm``); refused on CPU tensors in training
        with more than one rank."""
        if self.training and input.device.type == "cpu" and is_initialized() and size() > 1:
            raise NotImplementedError(
                "hvd.SyncBatchNorm on CPU tensors is not supported by dearopt.integrations.horovod (torch's "
                "SyncBatchNorm needs a GPU); use torch.nn.BatchNorm2d (per-rank statistics) on CPU"
            )
        return super().forward(input)


# the public names (what the API reference and tests/test_docstrings.py cover); a new export is added here too
__all__ = [
    "elastic",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "NoneCompressor",
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "Adasum",
    "Average",
    "HorovodInternalError",
    "HorovodJoinedError",
    "HorovodMismatchError",
    "HorovodNotInitializedError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "DistributedOptimizer",
    "SyncBatchNorm",
]
