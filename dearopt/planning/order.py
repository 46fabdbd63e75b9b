"""Parameters in forward execution order: what the planner plans from.

The order in which modules first run in a forward pass is recorded with
forward pre-hooks (:class:`ForwardOrderRecorder` inside the executor,
:func:`record_forward_order` for one-off uses such as the benchmark).  A
parameter belongs to the first module that runs it; parameters no recorded
module owns follow in ``model.parameters()`` order.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

from dearopt.planning.plan import ParamSpec

__all__ = ["ForwardOrderRecorder", "record_forward_order", "parameters_in_forward_order", "param_specs"]


class ForwardOrderRecorder:
    """Collects modules in the order they first run while recording is on."""

    def __init__(self):
        self.modules: Optional[List[torch.nn.Module]] = None
        self._seen = set()

    @property
    def recording(self) -> bool:
        return self.modules is not None

    def start(self) -> None:
        self.modules, self._seen = [], set()

    def saw(self, module: torch.nn.Module) -> None:
        if self.modules is not None and id(module) not in self._seen:
            self._seen.add(id(module))
            self.modules.append(module)

    def stop(self) -> List[torch.nn.Module]:
        modules, self.modules, self._seen = self.modules or [], None, set()
        return modules


def record_forward_order(model: torch.nn.Module, run: Callable[[], object]) -> List[torch.nn.Module]:
    """The modules of ``model`` in the order they first run during ``run()`` (hooks removed afterwards)."""
    recorder = ForwardOrderRecorder()
    recorder.start()
    hooks = [m.register_forward_pre_hook(lambda module, args: recorder.saw(module)) for m in model.modules()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return recorder.stop()


def parameters_in_forward_order(
    model: torch.nn.Module,
    modules: Sequence[torch.nn.Module],
    include: Iterable[torch.nn.Parameter],
    extra: Optional[Dict[int, List[torch.Tensor]]] = None,
) -> List[torch.nn.Parameter]:
    """The parameters in ``include``, ordered by the first of ``modules`` that owns them, then by the model.

    ``extra`` maps ``id(module)`` to tensors that stand for that module's use of
    a shared weight (twins, :mod:`dearopt.engine.tied`): they take that module's place.
    """
    wanted = {id(p) for p in include}
    extra = extra or {}
    ordered, seen = [], set()
    for module in list(modules) + [model]:
        # (a recorded module's own: its _parameters, what parameters(recurse=False) yields, without torch's five
        # calls per module on every re-plan)
        own = module.parameters() if module is model else (p for p in module._parameters.values() if p is not None)
        params = list(own) + list(extra.get(id(module), ()))
        for p in params:
            if id(p) in wanted and id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
    for twins in extra.values():  # modules the recorded forward did not run
        for p in twins:
            if id(p) in wanted and id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
    return ordered


def param_specs(params: Sequence[torch.nn.Parameter], names: Dict[int, str]) -> List[ParamSpec]:
    """What the planner needs of each parameter; ``names`` maps ``id(p)`` to its name."""
    return [
        ParamSpec(names.get(id(p), f"param{i}"), p.numel(), str(p.dtype).replace("torch.", ""), p.element_size())
        for i, p in enumerate(params)
    ]
