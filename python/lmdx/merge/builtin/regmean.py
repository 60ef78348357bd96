"""``regmean`` (Jin et al., ICLR 2023, arXiv 2212.09849): every linear layer solved in
closed form from the Gram matrices of its inputs; everything else averaged.

Every linear weight with statistics in all K files is solved, ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i
G̃_i W_iᵀ`` with ``G̃_i = α·G_i/n_i + (1−α)·diag(G_i/n_i)``; modules that share an input
Gram (q/k/v) are one group, solved together (one factorization). A group is a step of the
plan (:meth:`RegMean.group_steps`), solved by :func:`solve_step` here, on a Ray worker or
inside RegMean++: whole or in blocks of output rows
(:mod:`lmdx.merge.builtin.regmean_solve`), or, for LoRA adapters over one base, on their
low-rank factors (:func:`regmean_low_rank`). Its report entries are the solver's
information per module and, where the system is poorly determined
(:func:`poorly_determined`), why and what to do. With ``surrogate: true``
(:class:`RegMeanOptions`) and the base, a model given no statistics takes surrogate ones
from its task vector (:mod:`lmdx.merge.surrogate`; the report's ``surrogate_stats``).

**RegMean of K adapters over one base** ``W_i = W₀ + B_i A_i`` (``B_i`` with PEFT's
scaling, ``[out, in]`` orientation). lmdx solves RegMean for the deviation from the
coefficient-weighted average ``W̄ = W₀ + D̄``, ``D̄ = Σ c_i B_i A_i / C`` (``C = Σ c_i``)::

    W_Mᵀ = W̄ᵀ + (S̃ + λI)⁻¹ Σ c_i G̃_i (B_i A_i − D̄)ᵀ,     S̃ = Σ c_i G̃_i

(:func:`lmdx.regmean_merge_layer`). With ``S = S̃ + λI`` and ``S⁻¹S̃ = I − λS⁻¹`` this is
exactly ``W₀ᵀ + S⁻¹ [Σ c_i G̃_i A_iᵀ B_iᵀ + λ D̄ᵀ]``, so the merged update is itself of
rank ``R = Σ r_i``::

    W_M − W₀ = [B_1 … B_K] Fᵀ,   F = S⁻¹ [U_1 … U_K] + λ S⁻¹ [c_1 A_1ᵀ/C … c_K A_Kᵀ/C],
    U_i = c_i G̃_i A_iᵀ = (c_i / n_i) (α G_i A_iᵀ + (1 − α) diag(G_i) A_iᵀ)

The products ``G_i A_iᵀ`` cost ``O(d_in² r_i)`` instead of the dense right-hand side's
``O(d_in² d_out)`` per model. ``F`` comes from the native core
(:func:`lmdx.regmean.regmean_low_rank_solve`: the Grams reduced by α with the helper the
dense merge uses, the same Cholesky, ridge and escalation, so ``λ`` is the ridge it used,
with ``2R`` right-hand sides). Weights equal in every model come back as they are
(``precision: identical``); the merged update goes to the LoRA of the merged update
(:mod:`lmdx.merge.lora`) as its factors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, Field

from ..._errors import MergeError
from ..._tensors import as_float64
from ..._util import matches
from ...config import default_threads
from ...regmean import regmean_low_rank_solve
from ...stats.file import Statistics
from ..lora import Factors
from ..method import Merged, MergeInputs, MergeMethod, NoOptions, Step, StepSizes, cast_merged
from ..options import MergeOptions
from ..source import AdapterSource, TensorSource
from ..surrogate import SurrogateStatistics, surrogates_line
from .average import AVERAGE
from .regmean_prior import Prior, PriorOptions, joined, prior_strength, prior_system
from .regmean_solve import (
    SolveOptions,
    output_block_size,
    regmean_memory,
    solve_group,
    solve_in_output_blocks,
    solve_precision,
)

__all__ = [
    "CONDITION_LIMIT",
    "ROWS_PER_INPUT",
    "RegMean",
    "RegMeanOptions",
    "group_report",
    "low_rank_inputs",
    "poorly_determined",
    "regmean_groups",
    "regmean_low_rank",
    "solve_group_low_rank",
    "solve_step",
]


def regmean_groups(
    stats: Sequence[Statistics],
    weights: set[str] | Mapping[str, Any],
    skip: set[str],
    options: MergeOptions,
) -> list[list[str]]:
    """The modules RegMean solves, grouped: modules that share one input Gram in every
    statistics file are solved together (one factorization). ``weights``: the weight
    names the models have; ``skip``: weights never solved (tied ones). The statistics
    cover the same modules (checked by the plan)."""
    by_group: dict[tuple[str, ...], list[str]] = {}
    for m, info in stats[0].modules.items():
        w = info["weight"]
        if matches(m, options.exclude) or matches(w, options.heads.patterns) or w in skip:
            continue
        if w not in weights:
            raise MergeError(f"statistics name module {m!r} but the models have no {w!r}")
        key = (*(s.group_of(m) for s in stats), info["layout"])
        by_group.setdefault(key, []).append(m)
    return list(by_group.values())


#: A RegMean system counts as poorly determined below this many statistics rows per input
#: dimension, or at a condition estimate of at least CONDITION_LIMIT.
ROWS_PER_INPUT = 2.0
CONDITION_LIMIT = 1e6


def poorly_determined(module: str, layer: Mapping[str, Any], alpha: float) -> dict[str, Any] | None:
    """Why the RegMean system of ``module`` (its solver report from :func:`solve_group`,
    merged at ``alpha``) is poorly determined, with what to do; None when it is not, or
    when nothing was solved (``precision`` ``"identical"``: the weights are equal in every
    model and come back exactly, whatever the statistics)."""
    if layer.get("precision") == "identical":
        return None
    rows, dim = float(layer["rows"]), int(layer["dim"])
    rcond = float(layer["rcond_estimate"])
    condition = float(layer["condition_estimate"]) or (1.0 / rcond if rcond > 0 else math.inf)
    bound = "≈" if layer["condition_estimate"] else "≥"
    reasons = []
    if rows < ROWS_PER_INPUT * dim:
        reasons.append(f"{rows:g} statistics rows for {dim} inputs")
    if condition >= CONDITION_LIMIT:
        reasons.append(f"condition {bound} {condition:.1e}")
    unseen = int(layer.get("unseen_directions", 0))
    if unseen:
        reasons.append(
            f"{unseen} input directions below the statistics' noise floor kept the average"
        )
    elif int(layer["attempts"]) > 1:
        reasons.append(f"factored only with a ridge of {float(layer['ridge']):g}")
    if not reasons:
        return None
    return {
        "module": module,
        "rows": rows,
        "dim": dim,
        "condition": condition,
        "why": "; ".join(reasons),
        "advice": advice(alpha),
    }


def advice(alpha: float) -> str:
    """What to do about a poorly determined system merged at ``alpha``. The system is
    α Σ c_i Ĝ_i + (1 − α) × its diagonal, so its smallest eigenvalue is at least (1 − α) ×
    its smallest diagonal entry: from α = 1 the paper's 0.9; below, the α that doubles
    1 − α (0.9 → 0.8), or halves α at 0.5 and below; at α = 0 there is no off-diagonal
    left to lower."""
    more = "collect statistics on more data (more texts or a longer max_length)"
    if alpha <= 0.0:
        return f"{more} or exclude the module (alpha is 0 already: no off-diagonal to lower)"
    suggested = 0.9 if alpha >= 1.0 else round(2.0 * alpha - 1.0 if alpha > 0.5 else alpha / 2, 3)
    return (
        f"{more}, lower alpha from {alpha:g} (e.g. to {suggested:g}: the system's smallest "
        "eigenvalue is at least (1 − alpha) × its smallest diagonal entry), or exclude the module"
    )


def regmean_low_rank(
    grams: Sequence[NDArray[np.float64]],
    counts: Sequence[float],
    base: NDArray[np.float64],
    factors: Sequence[Factors],
    *,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    name: str = "layer",
    n_threads: int | None = None,
) -> tuple[NDArray[np.float64], Factors, dict[str, Any]]:
    """RegMean of one layer of K low-rank updates of one base weight.

    Parameters
    ----------
    grams
        K input Grams ``G_i = Σ x xᵀ``, full (d_in, d_in) or packed upper triangles.
    counts
        K row counts ``n_i``.
    base
        ``W₀``, shape (d_out, d_in).
    factors
        K pairs ``(B_i, A_i)``, shapes (d_out, r_i) and (r_i, d_in): model i's weight is
        ``W₀ + B_i A_i`` (``r_i = 0``: the base itself).
    alpha, coefficients, ridge, allow_regularization, name, n_threads
        As in :func:`lmdx.regmean_merge_layer`.

    Returns
    -------
    (merged, (B, A), info)
        The merged weight ``W₀ + B A`` (float64, (d_out, d_in)); the factors of its update
        (rank ``Σ r_i``; rank 0 for identical weights); the solver's information (``ridge``,
        ``attempts``, ``precision``, ``rcond_estimate``, ``condition_estimate`` (0: not
        estimated), ``relative_spread``, ``rank``).
    """
    k = len(grams)
    if not (len(counts) == len(factors) == k):
        raise ValueError(f"{name}: need one Gram, count and pair of factors per model")
    coef = [1.0] * k if coefficients is None else [float(c) for c in coefficients]
    total = sum(coef)
    used = [i for i in range(k) if coef[i] > 0]
    # The average W̄ = W₀ + D̄ and the spread max_i max |B_i A_i − D̄| / max |W̄|, as the
    # dense merge reports them (in place: these are the path's only dense passes).
    pivot = max(used, key=lambda i: coef[i])  # D̄ = D_p + Σ_{i≠p} (c_i/C)(D_i − D_p): D_p
    pivot_delta = factors[pivot][0] @ factors[pivot][1]  # exactly where all agree
    mean_delta = pivot_delta.copy()
    for i in used:
        if i != pivot:
            work = factors[i][0] @ factors[i][1]
            work -= pivot_delta
            work *= coef[i] / total
            mean_delta += work
    del pivot_delta
    spread = 0.0
    for i in used:
        work = factors[i][0] @ factors[i][1]
        work -= mean_delta
        spread = max(spread, float(np.abs(work, out=work).max(initial=0.0)))
    del work
    merged_mean = mean_delta
    merged_mean += base
    scale = float(np.abs(merged_mean).max(initial=0.0))
    info: dict[str, Any] = {
        "relative_spread": spread / scale if scale > 0 else (math.inf if spread > 0 else 0.0),
        "rank": 0,
    }
    if spread == 0.0:  # equal in every model: nothing to solve, W̄ = W₀ + B_p A_p
        info.update(ridge=0.0, attempts=0, precision="identical")
        info.update(rcond_estimate=1.0, condition_estimate=1.0, rank=factors[used[0]][1].shape[0])
        return merged_mean, factors[used[0]], info
    del merged_mean
    b_parts = [factors[i][0] for i in used if factors[i][1].shape[0] > 0]
    f, solved = regmean_low_rank_solve(
        grams,
        [factors[i][1] for i in range(k)],
        counts,
        alpha=alpha,
        coefficients=coef,
        ridge=ridge,
        allow_regularization=allow_regularization,
        name=name,
        n_threads=n_threads,
    )
    rank = f.shape[1]
    b_all = np.concatenate(b_parts, axis=1)
    merged = b_all @ f.T
    merged += base
    info.update(
        ridge=float(solved.ridge),
        attempts=int(solved.attempts),
        precision="float64",
        rcond_estimate=float(solved.rcond_estimate),
        condition_estimate=0.0,
        rank=rank,
    )
    return merged, (b_all, np.ascontiguousarray(f.T)), info


def low_rank_inputs(step: Step, sources: Sequence[TensorSource]) -> list[list[Factors]] | None:
    """Per model, per member of RegMean group ``step``, the factors of its update over the
    one base every model adapts; None unless every model is a LoRA adapter over the same
    base whose update of every member is low-rank (not a replaced weight)."""
    if not sources or not all(isinstance(s, AdapterSource) for s in sources):
        return None
    adapters = [s for s in sources if isinstance(s, AdapterSource)]
    if any(s.base is not adapters[0].base for s in adapters):
        return None
    out = []
    for src in adapters:
        per_member = []
        for w in step.tensors:
            f = src.low_rank(w, step.layout)
            if f is None:
                return None
            per_member.append(f)
        out.append(per_member)
    return out


def solve_group_low_rank(
    step: Step,
    sources: Sequence[TensorSource],
    factors: Sequence[Sequence[Factors]],
    stats: Sequence[Statistics],
    labels: Sequence[str],
    options: MergeOptions,
) -> tuple[dict[str, NDArray[np.float64]], dict[str, Factors], dict[str, Any]]:
    """RegMean of one group of LoRA-adapted weights (:func:`regmean_low_rank`; members that
    share an input are joined along their outputs: ``B`` block-diagonal, ``A`` stacked).

    Returns weight name -> merged float64 weight (as stored), weight name -> factors of its
    update (``[out, in]`` orientation) and module name -> the solver's information."""
    assert isinstance(sources[0], AdapterSource)
    base_source = sources[0].base
    conv1d = step.layout == "conv1d"
    bases = []
    for w in step.tensors:
        b0 = as_float64(base_source.read(w), w)
        bases.append(b0.T if conv1d else b0)
    sizes = [b.shape[0] for b in bases]
    base = np.concatenate(bases, axis=0) if len(bases) > 1 else bases[0]
    joined = []
    for per_member in factors:
        a = np.concatenate([a for _, a in per_member], axis=0)
        b = np.zeros((sum(sizes), a.shape[0]))
        row = col = 0
        for (bm, am), size in zip(per_member, sizes, strict=True):
            b[row : row + size, col : col + am.shape[0]] = bm
            row, col = row + size, col + am.shape[0]
        joined.append((b, a))
    counts = [s.rows_seen(step.modules[0], label) for s, label in zip(stats, labels, strict=True)]
    members = step.modules
    name = (
        members[0] if len(members) == 1 else f"{members[0]} (+{len(members) - 1} sharing its input)"
    )
    own = options.own(SolveOptions)
    merged, (b_all, a_all), info = regmean_low_rank(
        [s.gram_stored(members[0]) for s in stats],
        counts,
        base,
        joined,
        alpha=own.alpha,
        coefficients=options.coefficients,
        ridge=own.ridge,
        allow_regularization=own.allow_regularization,
        name=name,
        n_threads=options.threads,
    )
    solved = {
        **{k: info[k] for k in ("ridge", "attempts", "precision", "rcond_estimate")},
        "condition_estimate": info["condition_estimate"],
        "output_error_estimate": 0.0,  # float64 solves (see lmdx.regmean_merge_layer)
        "relative_spread": info["relative_spread"],
        "rows": min(counts),
        "dim": int(base.shape[1]),
        "low_rank": int(info["rank"]),
    }
    out, updates, layers = {}, {}, {}
    row = 0
    for m, w, size in zip(members, step.tensors, sizes, strict=True):
        part = merged[row : row + size]
        out[w] = np.ascontiguousarray(part.T) if conv1d else part
        updates[w] = (b_all[row : row + size], a_all)
        row += size
        layers[m] = {**solved, "shared_with": members[0] if m != members[0] else None}
    return out, updates, layers


