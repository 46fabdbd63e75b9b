"""Hugging Face's ``transformers.Trainer`` with :class:`dearopt.DistOptim` instead of DDP.

::

    from dearopt.integrations.transformers import DearTrainer

    trainer = DearTrainer(model=model, args=training_args, train_dataset=dataset, schedule="dear")
    trainer.train()                 # torchrun --nproc_per_node N train.py

``DearTrainer`` is a ``transformers.Trainer`` (every argument and method of Trainer's) that:

* keeps DDP out: Trainer prepares the model through ``accelerate``'s ``Accelerator.prepare``, which wraps it in
  ``DistributedDataParallel`` under torch.distributed; here the model is prepared as accelerate prepares it for
  evaluation (device placement, mixed-precision autocast, no DDP), so gradients are averaged once, by dearopt;
* wraps the optimizer (the one Trainer builds from ``TrainingArguments``, or the one passed as
  ``optimizers=(optimizer, scheduler)``) in a ``DistOptim`` on the model with the chosen schedule; the scheduler
  keeps working (the ``DistOptim`` shares the optimizer's ``param_groups``);
* runs the micro-batches of ``gradient_accumulation_steps`` before the last of each step inside the
  ``DistOptim``'s ``no_sync()``, as Trainer counts them (``accelerator.sync_gradients``, also for a shorter last
  step of an epoch); clips (``max_grad_norm``) and measures the logged ``grad_norm`` with
  ``DistOptim.clip_grad_norm_`` (the global norm of the averaged gradients);
* applies pending updates (``optimizer.synchronize()``) on every rank before Trainer saves, evaluates or returns
  from ``train()``, and takes ``optimizer.state_dict()`` on every rank (a collective under
  ``shard_optimizer=True``) for the checkpoint rank 0 writes; ``resume_from_checkpoint`` loads it on every rank.

``transformers`` and ``accelerate`` are optional dependencies: ``pip install dearopt[transformers]``.
``import dearopt`` never imports this module.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Optional, Union

import torch

try:
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dearopt.integrations.transformers needs transformers and accelerate, which could not be imported "
        f"({exc}); install them with: pip install dearopt[transformers]"
    ) from exc

import dearopt.backends.runtime as runtime
from dearopt.errors import UsageError
from dearopt.optimizer import DistOptim, _refuse_data_parallel_wrapper
from dearopt.schedules import Schedule

__all__ = ["DearTrainer", "DearTrainerMixin"]

_DISTOPTIM_KWARGS = frozenset(
    name
    for name, parameter in inspect.signature(DistOptim.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "schedule"
)
"""The keyword arguments of ``DistOptim`` that ``distoptim_kwargs`` may hold (``schedule`` is an argument of its
own)."""

_REFUSED_TYPES = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.XLA: "XLA (TPU)",
    DistributedType.MEGATRON_LM: "Megatron-LM",
}
"""accelerate's distributed types that reduce gradients (or shard the model) themselves."""


