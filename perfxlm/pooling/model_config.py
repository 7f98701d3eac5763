"""How a model pools, decided once at load: pooling type, normalization, Matryoshka dimensions, the tasks
it serves and its window.

Sources, first wins: the user's `pooler_config` (vLLM's name: {"pooling_type", "normalize"}), the
checkpoint's sentence-transformers files (`modules.json` naming a Pooling module whose `config.json` says
CLS / mean / last token, Dense modules after it (`dense.py`), a Normalize module last,
`sentence_bert_config.json`'s max_seq_length or, as version 6 saves it, the tokenizer's model_max_length),
then the
model's kind (an encoder pools its [CLS] token; a causal LM its last token, normalized, as vLLM does).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from perfxlm.pooling.dense import SENTENCE_EMBEDDING, DenseStack

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")

# sentence-transformers' Pooling config keys -> pooling type
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# sentence-transformers 6 writes one `pooling_mode` string instead
_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str
    normalize: bool  # embeddings' default (a request's `normalize` overrides it)
    hidden_size: int
    num_labels: int  # a classification head's labels; 0: an embedder
    max_len: int  # the longest input, in tokens
    matryoshka_dimensions: tuple[int, ...] | None  # the `dimensions` the model allows (None: any, or none)
    is_matryoshka: bool
    # sentence-transformers Dense modules between pooling and normalization (hidden_size is their output)
    dense: DenseStack | None = field(default=None, compare=False, repr=False)

    @property
    def tasks(self) -> frozenset[str]:
        if self.num_labels:
            # a cross-encoder scores pairs; per-token states make no sense through a classifier
            return frozenset({"classify", "encode"} | ({"score"} if self.num_labels == 1 else set()))
        return frozenset({"embed", "score", "encode", "token_embed", "reward"})

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError(
                "dimensions: this model does not support Matryoshka representations (its config declares "
                "no is_matryoshka / matryoshka_dimensions); leave dimensions unset."
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions: this model supports {list(self.matryoshka_dimensions)}, got {dimensions}.")
        if dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's hidden size {self.hidden_size}, got {dimensions}."
            )


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sentence_transformers_pooling(folder: str) -> dict[str, Any]:
    """{"pooling_type", "normalize", "max_seq_length"} as far as the folder's sentence-transformers files
    say (empty for a plain checkpoint). ValueError for modules the pooling runner cannot reproduce."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isdir(folder) or not os.path.isfile(modules_path):
        return {}
    found: dict[str, Any] = {"normalize": False}
    for module in _read_json(modules_path):
        kind = str(module.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        if found["normalize"]:  # Normalize ends what the pooling runner reproduces
            raise ValueError(f"sentence-transformers module {kind!r} after Normalize is not supported by the pooling "
                             "runner.")
        if name == "Dense":
            if "pooling_type" not in found:
                raise ValueError("a sentence-transformers Dense module before Pooling (over token embeddings) is not "
                                 "supported: the pooling runner applies Dense layers to the pooled embedding.")
            found.setdefault("dense", []).append(os.path.join(folder, module.get("path", "")))
        elif name == "Pooling":
            config = _read_json(os.path.join(folder, module.get("path", ""), "config.json"))
            bad = [k for k in _ST_UNSUPPORTED if config.get(k)]
            modes = [t for k, t in _ST_MODES.items() if config.get(k)]
            mode = config.get("pooling_mode")
            if isinstance(mode, str):
                modes.append(_ST_MODE_NAMES.get(mode, mode))
                bad += [mode] if mode not in _ST_MODE_NAMES else []
            if bad or len(modes) != 1:
                raise ValueError(
                    f"sentence-transformers pooling {bad or modes} is not supported: the pooling runner pools "
                    "one of CLS, mean or last token."
                )
            found["pooling_type"] = modes[0]
        elif name == "Normalize":
            _check_normalize(os.path.join(folder, module.get("path", "")))
            found["normalize"] = True
        elif name not in ("Transformer", "Pooling"):
            raise ValueError(f"sentence-transformers module {kind!r} is not supported by the pooling runner.")
    bert_config = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(bert_config):
        length = _read_json(bert_config).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            found["max_seq_length"] = length
    return found


def _check_normalize(path: str) -> None:
    """Normalize over the sentence embedding (the default) is the embedding head's; over token embeddings
    (multi-vector models) it is not."""
    config_path = os.path.join(path, "config.json")
    config = _read_json(config_path) if path and os.path.isfile(config_path) else {}
    if config.get("module_input_name", SENTENCE_EMBEDDING) != SENTENCE_EMBEDDING:
        raise ValueError(f"sentence-transformers Normalize over {config['module_input_name']!r} is not supported: "
                         "the pooling runner normalizes the sentence embedding.")


def resolve_pooler_config(model: Any, hf_config: Any, folder: str, max_model_len: int,
                          override: dict[str, Any] | None, tokenizer: Any = None) -> PoolerConfig:
    from perfxlm.model.models.base import EncoderModel

    encoder = isinstance(model, EncoderModel)
    st = sentence_transformers_pooling(folder)
    pooling_type = getattr(model, "default_pooling_type", "LAST")  # a causal LM pools its last token
    pooling_type = st.get("pooling_type", pooling_type)
    normalize = st.get("normalize", True)
    if override is not None and not isinstance(override, dict):  # an object with vLLM's attribute names
        override = {k: getattr(override, k) for k in ("pooling_type", "normalize") if hasattr(override, k)}
    override = dict(override or {})
    unknown = sorted(set(override) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {', '.join(unknown)}; it takes pooling_type and normalize.")
    if override.get("pooling_type") is not None:
        pooling_type = str(override["pooling_type"]).upper()
    if override.get("normalize") is not None:
        normalize = bool(override["normalize"])
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}.")
    max_len = max_model_len
    if encoder:
        max_len = min(max_len, model.max_positions())
    if "max_seq_length" in st:
        max_len = min(max_len, st["max_seq_length"])
    elif st and tokenizer is not None:
        # sentence-transformers 6 keeps max_seq_length as the tokenizer's model_max_length (ordinary
        # tokenizers hold 512 or a 1e30 sentinel there, hence only for its folders)
        limit = getattr(tokenizer, "model_max_length", None)
        if isinstance(limit, int) and 0 < limit < max_len:
            max_len = limit
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    dense = DenseStack.load(st["dense"], int(hf_config.hidden_size)) if st.get("dense") else None
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        hidden_size=dense.out_features if dense is not None else int(hf_config.hidden_size),
        num_labels=int(getattr(model, "num_labels", 0) or 0),
        max_len=int(max_len),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
        dense=dense,
    )