def group_report(module: str, layers: dict[str, Any], alpha: float) -> dict[str, Any]:
    """A solved group's report entries: the solver's information per module (``layers``)
    and, if the system of ``module`` (its first member, merged at ``alpha``) is poorly
    determined, why."""
    note = poorly_determined(module, layers[module], alpha)
    return {"layers": layers, "poorly_determined": [] if note is None else [note]}


def solve_step(step: Step, inputs: MergeInputs) -> Merged:
    """One RegMean group read from ``inputs.sources`` (its weights) and ``inputs.stats``
    (its Grams as stored, checked against their content hashes) and solved: its merged
    weights (NumPy, cast to their input dtype) and report entries (:func:`group_report`).
    The local engine, Ray workers and RegMean++ all solve a group here. LoRA adapters over
    one base are solved on their factors (:func:`solve_group_low_rank`); ``inputs.lora``
    (the LoRA of the merged update) receives the merged updates."""
    sources, stats, labels, options, lora = (
        inputs.sources,
        inputs.stats,
        inputs.labels,
        inputs.options,
        inputs.lora,
    )
    assert stats is not None
    alpha = options.own(SolveOptions).alpha
    prior: Prior | None = inputs.state.get("prior")
    strength = 0.0 if prior is None else prior_strength(step.modules[0], options.own(PriorOptions))
    factors = None if strength > 0 else low_rank_inputs(step, sources)
    read: dict[str, Any] = {}  # the Grams read, by module: what each task pays measures on them
    if factors is not None:
        solved, updates, layers = solve_group_low_rank(
            step, sources, factors, stats, labels, options
        )
        if lora is not None:
            for w, update in updates.items():
                lora.add_update(w, update)
    else:
        # The K models' weights and Grams are read, and the Grams checked against their
        # content hashes, a thread per model up to twice the CPUs: reading and hashing release the
        # GIL, and with a few more models than CPUs the system shares the CPUs among them
        # evenly (3 Grams on 2 threads would leave one thread hashing two: BERT-base's 48
        # groups read in 0.83 s instead of 1.0 s on 2 Zen 4 cores). A group too large for
        # the solve's memory budget is read and solved in blocks of output rows.
        block = None if lora is not None else output_block_size(step, sources, options)
        readers = max(1, min(len(stats), 2 * default_threads()))
        with ThreadPoolExecutor(readers, "lmdx-read") as pool:
            grams_read = pool.map(lambda s: s.gram_stored(step.modules[0]), stats)
            whole = not block or strength > 0  # the anchor merges whole tensors
            weights = [[s.read(w) for w in step.tensors] for s in sources] if whole else []
            grams = list(grams_read)
        system = None
        if strength > 0:
            assert prior is not None
            counts = [
                s.rows_seen(step.modules[0], lab) for s, lab in zip(stats, labels, strict=True)
            ]
            anchor = joined(prior.values(step.tensors, weights), step.layout)
            system = prior_system(grams, counts, options.coefficients, step.dim, strength, anchor)
            del anchor
        if block:
            del weights
            blocked, layers = solve_in_output_blocks(
                step, sources, stats, grams, labels, options, block, system
            )
            report = group_report(step.modules[0], layers, alpha)
            return Merged(blocked, report, {m: grams for m in step.modules})
        solved, layers = solve_group(step.modules, weights, grams, stats, labels, options, system)
        del weights
        read = {m: grams for m in step.modules}
        if lora is not None:
            for w, value in solved.items():
                lora.observe(w, value)
    tensors = {w: cast_merged(w, v, sources[0].dtype(w)) for w, v in solved.items()}
    return Merged(tensors, group_report(step.modules[0], layers, alpha), read)


