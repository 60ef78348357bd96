"""Diagonal Fisher, the plan of a batch: which module computes which parameter's
per-example gradient, and the hooks that record every call of those modules (inputs,
output, and whether they were changed in place afterwards) while a batch runs.

A parameter that no module's calls can give exactly is left to the per-example loop
(:data:`FisherPlan.loop`); :mod:`lmdx.stats.fisher` describes the method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._tensors import is_tensor

__all__ = ["FisherPlan", "ModuleCall", "module_kind"]


def module_kind(module: Any) -> str | None:
    """How a module's own parameters get per-example gradients, or None (per-example loop)."""
    import torch

    cls = type(module)
    if cls is torch.nn.Linear:
        return "linear"
    if cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils":
        return "conv1d"
    if cls is torch.nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq:
        return "embedding"
    if cls is torch.nn.LayerNorm:
        return "layer_norm"
    if next(module.children(), None) is None:
        return "module"
    return None


@dataclass
class ModuleCall:
    """One forward call of a watched module during a batch."""

    module: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    versions: list[int]


@dataclass
class FisherPlan:
    """Which module computes which parameter's per-example gradient, the hooks that record
    the calls of a batch, and the parameters that need the per-example loop."""

    model: Any
    params: Mapping[str, Any]
    #: id(module) -> (module, kind, [(local name, parameter name)])
    modules: dict[int, tuple[Any, str, list[tuple[str, str]]]] = field(default_factory=dict)
    #: id(parameter) -> (parameter name, ids of the modules allowed to use it)
    owners: dict[int, tuple[str, set[int]]] = field(default_factory=dict)
    loop: set[str] = field(default_factory=set)
    calls: list[ModuleCall] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    misused: set[str] = field(default_factory=set)
    recording: bool = False
    size: int = 0
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = {id(p): n for n, p in self.params.items()}
        for module in self.model.modules():
            for local, p in module.named_parameters(recurse=False):
                name = ids.get(id(p))
                if name is None:
                    continue
                kind = module_kind(module)
                if kind is None:
                    self.loop.add(name)
                    continue
                entry = self.modules.setdefault(id(module), (module, kind, []))
                entry[2].append((local, name))
                self.owners.setdefault(id(p), (name, set()))[1].add(id(module))

    def names(self, module: Any) -> list[str]:
        return [name for _, name in self.modules[id(module)][2]]

    def attach(self) -> None:
        for module, _, _ in self.modules.values():
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave, with_kwargs=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter(self, module: Any, args: Any) -> None:
        self.active.append(id(module))

    def _leave(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if self.active and self.active[-1] == id(module):
            self.active.pop()
        if not self.recording:
            return None
        kind = self.modules[id(module)][1]
        ids: Any = args[0] if args else None
        if kind == "embedding" and self.size > 1 and is_tensor(ids) and ids.shape[0] == 1:
            # one row of ids for the whole batch (position ids): the output is broadcast
            # over the batch later, which would sum its gradient over examples; an expanded
            # view (same values) keeps one gradient per example
            ids = ids.expand(self.size, *ids.shape[1:])
            output = output.expand(self.size, *output.shape[1:])
            args = (ids, *args[1:])
        tensors = [a for a in (*args, *kwargs.values(), output) if is_tensor(a)]
        versions = [t._version for t in tensors]
        self.calls.append(ModuleCall(module, tuple(args), dict(kwargs), output, versions))
        return output

    def watcher(self) -> Any:
        """A TorchFunctionMode noting parameters used (with gradient) outside the forward
        of the modules that own them."""
        from torch.overrides import TorchFunctionMode

        plan = self

        class _Watch(TorchFunctionMode):
            def __torch_function__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if _carries_grad(out):
                    for a in _flat(args, kwargs):
                        owner = plan.owners.get(id(a))
                        if owner is not None and not owner[1].intersection(plan.active):
                            plan.misused.add(owner[0])
                return out

        return _Watch()


def _carries_grad(x: Any) -> bool:
    if isinstance(x, (tuple, list)):
        return any(_carries_grad(v) for v in x)
    return is_tensor(x) and bool(x.requires_grad)


def _flat(args: Any, kwargs: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (tuple, list)):
            out.extend(a)
        else:
            out.append(a)
    return out
