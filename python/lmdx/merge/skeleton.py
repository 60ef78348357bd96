"""The model RegMean++ runs block by block: a skeleton of the first model's class whose
parameters take no memory (on PyTorch's meta device), and its repeated blocks.

Blocks are found as the model's one ``ModuleList`` of identical modules that hold linear
layers: BERT/RoBERTa ``encoder.layer``, GPT-2 ``h``, Llama/Mistral/Qwen ``layers``.
:class:`lmdx.merge.regmean_plusplus.BlockMerger` loads one block's tensors at a time into
the skeleton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from .._errors import MergeError
from ..files.hf import hf_config, model_class
from ..stats.sites import find_linear_modules
from .source import TensorSource

__all__ = ["Block", "build_skeleton", "find_blocks", "model_blocks"]


class Block(NamedTuple):
    """One of the repeated blocks ``regmean_plusplus`` merges in order: the prefix of its
    tensor names (``bert.encoder.layer.3``) and its linear modules' input dimensions."""

    prefix: str
    linear: dict[str, int]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) and their
    buffers as usual: non-persistent buffers such as rotary frequencies are computed at
    construction and are in no checkpoint (accelerate's ``init_empty_weights`` with
    ``include_buffers=False`` does the same)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: Any, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_skeleton(config: Mapping[str, Any], label: str) -> Any:
    """The model ``config`` describes (the class its ``architectures`` names), with every
    parameter on the meta device, in evaluation mode, with caching off."""
    import transformers

    if not config:
        raise MergeError(
            f"{label}: regmean_plusplus runs the models' blocks, so it needs their Hugging Face "
            "configuration: pass model folders or transformers models, not state dicts"
        )
    cfg = hf_config(config, f"of {label}")
    cfg.use_cache = False
    cls = model_class(config)
    with _parameters_on_meta():
        model = cls.from_config(cfg) if cls is transformers.AutoModel else cls(cfg)  # type: ignore[no-untyped-call]
    return model.eval()


def find_blocks(model: Any) -> tuple[str, Any]:
    """The model's repeated blocks: its one ``torch.nn.ModuleList`` of modules of one class
    that hold linear layers (BERT ``encoder.layer``, GPT-2 ``h``, Llama ``layers``), as
    (name, module list). :class:`MergeError` naming the model's class if it has none or
    several (e.g. an encoder and a decoder)."""
    import torch

    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue  # inside a block (e.g. a mixture of experts)
        if len({type(m) for m in module}) != 1:
            continue
        if any(n for n in find_linear_modules(module[0])):
            found.append((name, module))
    cls = type(model).__name__
    if not found:
        raise MergeError(
            f"regmean_plusplus: found no repeated blocks in {cls} (a ModuleList of identical "
            "layers holding linear modules, like BERT's encoder.layer, GPT-2's h or Llama's "
            "layers); merge it with method regmean instead"
        )
    if len(found) > 1:
        raise MergeError(
            f"regmean_plusplus: {cls} has {len(found)} stacks of blocks "
            f"({', '.join(n for n, _ in found)}); it merges models with one stack (an encoder "
            "or a decoder); merge this one with method regmean"
        )
    return found[0]


def model_blocks(source: TensorSource) -> list[Block]:
    """The repeated blocks of ``source``'s model, in order, each with its linear modules'
    input dimensions; checked to be stored in ``source`` under those names."""
    model = build_skeleton(source.config, source.label)
    prefix, stack = find_blocks(model)
    blocks = []
    for i, block in enumerate(stack):
        name = f"{prefix}.{i}"
        for key in block.state_dict():
            if f"{name}.{key}" not in source:
                raise MergeError(
                    f"{source.label} has no tensor {name}.{key!r} that its class "
                    f"{type(model).__name__} has; re-save the model with save_pretrained"
                )
        linear = {
            f"{name}.{n}": int(m.weight.shape[1 if layout == "linear" else 0])
            for n, (m, layout) in find_linear_modules(block).items()
        }
        blocks.append(Block(name, linear))
    return blocks