class RegMeanOptions(SolveOptions, PriorOptions):
    """RegMean's solve options, its prior (:mod:`lmdx.merge.builtin.regmean_prior`), and
    whether models without statistics take surrogate ones."""

    surrogate: Annotated[
        bool,
        Field(
            description="models given no statistics use a Gram from their task vector against "
            "base, scaled to the real statistics' trace (lmdx.merge.surrogate); needs base "
            "and at least one model's statistics",
            json_schema_extra={"label": "must be true or false"},
        ),
    ] = False


class RegMean(MergeMethod):
    """Linear weights with statistics in every file solved (``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i
    G̃_i W_iᵀ``, :func:`solve_step`), everything else averaged."""

    name: ClassVar[str] = "regmean"
    summary: ClassVar[str] = (
        "RegMean (Jin et al., ICLR 2023, arXiv 2212.09849): every linear layer solved in "
        "closed form from the Gram matrices of its inputs"
    )
    options: ClassVar[type[NoOptions]] = RegMeanOptions
    stats: ClassVar[str | None] = "regmean-gram"
    ray: ClassVar[str] = "groups"

    def surrogates(self, own: BaseModel) -> bool:
        return isinstance(own, RegMeanOptions) and own.surrogate

    def uses_base(self, own: BaseModel) -> bool:
        return isinstance(own, RegMeanOptions) and (own.surrogate or own.prior is not None)

    def check(self, inputs: MergeInputs) -> None:
        """The prior's anchor opened and checked (:meth:`Prior.open`)."""
        own = inputs.options.method_options
        if isinstance(own, PriorOptions):
            prior = Prior.open(inputs, own)
            if prior is not None:
                inputs.state["prior"] = prior

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        stats = inputs.stats
        assert stats is not None
        steps = []
        for members in regmean_groups(stats, set(body), tied, inputs.options):
            info = stats[0].modules[members[0]]
            for s, label in zip(stats, inputs.labels, strict=True):
                s.rows_seen(members[0], label)
            steps.append(
                Step(
                    _SOLVED_HERE if "prior" in inputs.state else self,
                    [stats[0].modules[m]["weight"] for m in members],
                    members,
                    info["layout"],
                    int(stats[0].groups[stats[0].group_of(members[0])]["dim"]),
                )
            )
        return steps

    def tensor_method(self, inputs: MergeInputs, name: str) -> MergeMethod:
        """The average, or the anchor's merge for a tensor of a module with a prior."""
        prior: Prior | None = inputs.state.get("prior")
        own = inputs.options.method_options
        if prior is not None and isinstance(own, PriorOptions):
            if prior_strength(name.rsplit(".", 1)[0], own) > 0:
                return prior.tensors
        return AVERAGE

    def plan_notes(self, inputs: MergeInputs, steps: Sequence[Step]) -> list[str]:
        """The shared notes, and which models take surrogate statistics."""
        made = self.surrogate_labels(inputs)
        steps = [replace(s, method=self) if isinstance(s.method, RegMean) else s for s in steps]
        return super().plan_notes(inputs, steps) + ([surrogates_line(made)] if made else [])

    @staticmethod
    def surrogate_labels(inputs: MergeInputs) -> list[str]:
        """The models that take surrogate statistics (:mod:`lmdx.merge.surrogate`)."""
        stats = inputs.stats or []
        return [inputs.labels[i] for i, s in enumerate(stats) if isinstance(s, SurrogateStatistics)]

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        return solve_step(step, inputs)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """:func:`~lmdx.merge.builtin.regmean_solve.regmean_memory`, in blocks of output
        rows where the group is solved so (over ``solve_memory``), and what forming the
        surrogate Grams takes (per surrogate formed at once: a member's task vector and
        its float64 read, ``T``, a product and the packed Gram)."""
        # Merges that also build a LoRA of the merged update are never solved in blocks.
        block = (
            None
            if inputs.lora is not None
            else output_block_size(step, inputs.sources, inputs.options)
        )
        need = regmean_memory(step, sizes, block, solve_precision(inputs.options))
        prior: Prior | None = inputs.state.get("prior")
        if prior is not None:
            need += prior.memory(step, sizes)
        made = len(self.surrogate_labels(inputs))
        if made:  # surrogate Grams formed at once, one member at a time (lmdx.merge.surrogate)
            largest = max(int(np.prod(sizes.ref.shape(t))) for t in step.tensors)
            at_once = min(made, default_threads())
            need += at_once * (16 * largest + 20 * step.dim * step.dim)
        return need

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        """The options, and the linear weights the statistics could not cover (averaged)
        with why."""
        out = super().report(inputs)
        stats = inputs.stats or []
        made = self.surrogate_labels(inputs)
        if made:
            out["surrogate_stats"] = made
        prior: Prior | None = inputs.state.get("prior")
        if prior is not None:
            out["prior_options"] = prior.report()
        missing = {n: why for s in stats for n, why in s.not_solved.items()}
        heads = inputs.options.heads.patterns
        missing = {n: why for n, why in sorted(missing.items()) if not matches(n, heads)}
        if missing:
            out["not_solved"] = missing
        return out


class _SolvedHere(RegMean):
    """RegMean's groups when it has a prior: solved in this process (the anchor reads the
    base, which Ray workers do not open)."""

    ray: ClassVar[str] = "local"


_SOLVED_HERE = _SolvedHere()
