"""End-to-end example of lmdx's core: RegMean-merge three fine-tuned copies of a model.

A small torch MLP is "pre-trained", then fine-tuned separately on three regression tasks
whose inputs live in different parts of the input space. lmdx collects each model's
per-layer input statistics (float64 Gram matrices) with forward hooks, then merges the
three models layer by layer with RegMean and, for comparison, with a plain average.
Every merged model is scored on every task (mean squared error, lower is better).

Run:  python examples/core_demo.py        (12 s measured on the idle 2-core machine)
"""

from __future__ import annotations

import copy
import time

import lmdx
import numpy as np
import torch
from torch import nn

D_IN, D_HIDDEN, D_OUT = 32, 128, 8
N_TASKS, N_TRAIN, N_TEST = 3, 4096, 2048


def make_task(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs concentrated on their own block of features; a random nonlinear teacher."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.full((D_IN,), 0.1)
    block = D_IN // N_TASKS
    scale[seed * block : (seed + 1) * block] = 1.0
    teacher = nn.Sequential(nn.Linear(D_IN, 64), nn.Tanh(), nn.Linear(64, D_OUT))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        x = torch.randn(N_TRAIN + N_TEST, D_IN, generator=g) * scale
        y = teacher(x)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def fine_tune(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 600) -> nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (256,))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def linear_input_moments(model: nn.Module, x: torch.Tensor) -> dict[str, lmdx.Moments]:
    """Gram statistics of every nn.Linear's input, via forward hooks."""
    stats: dict[str, lmdx.Moments] = {}
    hooks = []

    def make_hook(name: str):  # a forward hook must return None to keep the output
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], _output: object) -> None:
            stats[name].update(inputs[0])

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            stats[name] = lmdx.Moments(module.in_features)
            hooks.append(module.register_forward_hook(make_hook(name)))
    with torch.no_grad():
        for batch in x.split(1024):
            model(batch)
    for h in hooks:
        h.remove()
    return stats


def merge(models: list[nn.Module], stats: list[dict[str, lmdx.Moments]] | None) -> nn.Module:
    """RegMean for Linear weights when stats are given, else plain averaging everywhere."""
    merged = copy.deepcopy(models[0])
    states = [m.state_dict() for m in models]
    new_state = {}
    for key in states[0]:
        module_name, _, param = key.rpartition(".")
        if stats is not None and param == "weight" and module_name in stats[0]:
            result = lmdx.regmean_merge_layer(
                [s[module_name] for s in stats], [st[key] for st in states], name=module_name
            )
            value = result.weight
        else:
            value = lmdx.weighted_average([st[key] for st in states])
        new_state[key] = torch.from_numpy(value).to(states[0][key].dtype)
    merged.load_state_dict(new_state)
    return merged


def main() -> None:
    torch.manual_seed(0)
    tasks = [make_task(i) for i in range(N_TASKS)]
    base = nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))
    all_x = torch.cat([t[0] for t in tasks])
    all_y = torch.cat([t[1] for t in tasks])
    base = fine_tune(base, all_x, all_y, steps=200)  # the shared "pre-trained" checkpoint

    start = time.perf_counter()
    experts = [fine_tune(base, x, y) for x, y, _, _ in tasks]
    print(f"fine-tuned {N_TASKS} models in {time.perf_counter() - start:.1f} s")

    start = time.perf_counter()
    stats = [linear_input_moments(m, x) for m, (x, _, _, _) in zip(experts, tasks, strict=False)]
    print(f"collected Gram statistics in {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    candidates = {
        "pre-trained": base,
        **{f"expert {i}": m for i, m in enumerate(experts)},
        "average": merge(experts, None),
        "regmean": merge(experts, stats),
    }
    print(f"merged in {time.perf_counter() - start:.2f} s\n")

    header = "".join(f"{'task ' + str(i):>10}" for i in range(N_TASKS))
    print(f"{'test MSE':<12}{header}{'mean':>10}")
    for label, model in candidates.items():
        with torch.no_grad():
            losses = [nn.functional.mse_loss(model(xt), yt).item() for _, _, xt, yt in tasks]
        row = "".join(f"{v:>10.4f}" for v in losses)
        print(f"{label:<12}{row}{np.mean(losses):>10.4f}")
    lmdx.show_config()


if __name__ == "__main__":
    main()
