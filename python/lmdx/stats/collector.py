"""The Gram collector: forward pre-hooks streaming linear modules' inputs into float64
accumulators.

RegMean needs, for every linear map, the Gram ``Σ x xᵀ`` of its inputs over the user's
data. :class:`GramCollector` puts a forward pre-hook on every selected ``nn.Linear`` and
Hugging Face ``Conv1D`` (and on what else acts as one, below) and streams each input into
a float64 :class:`lmdx.Moments` (:func:`lmdx.stats.collect.collect_regmean_stats` runs it
over a whole model, RegMean++ over one block at a time):

* padding rows are left out using the batch's attention mask (the reference
  implementations count them, which makes a Gram depend on how texts were batched);
  ``include_padding=True`` counts them like the reference code. An encoder-decoder model
  has one mask per stack: modules whose rows are the encoder's tokens (the encoder, and
  the cross-attention keys and values, which read the encoder's output) use
  ``attention_mask``; modules whose rows are the decoder's tokens use
  ``decoder_attention_mask`` when the batch has one, else count every decoder row.
  Which stack a module's rows belong to is found on the one-sequence probe, where the
  decoder inputs are made longer than the encoder's when they are not already;
* modules that read the very same input tensor (attention q/k/v, MLP gate/up, ...)
  share one Gram: it is accumulated once and stored once. Sharing is detected on a
  one-sequence probe and verified on every batch;
* a module that is not an ``nn.Linear`` but holds only a 2-D ``weight`` (and a bias) and
  whose first output is ``F.linear(input, weight, bias)`` on the probe (the routers of
  Mixtral, Qwen2-MoE and OLMoE in transformers 5) is collected like one;
* mixture-of-experts layers whose experts are fused 3-D tensors (transformers' experts
  interface: ``gate_up_proj``/``up_proj`` and ``down_proj`` of experts × out × in, or
  transposed) get one Gram per expert and projection: of the tokens routed to that
  expert (the experts module's ``hidden_states`` rows whose ``top_k_index`` names it),
  and of the same tokens' inputs to its down projection, computed from its own weights
  as transformers' experts forward does (up projection, bias, gate or activation);
* fp32/bf16/fp16 activations are handed to the core as they are (16-bit floats are
  widened exactly while the kernel packs them, or multiplied with the CPU's bf16 dot
  product) and accumulated in float64: with ``accumulation="mixed"`` float32 products of
  chunks of rows are summed in float64, with ``"float64"`` the rows are widened and
  multiplied in float64 (:data:`ACCUMULATIONS`);
* with ``backend="torch"`` (a model on a GPU) each Gram is accumulated by torch on the
  activations' own device instead (:mod:`lmdx.stats.torch_gram`), masked the same way,
  and the file's accumulation label says so (``"torch-float32"``).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._tensors import as_float64, as_rows
from ..moments import Moments
from .file import Statistics
from .sites import DECODER_MASK_KEY, ROUTING_KEYS, Entry, expert_site
from .torch_gram import TORCH_ACCUMULATIONS, TorchGram

__all__ = ["ACCUMULATIONS", "BACKENDS", "GramCollector", "accumulation_option"]

#: How a Gram is accumulated (``accumulation=``, ``--accumulation``, and the statistics
#: file's ``extra["accumulation"]``): float32 products summed in float64, or float64
#: throughout.
ACCUMULATIONS = ("mixed", "float64")

#: Where the Gram arithmetic runs: lmdx's core (on the CPU), or torch on the activations'
#: device (:mod:`lmdx.stats.torch_gram`).
BACKENDS = ("lmdx", "torch")


def accumulation_option(accumulation: str, precision: str | None, where: str) -> str:
    """The Gram accumulation asked for: ``accumulation``, or the deprecated spelling
    ``precision`` (with a :class:`DeprecationWarning`); checked to be one of
    :data:`ACCUMULATIONS`. ``where`` names the caller in the messages."""
    if precision is not None:
        warnings.warn(
            f"{where}: precision= is deprecated for statistics; write accumulation= "
            "(precision names the merge's solve)",
            DeprecationWarning,
            stacklevel=3,
        )
        if accumulation != "mixed" and accumulation != precision:
            raise ValueError(
                f"{where}: accumulation={accumulation!r} and precision={precision!r} disagree; "
                "give accumulation only"
            )
        accumulation = precision
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation: expected 'mixed' or 'float64', got {accumulation!r}")
    return accumulation


def _expert_mid(module: Any, x: Any, expert: int) -> Any:
    """The input of expert ``expert``'s down projection for its routed rows ``x``, as
    transformers' experts forward computes it: up (or gate-and-up) projection, its bias,
    then the module's gate (``_apply_gate``) or activation."""
    import torch

    w = (module.gate_up_proj if module.has_gate else module.up_proj)[expert]
    h = x @ w if module.is_transposed else torch.nn.functional.linear(x, w)
    if module.has_bias:
        h = h + (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[expert]
    return module._apply_gate(h) if module.has_gate else module.act_fn(h)


class GramCollector:
    """Forward pre-hooks streaming the inputs of linear modules into float64 accumulators,
    one :class:`Moments` per input group: the one collector of RegMean Grams.

    :func:`lmdx.stats.collect.collect_regmean_stats` runs it over a whole model; RegMean++
    (:mod:`lmdx.merge.regmean_plusplus`) over one block at a time. Use: :meth:`probe` once
    (which modules share an input, which stack's tokens each reads), then per batch
    :meth:`start_batch` (the batch's masks), a forward pass inside :meth:`hooks`,
    :meth:`end_batch`.

    Parameters
    ----------
    modules
        Module name -> (module, layout), as :func:`lmdx.stats.sites.find_linear_modules`
        returns them: each a site (one input).
    include_padding, share_inputs, mask_key, accumulation, backend
        As in :func:`lmdx.stats.collect.collect_regmean_stats`; :attr:`accumulation` is
        then the label the statistics record (``"torch-float32"`` for ``"mixed"`` with
        ``backend="torch"``).
    n_threads
        Threads of the native accumulation.
    experts
        Fused-experts modules: name -> (module, {expert: parts}), whose sites are each
        expert's ``"in"`` and ``"mid"`` inputs (:func:`expert_site`).
    entries
        Per site, the saved weights its Gram serves (default: a linear module's own
        weight, ``{name}.weight``); they name the statistics' modules and groups.
    """

    def __init__(
        self,
        modules: Mapping[str, tuple[Any, str]],
        *,
        include_padding: bool = False,
        share_inputs: bool = True,
        mask_key: str = "attention_mask",
        n_threads: int,
        accumulation: str = "mixed",
        backend: str = "lmdx",
        experts: Mapping[str, tuple[Any, Mapping[int, set[str]]]] | None = None,
        entries: Mapping[str, Sequence[Entry]] | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected 'lmdx' or 'torch', got {backend!r}")
        self.float64 = accumulation == "float64"
        self.torch = backend == "torch"
        self.accumulation = TORCH_ACCUMULATIONS[accumulation] if self.torch else accumulation
        self.modules = modules
        self.entries = dict(entries or {})
        for name, (_m, layout) in modules.items():
            self.entries.setdefault(name, [Entry.of(f"{name}.weight", layout)])
        self.order: list[str] = []
        self.calls_on_probe: dict[str, int] = {}
        self.experts = dict(experts or {})
        self.include_padding = include_padding
        self.share_inputs = share_inputs
        self.mask_key = mask_key
        self.n_threads = n_threads
        self.group_of: dict[str, str] = {}
        self.moments: dict[str, Moments | TorchGram] = {}
        self.active: set[str] | None = None  # groups of the current pass (None: all)
        self.stack_of: dict[str, str] = {}  # hooked module -> "encoder" | "decoder"
        # per batch: tensors accumulated per group (weak references) and calls per module
        self._accumulated: dict[str, list[weakref.ref[Any]]] = {}
        self._calls: dict[str, int] = {}
        self._masks: dict[str, tuple[Any, tuple[int, ...]] | None] = {}
        self._kept: dict[tuple[int, str], Any] = {}  # per batch: a mask on a torch device
        self._probe_inputs: dict[str, list[Any]] | None = None
        self._signatures = {n: inspect.signature(m.forward) for n, (m, _) in self.experts.items()}
        for name, (_module, wanted) in self.experts.items():
            for e, parts in wanted.items():
                for part in parts:
                    site = expert_site(name, e, part)
                    self.group_of[site] = site

    def sites_of(self, name: str) -> list[str]:
        """The sites a hooked module feeds: itself, or its experts' sites."""
        if name in self.experts:
            wanted = self.experts[name][1]
            return [
                expert_site(name, e, p)
                for e in sorted(wanted)
                for p in ("in", "mid")
                if p in wanted[e]
            ]
        return [name]

    def dim_of(self, site: str) -> int:
        """The input dimension of a site."""
        if site in self.modules:
            module, layout = self.modules[site]
            return int(module.weight.shape[1 if layout == "linear" else 0])
        name, _, part = site.rpartition(".")
        module = self.experts[name.rpartition("[")[0]][0]
        up = module.gate_up_proj if module.has_gate else module.up_proj
        down = module.down_proj
        if part == "in":
            return int(up.shape[1] if module.is_transposed else up.shape[2])
        return int(down.shape[1] if module.is_transposed else down.shape[2])

    # -- probe: which modules read the same tensor -----------------------------------

    def probe(self, run: Callable[[], Any], decoder_rows: int | None = None) -> None:
        """Find the input groups: ``run()`` makes one forward pass (e.g. of one sequence)
        while hooks record which modules read the very same input tensor; a module whose
        rows number ``decoder_rows`` (the probe's decoder tokens) reads the decoder's."""
        hooked = [*self.modules, *self.experts]
        self._probe_inputs = {name: [] for name in hooked}
        self._first_call: dict[str, int] = {}
        self._probe_rows: dict[str, int] = {}
        handles = [
            module.register_forward_pre_hook(self._probe_hook(name))
            for name, (module, _) in self.modules.items()
        ]
        handles += [
            module.register_forward_pre_hook(self._probe_hook(name, experts=True), with_kwargs=True)
            for name, (module, _) in self.experts.items()
        ]
        try:
            run()
        finally:
            for h in handles:
                h.remove()
        seen = self._probe_inputs
        self._probe_inputs = None
        self.order = sorted((n for n in hooked if seen[n]), key=self._first_call.__getitem__)
        self.calls_on_probe = {n: len(seen[n]) for n in hooked}
        for n in hooked:
            rows = self._probe_rows.get(n)
            self.stack_of[n] = (
                "decoder" if decoder_rows is not None and rows == decoder_rows else "encoder"
            )
        leader_of: dict[tuple[int, ...], str] = {}
        for name in self.modules:
            key = tuple(id(t) for t in seen[name])
            if not key:  # not called on the probe: a group of its own
                self.group_of[name] = name
                continue
            leader = leader_of.setdefault(key, name) if self.share_inputs else name
            self.group_of[name] = leader
        del seen  # release the probe's activations

    def _probe_hook(self, name: str, experts: bool = False) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: Any = None) -> None:
            assert self._probe_inputs is not None
            x = self._experts_input(name, args, kwargs or {})[0] if experts else args[0]
            self._probe_inputs[name].append(x)
            self._first_call.setdefault(name, len(self._first_call))
            self._probe_rows.setdefault(name, int(np.prod(tuple(x.shape[:-1]), dtype=np.int64)))

        return hook

    def adopt_groups(self, other: GramCollector) -> None:
        """Take the input groups (and stacks) ``other`` found by its probe (for the same
        modules, e.g. one block loaded with another model's weights) instead of probing
        again."""
        self.group_of = dict(other.group_of)
        self.order = list(other.order)
        self.calls_on_probe = dict(other.calls_on_probe)
        self.stack_of = dict(other.stack_of)

    def sites(self) -> list[str]:
        """Every site, in the order of the hooked modules."""
        return [s for n in [*self.modules, *self.experts] for s in self.sites_of(n)]

    def dims(self) -> dict[str, int]:
        """Input group -> its input dimension."""
        return {self.group_of[s]: self.dim_of(s) for s in self.sites()}

    def group_name(self, group: str) -> str:
        """The name statistics give input group ``group`` (its first saved module's)."""
        return self.entries[group][0].module

    def module_info(self) -> dict[str, dict[str, Any]]:
        """Saved module name -> its group, layout, weight name and input dimension, as
        :class:`Statistics` record them."""
        dims = self.dims()
        return {
            e.module: {
                "group": self.group_name(self.group_of[s]),
                "layout": e.layout,
                "weight": e.weight,
                "dim": dims[self.group_of[s]],
            }
            for s in self.sites()
            for e in self.entries[s]
        }

    def take_statistics(self, model: Mapping[str, Any], data: str = "") -> Statistics:
        """The Grams accumulated so far as in-memory :class:`Statistics` of ``model`` (an
        identity); the collector starts over with empty accumulators."""
        dims = self.dims()
        missing = [n for n in self.modules if self.group_of[n] not in self.moments]
        if missing:
            raise ValueError(
                f"modules never called during the forward pass: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; exclude them"
            )
        moments = {g: self.final_moments(g) for g in list(self.moments)}
        return Statistics(
            kind="regmean-gram",
            model=model,
            data=data,
            padding="included" if self.include_padding else "excluded",
            modules=self.module_info(),
            groups={
                self.group_name(g): {"dim": d, "count": moments[g].count} for g, d in dims.items()
            },
            moments={self.group_name(g): m for g, m in moments.items()},
            extra={"share_inputs": self.share_inputs, "accumulation": self.accumulation},
        )

    def final_moments(self, group: str) -> Moments:
        """Input group ``group``'s statistics, taken out of the collector as a host
        :class:`Moments` (a torch accumulator's checked for NaN/Inf and copied over)."""
        acc = self.moments.pop(group)
        if isinstance(acc, TorchGram):
            return acc.moments(f"input group {self.group_name(group)!r}")
        return acc

    @contextlib.contextmanager
    def hooks(self, names: Iterable[str] | None = None) -> Iterator[None]:
        """Accumulating hooks on the hooked modules ``names`` (default: all) while inside."""
        chosen = set(self.modules) | set(self.experts) if names is None else set(names)
        handles = [
            module.register_forward_pre_hook(self.hook(name))
            for name, (module, _) in self.modules.items()
            if name in chosen
        ]
        handles += [
            module.register_forward_pre_hook(self.hook(name), with_kwargs=True)
            for name, (module, _) in self.experts.items()
            if name in chosen
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # -- accumulation ------------------------------------------------------------------

    def start_batch(self, kwargs: Mapping[str, Any]) -> None:
        self._accumulated = {}
        self._calls = {}
        self._kept = {}
        self._masks = {
            "encoder": self._mask(kwargs, self.mask_key),
            "decoder": self._mask(kwargs, DECODER_MASK_KEY),
        }

    def _mask(self, kwargs: Mapping[str, Any], key: str) -> tuple[Any, tuple[int, ...]] | None:
        mask = None if self.include_padding else kwargs.get(key)
        if mask is None:
            return None
        arr = as_float64(mask, key)
        shape = tuple(arr.shape)
        arr = arr.reshape(-1)
        if not np.isin(arr, (0.0, 1.0)).all():
            raise ValueError(f"batches: {key} must hold 0/1 values")
        return np.ascontiguousarray(arr), shape

    def hook(self, name: str) -> Any:
        if name in self.experts:

            def experts_fn(module: Any, args: tuple[Any, ...], kwargs: Any) -> None:
                x, index = self._experts_input(name, args, kwargs)
                self._accumulate_experts(name, x, index)

            return experts_fn

        def fn(module: Any, args: tuple[Any, ...]) -> None:
            self._accumulate(name, args[0])

        return fn

    def _experts_input(
        self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[Any, Any]:
        """The ``hidden_states`` and ``top_k_index`` of a call of experts module ``name``."""
        bound = self._signatures[name].bind_partial(*args, **kwargs).arguments
        return bound["hidden_states"], next(bound[k] for k in ROUTING_KEYS if k in bound)

    def _accumulate(self, name: str, x: Any) -> None:
        group = self.group_of[name]
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        done = self._accumulated.setdefault(group, [])
        if call < len(done):
            if done[call]() is not x:
                raise RuntimeError(
                    f"module {name!r} shares a Gram with {group!r} (they read the same input "
                    "on the probe sequence) but read a different input in this batch; pass "
                    "share_inputs=False"
                )
            return
        d = self.dim_of(name)
        if x.ndim == 0 or x.shape[-1] != d:
            raise ValueError(
                f"module {name!r} input: expected shape (..., {d}), got {tuple(x.shape)}"
            )
        leading = tuple(x.shape[:-1])
        weights = self._row_weights(name, leading, int(np.prod(leading, dtype=np.int64)))
        self._update(group, name, x, d, weights)
        done.append(weakref.ref(x))

    def _update(self, group: str, name: str, x: Any, d: int, weights: Any) -> None:
        if self.torch:
            acc = self.moments.get(group)
            if acc is None:
                acc = self.moments[group] = TorchGram(d, x.device, float64=self.float64)
            assert isinstance(acc, TorchGram)
            acc.update(x, None if weights is None else self._kept_on(weights, x.device))
            return
        # float16/bfloat16 activations stay 16-bit: widened exactly inside the kernel
        rows = as_rows(x, d, f"module {name!r} input")[0].astype(np.float64) if self.float64 else x
        acc = self.moments.get(group)
        if acc is None:
            acc = self.moments[group] = Moments(d)
        assert isinstance(acc, Moments)
        try:  # the core checks every value (threaded) before adding anything
            acc.update(rows, weights=weights, n_threads=self.n_threads)
        except ValueError as exc:
            if str(exc).startswith("x: contains"):
                raise ValueError(
                    f"module {name!r}: its input holds NaN or Inf ({exc}); check the model "
                    "and the data"
                ) from None
            raise ValueError(f"module {name!r}: {exc}") from None

    def _kept_on(self, weights: Any, device: Any) -> Any:
        """A 0/1 row mask (NumPy, from :meth:`_row_weights`) as a boolean tensor on
        ``device``, copied once per batch."""
        import torch

        key = (id(weights), str(device))
        if key not in self._kept:
            self._kept[key] = torch.from_numpy(weights > 0).to(device)
        return self._kept[key]

    def _accumulate_experts(self, name: str, x: Any, index: Any) -> None:
        """Each selected expert's routed rows (padding left out), and their inputs to
        its down projection."""

        module, wanted = self.experts[name]
        self._calls[name] = self._calls.get(name, 0) + 1
        sites = [s for s in self.sites_of(name) if self.active is None or s in self.active]
        if not sites:
            return
        for site in sites:  # an expert no token reaches still has (empty) statistics
            if site not in self.moments:
                d_site = self.dim_of(site)
                self.moments[site] = (
                    TorchGram(d_site, x.device, float64=self.float64)
                    if self.torch
                    else Moments(d_site)
                )
        d = x.shape[-1]
        rows = x.reshape(-1, d)
        weights = self._row_weights(name, tuple(x.shape[:-1]), int(rows.shape[0]))
        routes = index.reshape(rows.shape[0], -1)
        real = None if weights is None else self._kept_on(weights, rows.device)
        for e in sorted(wanted):
            hit = (routes == e).any(dim=1)
            if real is not None:
                hit &= real
            tokens = hit.nonzero().squeeze(1)
            if tokens.numel() == 0:
                continue
            xe = rows.index_select(0, tokens)
            site_in, site_mid = expert_site(name, e, "in"), expert_site(name, e, "mid")
            if site_in in sites:
                self._update(site_in, site_in, xe, d, None)
            if site_mid in sites:
                mid = _expert_mid(module, xe, e)
                self._update(site_mid, site_mid, mid, int(mid.shape[-1]), None)

    def _row_weights(self, name: str, leading: tuple[int, ...], rows: int) -> Any:
        stack = self.stack_of.get(name, "encoder")
        found = self._masks.get(stack)
        if found is None:
            return None
        mask, mask_shape = found
        if leading == mask_shape or rows == mask.size:
            return mask
        if len(leading) == 1 and leading[0] == mask_shape[0]:
            return None  # one row per sequence (a pooled input): no padding in it
        key = self.mask_key if stack == "encoder" else DECODER_MASK_KEY
        raise ValueError(
            f"module {name!r}: input rows {leading} do not line up with the {key} "
            f"{mask_shape}; pass include_padding=True or exclude this module"
        )

    def end_batch(self) -> None:
        for name, calls in self._calls.items():
            if name in self.experts:
                continue
            group = self.group_of[name]
            if calls != len(self._accumulated.get(group, ())):
                raise RuntimeError(
                    f"module {name!r} shares a Gram with {group!r} but was called {calls} "
                    f"times while the group accumulated {len(self._accumulated[group])} "
                    "inputs in this batch; pass share_inputs=False"
                )
        self._accumulated = {}
