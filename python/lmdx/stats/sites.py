"""Which weights a RegMean statistics collection hooks, and the saved weights each serves.

A *site* is one input whose Gram is collected: a linear module (``nn.Linear``, Hugging
Face ``Conv1D``, or a module verified on a probe to compute ``F.linear(input, weight,
bias)``, such as a MoE router), or one expert's up- or down-projection input of a
fused-experts module (:func:`expert_site`). :func:`find_sites` finds them, selected by
include/exclude patterns over the in-memory and the saved names, and maps each onto the
weights the model's ``save_pretrained`` folder stores (:mod:`lmdx.files.saved`), so that
statistics are keyed by the names a merge reads. Weights that cannot be given statistics
are returned with the reason. :class:`lmdx.stats.collector.GramCollector` hooks the sites.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._util import matches
from ..files.peft import is_peft_model, peft_modules
from ..files.saved import SavedSource, saved_sources, saved_state

__all__ = [
    "DECODER_KEYS",
    "DECODER_MASK_KEY",
    "ROUTING_KEYS",
    "Entry",
    "Sites",
    "expert_site",
    "find_linear_modules",
    "find_sites",
    "first_sequence",
    "probe_decoder_rows",
]

#: The argument of a fused-experts forward that says which experts each token goes to.
ROUTING_KEYS = ("top_k_index", "router_indices")
#: Batch keys that hold an encoder-decoder model's decoder inputs, and its mask.
DECODER_KEYS = ("decoder_input_ids", "decoder_inputs_embeds")
DECODER_MASK_KEY = "decoder_attention_mask"


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def find_linear_modules(
    model: Any,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> dict[str, tuple[Any, str]]:
    """Linear modules of ``model`` selected by name: name -> (module, layout).

    ``layout`` is ``"linear"`` for ``torch.nn.Linear`` (weight ``[out, in]``) and
    ``"conv1d"`` for Hugging Face ``Conv1D`` (weight ``[in, out]``). ``include`` and
    ``exclude`` are shell-style patterns (``fnmatch``) over the dotted module names or
    their weights' names (``classifier*`` and ``classifier.*`` both select
    ``classifier``); a module is selected if it matches an include pattern (or there are
    none) and no exclude pattern.

    A PEFT LoRA model's modules are named as in its base model (a LoRA layer by its base
    layer, whose input it reads); the LoRA factors themselves are not collected.
    """
    import torch

    conv1d = _conv1d_type()
    found: dict[str, tuple[Any, str]] = {}
    root, rename = (model, None) if not is_peft_model(model) else peft_modules(model)
    for name, module in root.named_modules():
        if rename is not None:
            if (base_name := rename(name)) is None:
                continue
            name = base_name
        if isinstance(module, torch.nn.Linear):
            layout = "linear"
        elif conv1d is not None and isinstance(module, conv1d):
            layout = "conv1d"
        else:
            continue
        names = (name, f"{name}.weight")  # a pattern may name the module or its weight
        if include and not any(matches(n, include) for n in names):
            continue
        if any(matches(n, exclude) for n in names):
            continue
        found[name] = (module, layout)
    return found


def _fused_experts(model: Any) -> dict[str, Any]:
    """Mixture-of-experts modules of transformers' fused-experts interface: name -> module.

    They hold every expert's up (or gate-and-up) and down projection as one 3-D
    parameter each, flags saying how (``has_gate``, ``has_bias``, ``is_transposed``) and
    are called as ``forward(hidden_states, top_k_index, top_k_weights)`` (GPT-OSS:
    ``router_indices``)."""
    found = {}
    for name, module in model.named_modules():
        if not all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed")):
            continue
        params = dict(module.named_parameters(recurse=False))
        up = params.get("gate_up_proj" if module.has_gate else "up_proj")
        down = params.get("down_proj")
        if up is None or down is None or up.ndim != 3 or down.ndim != 3:
            continue
        try:
            wanted = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if "hidden_states" in wanted and any(k in wanted for k in ROUTING_KEYS):
            found[name] = module
    return found


def _expert_like(model: Any, known: set[str]) -> dict[str, str]:
    """3-D floating-point parameters of modules that look like mixtures of experts but
    are not of the fused-experts interface (parameter -> why it gets no statistics)."""
    out = {}
    for name, module in model.named_modules():
        if name in known:
            continue
        looks_moe = "expert" in type(module).__name__.lower() or hasattr(module, "num_experts")
        for p_name, p in module.named_parameters(recurse=False):
            if looks_moe and p.ndim == 3 and p.is_floating_point():
                full = f"{name}.{p_name}" if name else p_name
                out[full] = (
                    f"a 3-D expert tensor of {type(module).__name__}, which is not of "
                    "transformers' fused-experts interface (no per-expert routing found)"
                )
    return out


def _linear_like_candidates(model: Any, skip: set[str]) -> dict[str, Any]:
    """Modules outside ``skip`` whose only parameters are a 2-D floating-point ``weight``
    and possibly a matching bias (e.g. MoE routers): candidates for
    :func:`_verified_linear_like`."""
    import torch

    found = {}
    for name, module in model.named_modules():
        if name in skip or isinstance(module, torch.nn.Embedding):
            continue
        params = dict(module.named_parameters(recurse=False))
        w = params.get("weight")
        if (
            w is None
            or w.ndim != 2
            or not w.is_floating_point()
            or set(params) - {"weight", "bias"}
        ):
            continue
        b = params.get("bias")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            continue
        found[name] = module
    return found


def _verified_linear_like(
    model: Any, candidates: Mapping[str, Any], probe: Mapping[str, Any]
) -> set[str]:
    """The candidates whose first output on the probe is ``F.linear(input, weight, bias)``
    (compared in float64 to 1e-5 of the output's scale)."""
    import torch

    ok: set[str] = set()
    checked: set[str] = set()

    def hook_for(name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            if name in checked:
                return
            checked.add(name)
            x = args[0] if args else None
            y = output[0] if isinstance(output, (tuple, list)) and output else output
            w = module.weight
            if not (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.is_floating_point()
                and x.ndim >= 1
                and x.shape[-1] == w.shape[1]
                and y.ndim >= 1
                and y.shape[-1] == w.shape[0]
                and y.numel() // w.shape[0] == x.numel() // w.shape[1]
            ):
                return
            b = getattr(module, "bias", None)
            ref = torch.nn.functional.linear(
                x.reshape(-1, w.shape[1]).double(),
                w.double(),
                None if b is None else b.double(),
            )
            got = y.reshape(-1, w.shape[0]).double()
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            if torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * scale):
                ok.add(name)

        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in candidates.items()]
    try:
        model(**probe)
    finally:
        for h in handles:
            h.remove()
    return ok


