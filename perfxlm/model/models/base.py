"""What every causal LM shares: loading checkpoint tensors by name table, and the forward contract.

A model file declares `stacked_params` (checkpoint names that go into a fused parameter) and
`skip_prefixes`; the loader hands it (hf_name, tensor) pairs and nothing model-specific.
"""

from __future__ import annotations

from typing import ClassVar, Iterable

import torch
from torch import nn


class CausalLM(nn.Module):
    # (fused param fragment, checkpoint fragment, shard name) e.g. (".qkv_proj", ".q_proj", "q")
    stacked_params: ClassVar[list[tuple[str, str, str]]] = []
    # checkpoint tensors to ignore (e.g. precomputed rotary tables)
    skip_substrings: ClassVar[list[str]] = ["rotary_emb.inv_freq"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden] final hidden states."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32."""
        raise NotImplementedError

    def tied_param_names(self) -> set[str]:
        return set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if any(s in name for s in self.skip_substrings):
                continue
            for fused, original, shard in self.stacked_params:
                if original in name:
                    target = name.replace(original, fused)
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in the model ({target!r})")
                    module = modules[target.rsplit(".", 1)[0]]
                    module.load_shard(params[target], tensor, shard)  # type: ignore[operator]
                    loaded.add(f"{target}:{shard}")
                    break
            else:
                if name not in params:
                    if name in self.tied_param_names():
                        continue  # checkpoint stores the tied head too; it is the embedding
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        missing = self._expected_loads() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _expected_loads(self) -> set[str]:
        expected: set[str] = set()
        modules = dict(self.named_modules())
        tied = self.tied_param_names()
        for name, _ in self.named_parameters():  # duplicates (tied) removed
            module = modules[name.rsplit(".", 1)[0]]
            shards = getattr(module, "output_sizes", None)
            if shards is not None and name.endswith(".weight"):
                expected.update(f"{name}:{s}" for s in shards)
            elif shards is not None and name.endswith(".bias"):
                expected.update(f"{name}:{s}" for s in shards)
            elif name not in tied:
                expected.add(name)
        return expected
