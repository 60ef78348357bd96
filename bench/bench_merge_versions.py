"""One lmdx version against another: the in-memory RegMean merge (``lmdx.merge_models``)
of three BERT models (hidden 768, 4 layers, built from a config and perturbed by seeded
noise) with Gram statistics collected in the same process (48 sequences of 96 tokens,
70 real). Prints the lmdx it imported, the merge seconds and a SHA-256 of the merged
tensors per α (equal hashes: bit-identical merges), and the peak RSS. Run it alternately
with two installations to compare them, e.g.::

    for i in 1 2 3; do
      PYTHONPATH=/path/to/old/site python bench/bench_merge_versions.py
      PYTHONPATH=python python bench/bench_merge_versions.py
    done

It uses only API both versions have (``collect_regmean_stats``, ``merge_models``).
"""

import hashlib
import resource
import time

import lmdx
import torch
import transformers

torch.manual_seed(0)
torch.set_num_threads(2)
cfg = transformers.BertConfig(
    hidden_size=768,
    num_hidden_layers=4,
    num_attention_heads=12,
    intermediate_size=3072,
    vocab_size=8000,
    max_position_embeddings=128,
)
base = transformers.BertModel(cfg).eval()
models = []
for seed in (1, 2, 3):
    m = transformers.BertModel(cfg).eval()
    m.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    models.append(m)
stats = []
for i, m in enumerate(models):
    g = torch.Generator().manual_seed(10 + i)
    ids = torch.randint(5, 8000, (48, 96), generator=g)
    mask = torch.ones_like(ids)
    mask[:, 70:] = 0
    batches = [
        {"input_ids": ids[j : j + 16], "attention_mask": mask[j : j + 16]} for j in range(0, 48, 16)
    ]
    stats.append(lmdx.collect_regmean_stats(m, batches, progress=False))
out = []
for alpha in (0.9, 0.1):
    t0 = time.perf_counter()
    r = lmdx.merge_models(models, "regmean", stats=stats, alpha=alpha, progress=False)
    dt = time.perf_counter() - t0
    h = hashlib.sha256()
    for n in sorted(r.state_dict):
        h.update(r.state_dict[n].contiguous().numpy().tobytes())
    out.append(f"alpha {alpha}: {dt:.2f} s sha {h.hexdigest()[:12]}")
print(
    lmdx.__file__.split("/lmdx/")[0],
    "|",
    " | ".join(out),
    f"| peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB",
)