def _traced_layout(
    index: NDArray[np.int64], shape: tuple[int, ...], in_axis: int, expert_axis: int | None
) -> tuple[str, int | None] | None:
    """(layout, expert) of a saved 2-D tensor whose elements are the in-memory elements
    ``index`` (flat) of a weight of ``shape`` whose axis ``in_axis`` is its input: every
    saved row (``"linear"``) or column (``"conv1d"``) must be one output over the whole
    input in order, and all of one expert. None otherwise."""
    if index.ndim != 2:
        return None
    coords = np.unravel_index(index, shape)
    expert = None
    if expert_axis is not None:
        ex = coords[expert_axis]
        if not (ex == ex.flat[0]).all():
            return None
        expert = int(ex.flat[0])
    out_axes = [a for a in range(len(shape)) if a not in (in_axis, expert_axis)]
    if len(out_axes) != 1:
        return None
    inn, out = coords[in_axis], coords[out_axes[0]]
    ramp = np.arange(shape[in_axis])
    if index.shape[1] == shape[in_axis] and (inn == ramp[None, :]).all():
        if (out == out[:, :1]).all():
            return "linear", expert
    if index.shape[0] == shape[in_axis] and (inn == ramp[:, None]).all():
        if (out == out[:1, :]).all():
            return "conv1d", expert
    return None