def _distoptim_of(optimizer: Any) -> Optional[DistOptim]:
    """The ``DistOptim`` behind ``optimizer`` (itself, or inside accelerate's ``AcceleratedOptimizer``), or None."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, DistOptim) else None


def _prepare_without_ddp(original):
    """accelerate's ``prepare_model`` (``original``) with ``evaluation_mode=True``: device placement,
    mixed-precision autocast and ``torch.compile`` as configured, but no ``DistributedDataParallel``."""

    def prepare_model(model: torch.nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        return original(model, device_placement=device_placement, evaluation_mode=True)

    prepare_model.dearopt_without_ddp = True
    return prepare_model


class DearTrainerMixin:
    """The part of :class:`DearTrainer` that makes a ``transformers.Trainer`` (or a subclass of it, listed after
    this mixin: ``class MyTrainer(DearTrainerMixin, SomeTrainer)``) train with a ``DistOptim``.

    Args:
        *args: ``transformers.Trainer``'s positional arguments (``model``, ``args``, ...).
        schedule: the ``DistOptim`` schedule: a schedule object (:class:`dearopt.DeAR`, :class:`dearopt.WFBP`,
            ...) or its name (``"dear"``, the default, ``"wfbp"``, ``"rsag"``, ``"bytescheduler"``, ``"prophet"``,
            ``"prophet-allreduce"``, ``"deft"``).
        distoptim_kwargs: passed to the ``DistOptim`` (``shard_optimizer``, ``buffer_size``, ``comm_hook``,
            ``nonfinite``, ``checks``, ...); an unknown name is a ``TypeError`` at once.  They must be left out
            when the optimizer passed in ``optimizers=`` is already a ``DistOptim`` (a ``UsageError``).
        backend: dearopt's backend for :func:`dearopt.init` when it has not been called yet (``"gloo"`` on CPU,
            ``"nccl"`` on GPUs by default, or ``"nccl-native"``); dearopt adopts the process group that
            Trainer's accelerate state has set up.
        **kwargs: ``transformers.Trainer``'s keyword arguments.
    """

    def __init__(
        self,
        *args: Any,
        schedule: Union[str, Schedule] = "dear",
        distoptim_kwargs: Optional[Dict[str, Any]] = None,
        backend: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        distoptim_kwargs = dict(distoptim_kwargs or {})
        unknown = sorted(set(distoptim_kwargs) - _DISTOPTIM_KWARGS)
        if unknown:
            raise TypeError(
                f"DearTrainer got unexpected DistOptim keyword argument(s) {unknown} in distoptim_kwargs; "
                f"DistOptim takes {sorted(_DISTOPTIM_KWARGS)} (and the schedule, as schedule=)"
            )
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, torch.nn.Module):
            _refuse_data_parallel_wrapper(model)  # before Trainer unwraps it or accelerate starts up
        self.dearopt_schedule = schedule
        self.distoptim_kwargs: Dict[str, Any] = distoptim_kwargs
        self._dearopt_backend = backend
        self._distoptim: Optional[DistOptim] = None
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self._join_dearopt()

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, whose ``prepare_model`` prepares the model as for evaluation: Trainer prepares it
        with ``accelerator.prepare(model, optimizer)``, and so it gets its device and mixed-precision autocast but
        no ``DistributedDataParallel``."""
        super().create_accelerator_and_postprocess()
        self.accelerator.prepare_model = _prepare_without_ddp(self.accelerator.prepare_model)

    def _refuse_unsupported(self) -> None:
        """Trainer modes in which something other than dearopt reduces the gradients or shards the model."""
        refused = []
        distributed_type = self.accelerator.distributed_type
        if distributed_type in _REFUSED_TYPES:
            refused.append(f"accelerate's {_REFUSED_TYPES[distributed_type]} mode")
        if getattr(self, "is_deepspeed_enabled", False) or self.args.deepspeed:
            refused.append("DeepSpeed (deepspeed=...)")
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_fsdp_xla_enabled", False) or self.args.fsdp:
            refused.append("FSDP (fsdp=...)")
        if getattr(self, "is_distributed_loading_by_transformers", False):
            refused.append("a model sharded at load time (from_pretrained(distributed_config=...))")
        if getattr(self.args, "parallelism_config", None) is not None:
            refused.append("parallelism_config (tensor, context or sequence parallelism)")
        if self.args.n_gpu > 1:
            refused.append(
                f"torch.nn.DataParallel over the {self.args.n_gpu} GPUs this process sees (launch one process per "
                f"GPU with torchrun instead)"
            )
        if self.args.torch_compile:
            refused.append("torch_compile=True (dearopt follows the model's forward through module hooks)")
        if refused:
            raise UsageError(
                "DearTrainer trains with dearopt.DistOptim, which averages the gradients itself; it does not "
                "support " + "; ".join(refused)
            )

    def _join_dearopt(self) -> None:
        """:func:`dearopt.init` on the process group Trainer's accelerate state has set up (unless already done)."""
        if not runtime.is_initialized():
            backend = self._dearopt_backend
            if backend is None:
                backend = "gloo" if self.args.device.type == "cpu" else "nccl"
            runtime.init(backend=backend)
        world, rank = self.args.world_size, self.args.process_index
        if runtime.size() != world or runtime.rank() != rank:
            raise UsageError(
                f"dearopt.init() found rank {runtime.rank()} of {runtime.size()}, but Trainer runs as rank {rank} of "
                f"{world}: launch with torchrun (or accelerate launch) and call dearopt.init() in the same job"
            )

    @property
    def distoptim(self) -> Optional[DistOptim]:
        """The ``DistOptim`` the trainer steps (built by :meth:`create_optimizer`; None before ``train()``)."""
        return self._distoptim

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        """Trainer's optimizer (from ``TrainingArguments``, or the one passed in ``optimizers=``), wrapped in a
        ``DistOptim`` on the model with the trainer's schedule; one that is already a ``DistOptim`` is kept."""
        if self._distoptim is not None and _distoptim_of(self.optimizer) is self._distoptim:
            self.optimizer = self._distoptim  # a later train(): accelerate wraps it again
            return self.optimizer
        if self._distoptim is not None:  # a new model (model_init) or optimizer: release the old DistOptim
            self.close()
        optimizer = super().create_optimizer(model)
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        if isinstance(optimizer, DistOptim):
            if self.distoptim_kwargs:
                raise UsageError(
                    "the optimizer passed to DearTrainer is already a dearopt.DistOptim, so distoptim_kwargs "
                    "would be ignored: pass the plain torch optimizer (DearTrainer wraps it), or no distoptim_kwargs"
                )
            dist = optimizer
        else:
            dist = DistOptim(optimizer, self.model, schedule=self.dearopt_schedule, **self.distoptim_kwargs)
        self._distoptim = dist
        self.optimizer = dist
        return dist

    # ------------------------------------------------------------------ the training step
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Trainer's training step; a micro-batch after which Trainer does not step the optimizer (all but the
        last of ``gradient_accumulation_steps``) runs inside the ``DistOptim``'s ``no_sync()``."""
        dist = self._distoptim
        if dist is None or self.accelerator.sync_gradients:
            return super().training_step(*args, **kwargs)
        with dist.no_sync():
            return super().training_step(*args, **kwargs)

    def _unscale_gradients(self, dist: DistOptim) -> None:
        """fp16: the loss scaler's unscale on the averaged gradients (every rank finds the same inf/NaN)."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            dist.unscale_(scaler)

    def _clip_grad_norm(self, model: torch.nn.Module):
        """``max_grad_norm``: ``DistOptim.clip_grad_norm_``, the global norm of the averaged gradients."""
        dist = self._distoptim
        if dist is None:
            return super()._clip_grad_norm(model)
        self._unscale_gradients(dist)
        return dist.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        """The logged ``grad_norm`` when nothing was clipped: measured by the ``DistOptim`` (reading ``p.grad``
        would finish the communication of every bucket at once)."""
        dist = self._distoptim
        if dist is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        self._unscale_gradients(dist)
        return dist.clip_grad_norm_(float("inf"))

    # ------------------------------------------------------------------ parameters current before use
    def _synchronize(self) -> None:
        """Apply pending updates: on every rank (under ``dear`` and the sharded update it is a collective)."""
        if self._distoptim is not None:
            self._distoptim.synchronize()

    def train(self, *args: Any, **kwargs: Any):
        """Trainer's ``train()``; when it returns, the pending updates are applied (the model holds its final
        parameters on every rank)."""
        output = super().train(*args, **kwargs)
        self._synchronize()
        return output

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """Apply pending updates (every rank evaluates), then Trainer's evaluation / prediction loop."""
        self._synchronize()
        return super().evaluation_loop(*args, **kwargs)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Apply pending updates, then Trainer's ``save_model`` (rank 0 writes): call it on every rank."""
        self._synchronize()
        return super().save_model(output_dir, _internal_call=_internal_call)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Apply pending updates on every rank, then Trainer's checkpoint."""
        self._synchronize()
        return super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer's ``state_dict()`` taken on every rank (gathered under ``shard_optimizer=True``: a
        collective), written with the scheduler's by the rank that saves, where Trainer writes them."""
        dist = self._distoptim
        if dist is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        state = dist.state_dict()
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            if self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Apply pending updates and release the ``DistOptim`` (its hooks on the model and its communicator);
        a later ``train()`` builds a new one.  Call it on every rank."""
        dist, self._distoptim = self._distoptim, None
        if dist is None:
            return
        dist.close()
        if _distoptim_of(self.optimizer) is dist:
            self.optimizer = None  # Trainer builds (and DearTrainer wraps) a new one


class DearTrainer(DearTrainerMixin, transformers.Trainer):
    """A ``transformers.Trainer`` that trains with :class:`dearopt.DistOptim` (any schedule) instead of DDP.

    Every argument of ``transformers.Trainer`` works as there; ``schedule``, ``distoptim_kwargs`` and ``backend``
    are those of :class:`DearTrainerMixin`.  Launch as any Trainer script: ``torchrun --nproc_per_node N
    train.py``; in a single process (``python train.py``) it trains alone, as Trainer does.
    """
