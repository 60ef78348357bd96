"""RegMean++ (Nguyen et al., 2025, arXiv 2508.03121): RegMean merged block by block, each
block's Grams taken on the activations the already-merged blocks in front of it produce.

The conventions are those of the paper's code (FusionBench's ``regmean_plusplus``):

* Every tensor outside the repeated blocks — embeddings and their norm, final norms, a
  pooler, an untied ``lm_head`` — is averaged with the coefficients; task heads follow
  the ``heads`` policy (kept per model or dropped). Nothing after the last block is
  solved. (FusionBench's CLIP version starts its merged model from the pre-trained
  one and so keeps the pre-trained final norm and projection; without a pre-trained
  model here they are averaged like every other parameter outside the blocks.)
* Block ``l``, in order: every model ``i``'s own block ``l`` runs on model ``i``'s data,
  whose activations are those of the merged prefix (the averaged embeddings and the
  merged blocks ``< l``); forward pre-hooks on the block's linear modules collect the
  Grams of their inputs (:class:`lmdx.stats.collector.GramCollector`), so the sub-layers
  after the first see model ``i``'s own sub-layer outputs. Padding rows are left out by
  the attention mask, as in every lmdx collection (FusionBench's images have none).
* The block's linear weights are merged by RegMean with those Grams — ``Ĝ_i = G_i/n_i``,
  ``G̃_i = α Ĝ_i + (1−α) diag Ĝ_i``, solved for the deviation from the average
  (:func:`lmdx.merge.builtin.regmean.solve_step`, the plain RegMean solve) — and its
  other parameters averaged. The merged block (cast to the output dtype, as written)
  runs on every model's activations: its outputs are block ``l+1``'s inputs.

Blocks are found as the model's one ``ModuleList`` of identical modules that hold linear
layers: BERT/RoBERTa ``encoder.layer``, GPT-2 ``h``, Llama/Mistral/Qwen ``layers``. The
arguments the model passes its blocks (attention mask, rotary position embeddings, ...)
are captured once per batch by a pre-hook on block 0 and reused for every block; one
forward of model 0 on its first batch checks that every block gets the same arguments
and the previous block's output (models that pass per-block arguments, such as
alternating sliding-window masks, are refused rather than merged differently).

Cost: each block runs about twice per model and batch — model ``i``'s own block
(collecting its Grams) and the merged block (the next inputs) — plus one batch of model
0 per block to find which linear modules share an input, and one forward of model 0's
blocks on its first batch (the check above). Memory: the model skeleton holds no weights
(parameters on PyTorch's meta device); one block is loaded at a time from each model's
checkpoint (or state dict), the K models' Grams of one block are held, and the
activations: K × (tokens, padded) × hidden size in the models' dtype (plus each batch's
mask and position tensors). With ``max_activation_memory`` the batches whose
activations do not fit are recomputed from the merged prefix for every block instead:
block ``l`` then costs ``l`` more block forwards per recomputed batch, and the merged
blocks (one model's blocks) are kept in memory to recompute with.

This module is the block merger; the model skeleton and its blocks are
:mod:`lmdx.merge.skeleton`, the data :mod:`lmdx.merge.block_data`, how the model calls its
blocks :mod:`lmdx.merge.block_call`. Their public names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import MergeError
from .._tensors import to_torch
from .._util import matches, progress_bar
from ..config import resolve_threads
from ..stats.collector import GramCollector
from ..stats.file import Statistics
from ..stats.sites import find_linear_modules
from ..stats.stop import run_until_stopped, stop_forward
from .block_call import BlockCall, call_difference, hidden_of, same_value, tensor_bytes
from .block_data import activation_budget, prepare_batches
from .method import Step
from .options import MergeOptions
from .skeleton import Block, build_skeleton, find_blocks, model_blocks
from .source import TensorSource

__all__ = [
    "BlockMerger",
    "activation_budget",
    "build_skeleton",
    "find_blocks",
    "model_blocks",
    "prepare_batches",
]


class BlockMerger:
    """The activations and Grams RegMean++ merges with, one block at a time
    (:class:`lmdx.merge.builtin.regmean_plusplus.RegMeanPlusPlus` drives it).

    It is handed every merged tensor outside the blocks (:meth:`record`), then asked for
    the blocks in order: :meth:`grams` collects the K models' Grams of block ``l``'s
    linear modules on activations from the merged prefix (the method solves them);
    :meth:`finish` takes the whole merged block and runs it on the activations, which
    become block ``l+1``'s inputs.

    Parameters
    ----------
    sources
        The K models' tensors (checkpoints on disk or state dicts in memory), each with its
        Hugging Face configuration.
    blocks
        :func:`model_blocks` of the first model.
    batches
        Per model, its batches (:func:`prepare_batches`).
    options, labels
        The merge's options and model names.
    max_activation_memory
        Bytes of activations held between blocks; the batches beyond it are recomputed
        from the merged prefix for every block (None: hold them all).
    progress
        Show a progress bar over the blocks.
    """

    def __init__(
        self,
        sources: Sequence[TensorSource],
        blocks: Sequence[Block],
        batches: Sequence[Sequence[Mapping[str, Any]]],
        options: MergeOptions,
        labels: Sequence[str],
        *,
        max_activation_memory: int | None = None,
        progress: bool = True,
    ) -> None:
        self.sources, self.blocks, self.options = sources, list(blocks), options
        self.labels = list(labels)
        self.batches = [[dict(b) for b in model_batches] for model_batches in batches]
        self.budget = max_activation_memory
        self.progress = progress
        self.model = build_skeleton(sources[0].config, labels[0])
        self.prefix, self.stack = find_blocks(self.model)
        self.n_threads = resolve_threads(options.threads)
        self.outside: dict[str, Any] = {}  # merged tensors outside the blocks
        self.held: dict[tuple[int, int], tuple[Any, BlockCall]] = {}
        self.recomputed: list[tuple[int, int]] = []
        self.next = 0  # the block to merge next
        self.forwards = 0  # block forwards run
        self.prefix_forwards = 0  # runs of the model up to block 0
        self.held_bytes = 0
        self.held_batches = 0
        self._probe: GramCollector | None = None  # the groups found on this block
        self._probe_block = -1
        self._bar: Any = None

    # -- the engine's side ------------------------------------------------------------

    def record(self, name: str, tensor: Any) -> None:
        """A merged tensor outside the blocks (the prefix needs some of them)."""
        if self.next == 0:
            self.outside[name] = tensor

    def grams(self, step: Step) -> list[Statistics] | None:
        """Every model's Grams of block ``step.block``'s linear modules (all but the excluded
        ones), on its activations from the merged prefix; None when every linear module of
        the block is excluded."""
        index = step.block
        if index != self.next:
            raise MergeError(
                f"regmean_plusplus: block {index} asked for before block {self.next}; blocks "
                "are merged in order"
            )
        if index == 0:
            self._start()
        modules = self._modules(index)
        if not modules:
            return None
        return [self._grams(i, index, modules) for i in range(len(self.sources))]

    def finish(self, step: Step, merged: Mapping[str, Any]) -> None:
        """Take merged block ``step.block`` (every tensor of it) and run it on the
        activations: they become the next block's inputs."""
        index = step.block
        assert index == self.next
        block = self.stack[index]
        names = list(merged)
        self._assign(names, [merged[n] for n in names])
        if index + 1 < len(self.stack):
            import torch

            with torch.no_grad():
                for key, (hidden, call) in self.held.items():
                    self.held[key] = (call.run(block, hidden), call)
                    self.forwards += 1
        if not self.recomputed:  # nothing recomputes through this block later
            self._unassign(self._block_names(index))
        self.next += 1
        self._bar.update(1)
        if self.next == len(self.stack):
            self._bar.close()
            self.held.clear()
            self._unassign(list(self.outside))
            self.outside.clear()

    def summary(self) -> dict[str, Any]:
        """What the merge ran: blocks, batches held or recomputed, block forwards and runs
        of the model up to its first block."""
        return {
            "blocks": len(self.stack),
            "block_prefix": self.prefix,
            "batches": [len(b) for b in self.batches],
            "held_batches": self.held_batches,
            "recomputed_batches": len(self.recomputed),
            "activation_bytes_held": self.held_bytes,
            "block_forwards": self.forwards,
            "prefix_forwards": self.prefix_forwards,
        }

    # -- block 0's inputs -------------------------------------------------------------

    def _start(self) -> None:
        """Load the merged tensors outside the blocks, check how the model calls its
        blocks, and compute (or plan to recompute) every batch's input to block 0."""
        import torch

        names = [n for n in self.outside if not self._in_block(n)]
        self._assign(names, [self.outside[n] for n in names])
        self._check_wiring()
        with torch.no_grad():
            for i, model_batches in enumerate(self.batches):
                for j, batch in enumerate(model_batches):
                    hidden, call = self._prefix(batch)
                    size = tensor_bytes(hidden) + call.nbytes()
                    if self.budget is None or self.held_bytes + size <= self.budget:
                        self.held[(i, j)] = (hidden, call)
                        self.held_bytes += size
                        self.held_batches += 1
                    else:
                        self.recomputed.append((i, j))
        if not self.recomputed:  # the prefix is not needed again
            self._unassign(names)
            self.outside.clear()
        self._bar = progress_bar(len(self.stack), "RegMean++ blocks", self.progress, unit="block")

    def _prefix(self, batch: Mapping[str, Any]) -> tuple[Any, BlockCall]:
        """Run the merged prefix on ``batch``: block 0's input and call."""
        captured: dict[str, Any] = {}

        def grab(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured["call"] = BlockCall.capture(args, kwargs)
            stop_forward()

        handle = self.stack[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            self._forward(batch)
        finally:
            handle.remove()
        if "call" not in captured:
            raise MergeError(
                f"regmean_plusplus: {type(self.model).__name__}'s forward did not reach its "
                f"first block ({self.prefix}.0)"
            )
        hidden, call = captured["call"]
        return hidden, call

    def _forward(self, batch: Mapping[str, Any]) -> None:
        """The model's forward on ``batch``, until a hook stops it; a failure (e.g. a batch
        with keys the model does not take) as a :class:`MergeError`."""
        self.prefix_forwards += 1
        try:
            run_until_stopped(lambda: self.model(**batch))
        except MergeError:
            raise
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            raise MergeError(
                f"regmean_plusplus: running {type(self.model).__name__} on a batch failed: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc

    def _check_wiring(self) -> None:
        """Run model 0's blocks on its first batch, loaded one at a time, and check that
        every block gets block 0's arguments and the previous block's output."""
        import torch

        calls: list[tuple[Any, BlockCall]] = []
        outputs: list[Any] = []
        last = len(self.stack) - 1

        def before(index: int) -> Callable[..., None]:
            def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                self._assign_from(0, index)
                calls.append(BlockCall.capture(args, kwargs))

            return hook

        def after(index: int) -> Callable[..., None]:
            def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
                outputs.append(hidden_of(output))
                self._unassign(self._block_names(index))
                self.forwards += 1
                if index == last:
                    stop_forward()

            return hook

        handles = []
        for index, block in enumerate(self.stack):
            handles.append(block.register_forward_pre_hook(before(index), with_kwargs=True))
            handles.append(block.register_forward_hook(after(index)))
        try:
            with torch.no_grad():
                self._forward(self.batches[0][0])
        finally:
            for h in handles:
                h.remove()
            for index in range(len(self.stack)):
                self._unassign(self._block_names(index))
        cls = type(self.model).__name__
        if len(outputs) != len(self.stack):
            raise MergeError(
                f"regmean_plusplus: {cls} ran {len(outputs)} of its {len(self.stack)} blocks "
                f"({self.prefix}) once each on a batch; it merges models that run each block once"
            )
        for index in range(1, len(calls)):
            hidden, call = calls[index]
            if not same_value(hidden, outputs[index - 1]):
                raise MergeError(
                    f"regmean_plusplus: in {cls}, block {index}'s input is not block "
                    f"{index - 1}'s output; this architecture is not supported"
                )
            differs = call_difference(call, calls[0][1])
            if differs is not None:
                raise MergeError(
                    f"regmean_plusplus: {cls} passes block {index} a different {differs} than "
                    "block 0 (a per-block argument, e.g. a sliding-window mask); merging it "
                    "block by block would run the blocks unlike the model, so it is not "
                    "supported"
                )

    # -- Grams ------------------------------------------------------------------------

    def _modules(self, index: int) -> dict[str, tuple[Any, str]]:
        """Block ``index``'s linear modules RegMean solves (full names): all but the
        excluded ones."""
        name = self.blocks[index].prefix
        return {
            f"{name}.{n}": v
            for n, v in find_linear_modules(self.stack[index]).items()
            if not matches(f"{name}.{n}", self.options.exclude)
        }

    def _grams(self, i: int, index: int, modules: Mapping[str, tuple[Any, str]]) -> Statistics:
        """Model ``i``'s Grams of ``modules`` (of block ``index``) on its activations from
        the merged prefix."""
        import torch

        name = self.blocks[index].prefix
        block = self.stack[index]
        self._assign_from(i, index)
        collector = GramCollector(
            modules,
            include_padding=False,
            share_inputs=True,
            mask_key="attention_mask",
            n_threads=self.n_threads,
        )
        label = self.labels[i]
        try:
            with torch.no_grad():
                if self._probe is None or self._probe_block != index:
                    hidden, call = self._input(i, 0, index)
                    collector.probe(lambda: call.run(block, hidden))
                    self.forwards += 1
                    self._probe, self._probe_block = collector, index
                else:
                    collector.adopt_groups(self._probe)
                with collector.hooks():
                    for j, batch in enumerate(self.batches[i]):
                        hidden, call = self._input(i, j, index)
                        collector.start_batch(batch)
                        call.run(block, hidden)
                        self.forwards += 1
                        collector.end_batch()
            return collector.take_statistics(
                {"architecture": type(self.model).__name__, "parameters": {}},
                data=f"{label}: block {name} on the merged prefix",
            )
        except (ValueError, RuntimeError) as exc:
            raise MergeError(f"{label}, block {name}: {exc}") from None
        finally:
            self._unassign(self._block_names(index))

    def _input(self, i: int, j: int, index: int) -> tuple[Any, BlockCall]:
        """Model ``i``'s batch ``j`` at block ``index``'s input: held, or recomputed from
        the merged prefix and the merged blocks before ``index``."""
        held = self.held.get((i, j))
        if held is not None:
            return held
        hidden, call = self._prefix(self.batches[i][j])
        for m in range(index):
            hidden = call.run(self.stack[m], hidden)
            self.forwards += 1
        return hidden, call

    # -- tensors in and out of the skeleton -------------------------------------------

    def _in_block(self, name: str) -> bool:
        return name.startswith(f"{self.prefix}.")

    def _block_names(self, index: int) -> list[str]:
        prefix = self.blocks[index].prefix
        return [f"{prefix}.{k}" for k in self.stack[index].state_dict()]

    def _assign_from(self, i: int, index: int) -> None:
        """Model ``i``'s block ``index`` into the skeleton."""
        source = self.sources[i]
        names = self._block_names(index)
        self._assign(names, [_as_torch(source, n) for n in names])

    def _assign(self, names: Sequence[str], tensors: Sequence[Any]) -> None:
        import torch

        for name, value in zip(names, tensors, strict=True):
            tensor = to_torch(value)  # merged tensors are NumPy arrays
            module_name, _, attr = name.rpartition(".")
            try:
                module = self.model.get_submodule(module_name)
            except AttributeError:
                continue  # not part of this class (e.g. a tensor of another head class)
            if attr in module._parameters:
                setattr(module, attr, torch.nn.Parameter(tensor.detach(), requires_grad=False))
            elif attr in module._buffers:
                setattr(module, attr, tensor.detach())

    def _unassign(self, names: Sequence[str]) -> None:
        """Put tensors ``names`` of the skeleton back on the meta device (no memory)."""
        import torch

        state = self.model.state_dict(keep_vars=True)
        self._assign(
            [n for n in names if n in state],
            [torch.empty_like(state[n], device="meta") for n in names if n in state],
        )


def _as_torch(source: TensorSource, name: str) -> Any:
    """Tensor ``name`` of ``source`` as a torch tensor in its stored dtype."""
    return to_torch(source.read(name))