@dataclass
class Entry:
    """One saved weight fed by a site: its module name (the saved weight's name less
    ``.weight``), the saved weight's name, its layout."""

    module: str
    weight: str
    layout: str

    @classmethod
    def of(cls, saved_name: str, layout: str) -> Entry:
        """The entry of saved weight ``saved_name`` (its module: the name less ``.weight``)."""
        return cls(saved_name.removesuffix(".weight"), saved_name, layout)


def expert_site(module: str, expert: int, part: str) -> str:
    """The site of expert ``expert`` of fused-experts module ``module``: ``part`` is
    ``"in"`` (its up projection's input) or ``"mid"`` (its down projection's input)."""
    return f"{module}[{expert}].{part}"


def _saved_entries(
    model: Any,
    linear: Mapping[str, tuple[Any, str]],
    experts: Mapping[str, Any],
    unknown: Mapping[str, str],
) -> tuple[
    dict[str, list[Entry]],
    dict[str, tuple[str, int, str, tuple[str, str]]],
    dict[str, str],
]:
    """Per site (a linear module's name, or :func:`expert_site`), the saved weights its
    Gram serves; per expert site, (experts module, expert, part, in-memory names); and
    the saved weights that get none (name -> why), among them those of the in-memory
    weights ``unknown`` (name -> why)."""
    params = [f"{n}.weight" for n in linear]
    for n, m in experts.items():
        params += [f"{n}.{'gate_up_proj' if m.has_gate else 'up_proj'}", f"{n}.down_proj"]
    saved = saved_state(model)
    sources, not_solved = saved_sources(model, [*params, *unknown], saved)
    del saved
    for n, why in unknown.items():
        for src in sources.pop(n, []):
            not_solved[src.saved] = f"{why} (in memory: {n})"
        if n in not_solved:
            not_solved[n] = why
    entries: dict[str, list[Entry]] = {}
    parts: dict[str, tuple[str, int, str, tuple[str, str]]] = {}

    def place(site: str, src: SavedSource, layout: tuple[str, int | None] | None) -> None:
        if layout is None:
            not_solved[src.saved] = (
                f"saved in a layout lmdx cannot map onto the input of {src.memory!r} "
                "(neither [out, in] nor [in, out] rows over the whole input)"
            )
        else:
            entries.setdefault(site, []).append(Entry.of(src.saved, layout[0]))

    for n, (module, layout) in linear.items():
        shape = tuple(module.weight.shape)
        in_axis = 1 if layout == "linear" else 0
        for src in sources.get(f"{n}.weight", []):
            if src.index is None:
                place(n, src, (layout, None))
            else:
                place(n, src, _traced_layout(src.index, shape, in_axis, None))
    for n, m in experts.items():
        in_axis = 1 if m.is_transposed else 2
        for part, p_name in (
            ("in", "gate_up_proj" if m.has_gate else "up_proj"),
            ("mid", "down_proj"),
        ):
            shape = tuple(getattr(m, p_name).shape)
            for src in sources.get(f"{n}.{p_name}", []):
                if src.index is None:
                    not_solved[src.saved] = (
                        "saved as one 3-D tensor of all experts (RegMean solves 2-D weights); "
                        "averaged"
                    )
                    continue
                traced = _traced_layout(src.index, shape, in_axis, 0)
                expert = -1 if traced is None else int(traced[1] or 0)
                site = expert_site(n, expert, part)
                place(site, src, traced)
                if traced is not None:
                    parts[site] = (n, expert, part, (n, f"{n}.{p_name}"))
    return entries, parts, not_solved


def _length(kwargs: Mapping[str, Any], keys: Sequence[str]) -> int | None:
    """The sequence length (dim 1) of the first of ``keys`` in ``kwargs`` that has one."""
    for k in keys:
        v: Any = kwargs.get(k)
        if hasattr(v, "shape") and v.dim() >= 2:
            return int(v.shape[1])
    return None


