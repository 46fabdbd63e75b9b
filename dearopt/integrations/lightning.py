"""A Lightning strategy that trains with :class:`dearopt.DistOptim` instead of DDP.

::

    import lightning as L
    import dearopt.integrations.lightning

    strategy = dearopt.integrations.lightning.DearStrategy(schedule="dear")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2)
    trainer.fit(model)          # a LightningModule, unchanged

What it does (see ``docs/lightning.md``):

* processes are launched and ``torch.distributed`` is set up as by Lightning's ``DDPStrategy`` (its own
  launcher for ``devices=N``, or torchrun / Slurm / any environment Lightning detects); then
  :func:`dearopt.init` adopts that process group;
* the LightningModule is not wrapped in DDP: every optimizer from ``configure_optimizers`` is wrapped in a
  ``DistOptim`` (one each; LR schedulers keep working, the ``DistOptim`` shares ``param_groups`` with the
  optimizer they were built on).  Each ``training_step`` runs as the forward of a thin module around the
  LightningModule (the ``model`` the ``DistOptim`` is built on), so dearopt sees one training forward per step
  whatever ``training_step`` calls;
* Lightning's gradient clipping (``gradient_clip_val``, ``gradient_clip_algorithm``) goes to
  ``DistOptim.clip_grad_norm_`` / ``clip_grad_value_`` (exact on the averaged gradients; keeps DeAR's
  overlap), loss scaling (``"16-mixed"``) to ``DistOptim.unscale_`` and ``GradScaler.step``;
* the non-final micro-batches of ``accumulate_grad_batches`` run inside :func:`dearopt.no_sync`;
* checkpoints hold ``DistOptim.state_dict()``: torch's ordinary layout, gathered on every rank under
  ``shard_optimizer=True`` (a collective; Lightning builds a checkpoint on every rank and writes it on rank 0),
  so ``fit(ckpt_path=...)`` resumes, also into DDP or a single process.

Lightning is an optional dependency: ``pip install dearopt[lightning]``.  ``import dearopt`` never imports it.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Union

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities.types import STEP_OUTPUT
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dearopt.integrations.lightning needs Lightning (the 'lightning' package, lightning.pytorch), which could "
        f"not be imported ({exc}); install it with: pip install dearopt[lightning]"
    ) from exc

import dearopt.backends.runtime as runtime
from dearopt.errors import UsageError
from dearopt.collectives import no_sync
from dearopt.optimizer import DistOptim
from dearopt.schedules import get_schedule

__all__ = ["DearStrategy"]

_DISTOPTIM_KWARGS = frozenset(
    name
    for name, parameter in inspect.signature(DistOptim.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
)
"""The keyword arguments of ``DistOptim`` that ``DearStrategy(**distoptim_kwargs)`` passes on."""

_STEPS_WE_DRIVE = (Precision.optimizer_step, MixedPrecision.optimizer_step)
"""Precision plugins whose ``optimizer_step`` the strategy carries out itself for a ``DistOptim`` (32-true,
64-true, 16-true, bf16-true, 16-mixed, bf16-mixed): their step is ``closure(); [unscale]; clip; step``."""

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class _TrainingForward(torch.nn.Module):
    """The module a ``DistOptim`` is built on: its forward is the LightningModule's ``training_step``.

    dearopt's engine follows training forwards through the forward hooks of the model it is given; Lightning
    calls ``training_step`` directly, which need not call the LightningModule's ``forward`` (or may call it
    several times).  Routing each step through this module's ``__call__`` gives the engine exactly one training
    forward per ``training_step``, around the whole of it (loss included)."""

    def __init__(self, module: "pl.LightningModule") -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.training_step(*args, **kwargs)


def _distoptim(optimizer: Any) -> Optional[DistOptim]:
    """The ``DistOptim`` behind ``optimizer`` (itself, or inside a ``LightningOptimizer``), or None."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    return optimizer if isinstance(optimizer, DistOptim) else None


