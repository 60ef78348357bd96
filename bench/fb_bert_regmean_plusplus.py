"""FusionBench's RegMean++ loop (``RegMeanAlgorithmPlusPlus.run``) on BERT encoders.

FusionBench 0.2.33 ships the hooks of its RegMean++ for CLIP's vision tower only; this
subclass gives the same hooks for ``BertModel``, modelled on that CLIP subclass: the
embeddings averaged, each task's batches run through the merged embeddings, per encoder
layer the inputs of its linear modules collected into running-mean Grams by forward hooks,
``merging_with_regmean_weights`` per layer, the merged layer run on to give the next
layer's inputs. Batches without padding (the hooks, as FusionBench's, see every row).
Used by ``bench_methods_speed.py``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from fusion_bench.method.regmean_plusplus.regmean_plusplus import RegMeanAlgorithmPlusPlus
from fusion_bench.modelpool import BaseModelPool


class BertRegMeanPlusPlus(RegMeanAlgorithmPlusPlus):
    """The CLIP subclass's hooks, for ``BertModel``."""

    def get_regmean_weights(self, model_name, layer, batches_input, linear_modules_to_merge):
        grams: dict[str, torch.Tensor] = {}
        rows: dict[str, int] = {}

        def hook_for(name: str) -> Any:
            def hook(module: Any, inputs: tuple, output: Any) -> None:
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
                xtx = x.T @ x
                if name not in grams:
                    grams[name], rows[name] = xtx / x.shape[0], x.shape[0]
                else:  # FusionBench's running mean
                    grams[name] = (grams[name] * rows[name] + xtx) / (rows[name] + x.shape[0])
                    rows[name] += x.shape[0]

            return hook

        handles = [m.register_forward_hook(hook_for(n)) for n, m in linear_modules_to_merge.items()]
        self.layer_batches_forward(layer, batches_input)
        for h in handles:
            h.remove()
        return grams

    def merge_embedding_layer(self, models_to_merge_dict):
        params: dict[str, list[torch.Tensor]] = defaultdict(list)
        for model in models_to_merge_dict.values():
            for name, p in model.state_dict().items():
                if name.startswith("embeddings."):
                    params[name].append(p)
        return {n: torch.stack(ps).mean(dim=0) for n, ps in params.items()}

    def get_input_for_first_layer(self, model, train_dataset):
        return [model.embeddings(input_ids=b["input_ids"]).detach() for b in train_dataset]

    def get_layers(self, model):
        return model.encoder.layer

    def update_merged_params_dict(self, merged_params_dict, new_merged_params, layer_idx):
        for key, value in new_merged_params.items():
            merged_params_dict[f"encoder.layer.{layer_idx}.{key}"] = value
        return merged_params_dict

    def layer_batches_forward(self, layer, batches_input):
        out = []
        for x in batches_input:
            y = layer(x)
            out.append((y[0] if isinstance(y, tuple) else y).detach())
        return out


def bert_regmean_plusplus(
    models: dict[str, Any], data: dict[str, list[dict[str, torch.Tensor]]], alpha: float
) -> Any:
    """FusionBench's RegMean++ of the models in ``models`` ("_pretrained_" and the tasks),
    task ``name`` on the batches ``data[name]``."""
    pool = BaseModelPool(models)
    pool.load_train_dataset = lambda name: data[name]
    algorithm = BertRegMeanPlusPlus(
        num_regmean_examples=10**9,
        exclude_param_names_regex=[],
        reduce_non_diagonal_ratio=alpha,
        weight_transpose=True,
    )
    with torch.no_grad():
        return algorithm.run(pool)