def first_sequence(kwargs: Mapping[str, Any], mask_key: str = "attention_mask") -> dict[str, Any]:
    """The first row of every batched tensor (a cheap probe of the model's wiring).

    With decoder inputs, the probe's decoder sequence is made longer than its encoder
    sequence (and than 1) if it is not already, by repeating its last position, so that
    a module's row count on the probe tells which stack's tokens it reads."""
    import torch

    ref = next((v for v in kwargs.values() if hasattr(v, "shape") and v.dim() > 0), None)
    if ref is None:
        return dict(kwargs)
    b = ref.shape[0]
    probe = {
        k: (v[:1] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == b else v)
        for k, v in kwargs.items()
    }
    t_dec = _length(probe, (*DECODER_KEYS, DECODER_MASK_KEY))
    t_enc = _length(probe, (mask_key, "input_ids", "inputs_embeds")) or 0
    if t_dec is not None and t_dec in (t_enc, 1):
        idx = torch.tensor([*range(t_dec), *[t_dec - 1] * (t_enc + 1 - t_dec)])
        for k, v in probe.items():
            if k.startswith("decoder_") and hasattr(v, "shape") and v.dim() >= 2:
                if v.shape[1] == t_dec:
                    probe[k] = v.index_select(1, idx)
    return probe


def probe_decoder_rows(probe: Mapping[str, Any]) -> int | None:
    """Decoder tokens in the (one-sequence) probe; None without decoder inputs."""
    return _length(probe, (*DECODER_KEYS, DECODER_MASK_KEY))


@dataclass
class Sites:
    """What a collection hooks: linear modules (name -> (module, layout)), fused-experts
    modules (name -> (module, {expert: parts})), the saved weights each site serves, what
    expert sites read, and the weights that get no statistics (name -> why)."""

    linear: dict[str, tuple[Any, str]]
    experts: dict[str, tuple[Any, dict[int, set[str]]]]
    entries: dict[str, list[Entry]]
    routed: dict[str, dict[str, Any]]
    not_solved: dict[str, str]


def find_sites(
    model: Any,
    kwargs: Mapping[str, Any],
    mask_key: str,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
) -> Sites:
    """The sites to hook, selected by ``include``/``exclude`` over the in-memory module
    and weight names and the saved ones (:class:`ValueError` when none is left)."""
    linear = find_linear_modules(model)
    experts: dict[str, Any] = {}
    expert_parts: dict[str, tuple[str, int, str, tuple[str, str]]] = {}
    not_solved: dict[str, str] = {}
    if is_peft_model(model):
        # named as in the base model (find_linear_modules), as its checkpoint stores them
        entries = {n: [Entry.of(f"{n}.weight", layout)] for n, (_, layout) in linear.items()}
    else:
        experts = _fused_experts(model)
        inside = {n for n in linear if any(n.startswith(f"{x}.") for x in experts)}
        candidates = _linear_like_candidates(model, set(linear) | set(experts) | inside)
        if candidates:
            probe = first_sequence(kwargs, mask_key)
            verified = _verified_linear_like(model, candidates, probe)
            linear = {
                name: linear.get(name) or (module, "linear")
                for name, module in model.named_modules()
                if name in linear or name in verified
            }
        entries, expert_parts, not_solved = _saved_entries(
            model, linear, experts, _expert_like(model, set(experts))
        )

    def selected(names: Sequence[str]) -> bool:
        if include and not any(matches(n, include) for n in names):
            return False
        return not any(matches(n, exclude) for n in names)

    kept = {}
    for site, found in entries.items():
        memory = expert_parts[site][3] if site in expert_parts else (site, f"{site}.weight")
        chosen = [e for e in found if selected((*memory, e.module, e.weight))]
        if chosen:
            kept[site] = chosen
    if not kept:
        raise ValueError(
            "collect_regmean_stats: no nn.Linear / Conv1D module matches the include/exclude "
            "patterns"
        )
    chosen_experts: dict[str, tuple[Any, dict[int, set[str]]]] = {}
    routed = {}
    for site, (name, expert, part, _memory) in expert_parts.items():
        if site not in kept:
            continue
        chosen_experts.setdefault(name, (experts[name], {}))[1].setdefault(expert, set()).add(part)
        routed[site] = {
            "module": name,
            "expert": expert,
            "input": "routed tokens" if part == "in" else "down projection input of routed tokens",
        }
    return Sites(
        {n: v for n, v in linear.items() if n in kept},
        chosen_experts,
        kept,
        routed,
        {n: why for n, why in not_solved.items() if selected((n,))},
    )