@contextlib.contextmanager
def _launch_environment(rank: int, world_size: int, local_rank: int, local_size: int):
    """torchrun's variables describing this process as Lightning placed it, while :func:`dearopt.init` reads them.

    Lightning's own launcher sets ``WORLD_SIZE`` and ``LOCAL_RANK`` but not ``RANK`` (the rank comes from its
    cluster environment), which dearopt would read as an incomplete torchrun environment; the variables are
    restored afterwards."""
    saved = {name: os.environ.get(name) for name in _LAUNCH_VARS}
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size),
        }
    )
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class DearStrategy(DDPStrategy):
    """Train a ``LightningModule`` with :class:`dearopt.DistOptim` (any schedule) instead of DDP.

    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
    ``process_group_backend`` and ``start_method`` are as for Lightning's ``DDPStrategy`` (``start_method="popen"``,
    the default, re-runs the script for each device; ``"spawn"``/``"fork"``/``"forkserver"`` start workers from this
    process).

    Args:
        schedule: the ``DistOptim`` schedule (``"dear"``, ``"wfbp"``, ``"rsag"``, ``"bytescheduler"``,
            ``"prophet"``, ``"prophet-allreduce"``, ``"deft"``).
        backend: dearopt's backend for :func:`dearopt.init` (``"gloo"``, ``"nccl"``, ``"nccl-native"``); default
            ``"gloo"`` on CPU, ``"nccl"`` on GPUs, the process group's own (``process_group_backend``).
        timeout: how long any collective may wait: dearopt's timeout (seconds or a ``timedelta``) and the
            process group's; default: dearopt's (``DEAROPT_TIMEOUT`` or 300 s) and Lightning's.
        **distoptim_kwargs: passed to every ``DistOptim`` (``shard_optimizer``, ``buffer_size``, ``allreduce``,
            ``comm_hook``, ``nonfinite``, ...); an unknown name is a ``TypeError`` here.
    """

    def __init__(
        self,
        schedule: str = "dear",
        *,
        backend: Optional[str] = None,
        timeout: Union[float, datetime.timedelta, None] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
        **distoptim_kwargs: Any,
    ) -> None:
        unknown = sorted(set(distoptim_kwargs) - _DISTOPTIM_KWARGS)
        if unknown:
            raise TypeError(
                f"DearStrategy got unexpected keyword argument(s) {unknown}: it takes Lightning's "
                f"strategy arguments and those of dearopt.DistOptim ({sorted(_DISTOPTIM_KWARGS)})"
            )
        ddp_timeout = {}
        if timeout is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            ddp_timeout["timeout"] = datetime.timedelta(seconds=seconds)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **ddp_timeout,
        )
        self._ddp_kwargs = {}  # no DistributedDataParallel is built
        self.schedule = schedule
        self.distoptim_kwargs: Dict[str, Any] = dict(distoptim_kwargs)
        self._dearopt_backend = backend
        self._dearopt_timeout = (
            None
            if timeout is None
            else (timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        )
        self._training_forward: Optional[_TrainingForward] = None
        self._distoptims: List[DistOptim] = []
        self._module_hooks: list = []
        self._routed_plugin = None
        self._failed = False

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """DDPStrategy registers its names ("ddp", ...) for the class it is called on: not for this one."""

    # ------------------------------------------------------------------ processes
    def setup_distributed(self) -> None:
        """Lightning's process group (as ``DDPStrategy`` makes it, or the one already there), then
        :func:`dearopt.init` on it."""
        super().setup_distributed()
        if runtime.is_initialized():
            return
        backend = self._dearopt_backend
        if backend is None:
            backend = "gloo" if self.root_device.type == "cpu" else "nccl"
        with _launch_environment(self.global_rank, self.world_size, self.local_rank, self.num_processes):
            runtime.init(backend=backend, timeout=self._dearopt_timeout)
        if runtime.size() != self.world_size or runtime.rank() != self.global_rank:
            raise UsageError(
                f"dearopt.init() found rank {runtime.rank()} of {runtime.size()}, but Lightning "
                f"placed this process as rank {self.global_rank} of {self.world_size}: "
                f"call dearopt.shutdown() before this Trainer, or init() in the same job"
            )

    # ------------------------------------------------------------------ model and optimizers
    def configure_ddp(self) -> None:
        """No DistributedDataParallel: the ``DistOptim`` objects do the communication."""

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """``configure_optimizers``' optimizers, each wrapped in a ``DistOptim`` on the LightningModule."""
        self._close_distoptims()
        self._failed = False
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise UsageError(
                "DearStrategy supports automatic optimization only (automatic_optimization=True): "
                "under manual optimization backward() and step() run inside training_step, which "
                "dearopt follows as the training forward"
            )
        super().setup_optimizers(trainer)
        self._training_forward = _TrainingForward(module)
        wrapped = []
        for optimizer in self.optimizers:
            if isinstance(optimizer, DistOptim):
                raise UsageError(
                    "configure_optimizers() returned a dearopt.DistOptim: return the plain torch "
                    "optimizer, DearStrategy wraps it"
                )
            wrapped.append(
                DistOptim(optimizer, self._training_forward, schedule=self.schedule, **self.distoptim_kwargs)
            )
        self._distoptims = wrapped
        self.optimizers = wrapped
        # model.state_dict() / load_state_dict() apply the pending updates first (dearopt does this for the
        # model it was given, here the training forward around the LightningModule)
        self._module_hooks = [
            module.register_state_dict_pre_hook(self._synchronize_hook),
            module.register_load_state_dict_pre_hook(self._synchronize_hook),
        ]

    def setup_precision_plugin(self) -> None:
        """Lightning's setup, then its gradient clipping routed to each ``DistOptim``'s own clip."""
        super().setup_precision_plugin()
        if self._distoptims:
            self._route_precision_plugin()

    def _route_precision_plugin(self) -> None:
        """Lightning clips through ``trainer.precision_plugin.clip_gradients(optimizer, ...)`` (from
        ``LightningModule.configure_gradient_clipping``): for a ``DistOptim`` it becomes the ``DistOptim``'s own
        clip, on this plugin instance (undone at teardown)."""
        plugin = self.precision_plugin
        if type(plugin).optimizer_step not in _STEPS_WE_DRIVE:
            raise UsageError(
                f"DearStrategy does not support the precision plugin {type(plugin).__name__}: it "
                f"supports Lightning's Precision, MixedPrecision, HalfPrecision and DoublePrecision "
                f"(precision='32-true', '64-true', '16-true', 'bf16-true', '16-mixed', 'bf16-mixed')"
            )
        original = plugin.clip_gradients

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm="norm"):
            dist = _distoptim(optimizer)
            if dist is None:
                return original(optimizer, clip_val, gradient_clip_algorithm)
            if clip_val is None or clip_val <= 0:
                return None
            if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
                dist.clip_grad_value_(clip_val)
            else:
                dist.clip_grad_norm_(clip_val)
            return None

        plugin.clip_gradients = clip_gradients
        self._routed_plugin = plugin

    def _unroute_precision_plugin(self) -> None:
        plugin, self._routed_plugin = self._routed_plugin, None
        if plugin is not None:
            plugin.__dict__.pop("clip_gradients", None)

    # ------------------------------------------------------------------ the training step
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """``training_step`` as the forward of the module the ``DistOptim`` objects are built on."""
        if self._training_forward is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self._training_forward(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Apply pending updates, then Lightning's validation step."""
        self._synchronize()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Apply pending updates, then Lightning's test step."""
        self._synchronize()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Apply pending updates, then Lightning's predict step."""
        self._synchronize()
        return super().predict_step(*args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Accumulation: the backward passes inside keep their gradients local (:func:`dearopt.no_sync`)."""
        if self._training_forward is None or not self._distoptims:
            yield None
            return
        with no_sync(self._training_forward):
            yield None

    def optimizer_step(
        self,
        optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """The precision plugin's step for a ``DistOptim``: run the closure (forward and backward), unscale
        (16-mixed), Lightning's ``on_before_optimizer_step`` hooks and clipping, then ``DistOptim.step()``
        (which takes no closure)."""
        dist = _distoptim(optimizer)
        if dist is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning skipped backward, so there is nothing to reduce, clip or apply
            # (every rank must skip alike, or their steps disagree: dearopt's StepMismatchError)
            return closure_result
        delays = get_schedule(self.schedule).delays_updates
        if isinstance(closure_result, torch.Tensor) and "loss" not in kwargs and delays:
            kwargs["loss"] = closure_result  # deft's Preserver reads the training loss of the first steps
        if scaler is not None:
            dist.unscale_(scaler)  # the averaged gradients, before the hooks and clipping see them
        plugin._after_closure(model, optimizer)
        if scaler is not None:
            scaler.step(dist, **kwargs)  # skipped on every rank alike on inf/NaN
            scaler.update()
        else:
            dist.step(**kwargs)
        # LR schedulers built on the wrapped optimizer check that it stepped before them; under dear its updates
        # land in the next forward, after the scheduler's step(): the step was taken, say so
        dist.optimizer._opt_called = True
        return closure_result

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        """``DistOptim.state_dict()``: torch's ordinary layout.  Under ``shard_optimizer=True`` a collective:
        Lightning builds a checkpoint (``dump_checkpoint``) on every rank and writes rank 0's, so every rank
        gathers it here."""
        dist = _distoptim(optimizer)
        if dist is None:
            return super().optimizer_state(optimizer)
        return dist.state_dict()

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Apply pending updates, then the module's state dict (for a checkpoint)."""
        self._synchronize()
        return super().lightning_module_state_dict()

    # ------------------------------------------------------------------ life cycle
    def _synchronize(self) -> None:
        for dist in self._distoptims:
            dist.synchronize()

    def _synchronize_hook(self, *args: Any, **kwargs: Any) -> None:
        self._synchronize()

    def _close_distoptims(self) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []
        distoptims, self._distoptims = self._distoptims, []
        for dist in distoptims:
            dist.close()
        self._training_forward = None

    def close(self) -> None:
        """Apply pending updates and release the ``DistOptim`` objects (their hooks and communicators).

        ``teardown`` (the end of ``fit``) applies the pending updates but keeps them, so that
        ``trainer.save_checkpoint(...)`` after ``fit`` still holds the optimizer state; the next ``fit`` (or
        this call) closes them."""
        self._close_distoptims()

    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure (so ``teardown`` applies no pending update), then Lightning's handling."""
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Undo the clipping route, apply pending updates unless the run failed, then Lightning's teardown."""
        self._unroute_precision_plugin()
        if not self._failed:
            self._synchronize()  # the model holds its final parameters when fit() returns
        super().teardown()
