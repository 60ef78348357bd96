"""``lmdx stats ADAPTER --base BASE`` and ``lmdx merge`` of LoRA adapters, end to end on a
tiny BERT classifier with a word-piece tokenizer (nothing downloaded).

The reference Gram is computed here: forward hooks on PEFT's own merge of base and
adapter (``merge_and_unload``), texts tokenized one at a time, in float64.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lmdx.cli import main
from lmdx.files.peft import LoraAdapter
from lmdx.stats import Statistics
from tiny_bert import WORDS, build_tiny_bert
from transformers import AutoTokenizer, BertForSequenceClassification

peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

K = 2
MODULE = "bert.encoder.layer.1.attention.self.query"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora-cli")
    tiny = build_tiny_bert(root / "tiny")
    torch.manual_seed(1)
    base = BertForSequenceClassification.from_pretrained(str(tiny), num_labels=2)
    base.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(root / "base")
    for i in range(K):
        config = LoraConfig(r=2 + i, lora_alpha=4, target_modules=["query", "value"],
                            task_type="SEQ_CLS")  # fmt: skip
        model = get_peft_model(copy.deepcopy(base), config)
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.2 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(root / f"adapter{i}")
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(2, 12))) for _ in range(24)]
    (root / "texts.txt").write_text("\n".join(texts) + "\n")
    return root


def _stats_argv(root: Path, i: int, *extra: str) -> list[str]:
    return ["stats", str(root / f"adapter{i}"), str(root / "texts.txt"), "--batch-size", "8",
            "--out", str(root / f"s{i}.safetensors"), "--no-progress", *extra]  # fmt: skip


def test_stats_of_an_adapter_need_its_base(workspace, capsys):
    assert main(_stats_argv(workspace, 0)) == 2
    assert "a LoRA adapter folder; give --base FOLDER" in capsys.readouterr().err
    assert not (workspace / "s0.safetensors").exists()


def test_stats_and_merge_of_adapters(workspace, tmp_path):
    from peft import PeftModel

    for i in range(K):
        assert main(_stats_argv(workspace, i, "--base", str(workspace / "base"))) == 0
    stats = Statistics.load(workspace / "s0.safetensors")
    adapter = LoraAdapter.load(workspace / "adapter0")
    assert stats.model["adapter"]["sha256"] == adapter.identity()["sha256"]
    # the Gram of the adapted model's inputs, over real tokens
    base = BertForSequenceClassification.from_pretrained(str(workspace / "base"))
    merged = PeftModel.from_pretrained(base, str(workspace / "adapter0")).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(str(workspace / "base"))
    rows: list[np.ndarray] = []
    hook = merged.get_submodule(MODULE).register_forward_pre_hook(
        lambda m, args: rows.append(args[0].detach().double().reshape(-1, 32).numpy())
    )
    with torch.no_grad():
        for text in (workspace / "texts.txt").read_text().splitlines():
            merged.eval()(**tokenizer(text, return_tensors="pt"))
    hook.remove()
    x = np.concatenate(rows)
    assert stats.count(MODULE) == x.shape[0]
    assert np.abs(stats.gram(MODULE) - x.T @ x).max() <= 1e-5 * np.abs(x.T @ x).max()

    lines = [f"base: {workspace / 'base'}", "method: regmean", "alpha: 0.9", "models:"]
    for i in range(K):
        adapter, stats_file = workspace / f"adapter{i}", workspace / f"s{i}.safetensors"
        lines.append(f"  - {{adapter: {adapter}, stats: {stats_file}}}")
    lines += ["heads: {patterns: ['classifier.*']}", "output: {lora_rank: 8}"]
    (tmp_path / "merge.yaml").write_text("\n".join(lines) + "\n")
    out = tmp_path / "merged"
    assert main(["merge", str(tmp_path / "merge.yaml"), "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["lora"]["relative_error"] < 1e-6  # rank 8 >= 2 + 3: the update itself
    assert all(v.get("low_rank", 0) >= 0 for v in record["report"]["layers"].values())
    assert any(v.get("low_rank", 0) > 0 for v in record["report"]["layers"].values())
    assert (out / "vocab.txt").is_file() or (out / "tokenizer.json").is_file()
    # the written LoRA over the base gives the written merged model
    loaded = BertForSequenceClassification.from_pretrained(str(out)).eval()
    base = BertForSequenceClassification.from_pretrained(str(workspace / "base"))
    adapted = PeftModel.from_pretrained(base, str(out / "lora")).merge_and_unload().eval()
    batch = tokenizer(["the cat sat", "a big red dog ran fast"], padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = loaded(**batch).logits, adapted(**batch).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
