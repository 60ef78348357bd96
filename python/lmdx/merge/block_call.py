"""How a model calls its blocks: the arguments besides the hidden states, captured at
block 0 and reused for every block, and their comparison (RegMean++ refuses models that
pass blocks arguments of their own, such as alternating sliding-window masks)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import MergeError
from .._tensors import is_tensor

__all__ = ["BlockCall", "call_difference", "hidden_of", "same_value", "tensor_bytes"]


@dataclass
class BlockCall:
    """How the model calls its blocks for one batch: the arguments besides the hidden
    states (attention mask, position embeddings, ...), captured at block 0."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    keyword: bool  # the hidden states are passed as hidden_states=

    @classmethod
    def capture(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, BlockCall]:
        """(hidden states, the rest of the call) from a block's pre-hook arguments."""
        if args:
            return args[0], cls(tuple(args[1:]), dict(kwargs), False)
        rest = dict(kwargs)
        if "hidden_states" not in rest:
            raise MergeError(
                "regmean_plusplus: the model calls its blocks without hidden states (neither "
                "a first argument nor hidden_states=); this architecture is not supported"
            )
        return rest.pop("hidden_states"), cls((), rest, True)

    def run(self, block: Any, hidden: Any) -> Any:
        """``block``'s output hidden states for input ``hidden``."""
        if self.keyword:
            out = block(*self.args, hidden_states=hidden, **self.kwargs)
        else:
            out = block(hidden, *self.args, **self.kwargs)
        return hidden_of(out)

    def nbytes(self) -> int:
        return tensor_bytes(self.args) + tensor_bytes(self.kwargs)


def hidden_of(out: Any) -> Any:
    """The hidden states of a block's output (a tensor, or a tuple starting with them)."""
    if is_tensor(out):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and is_tensor(out[0]):
        return out[0]
    raise MergeError(
        f"regmean_plusplus: a block returned {type(out).__name__}, not hidden states (a tensor "
        "or a tuple starting with one); this architecture is not supported"
    )


def tensor_bytes(obj: Any) -> int:
    if is_tensor(obj):
        return int(obj.nelement() * obj.element_size())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


def same_value(a: Any, b: Any) -> bool:
    """Whether two block arguments are the same object or equal values."""
    import torch

    if a is b:
        return True
    if is_tensor(a) and is_tensor(b):
        return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (bool, int, float, str)) and isinstance(b, (bool, int, float, str)):
        return a == b
    return False


def call_difference(call: BlockCall, first: BlockCall) -> str | None:
    """The first argument in which ``call`` differs from ``first`` (None: none does)."""
    if len(call.args) != len(first.args) or call.kwargs.keys() != first.kwargs.keys():
        return "set of arguments"
    for i, (a, b) in enumerate(zip(call.args, first.args, strict=True)):
        if not same_value(a, b):
            return f"positional argument {i + 2}"
    for key, value in call.kwargs.items():
        if not same_value(value, first.kwargs[key]):
            return f"{key}="
    return None
