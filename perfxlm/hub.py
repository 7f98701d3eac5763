"""Model ids (`HuggingFaceTB/SmolLM2-135M-Instruct`) resolved through the Hugging Face cache, as vLLM does:
HF_HOME / HF_HUB_CACHE (or download_dir) say where, `revision` which commit; a cached snapshot loads
without a network, a missing one is downloaded with huggingface_hub where a network allows, and with
HF_HUB_OFFLINE=1 (or no network) a missing model fails naming the cache it looked in.
`org/name/file.gguf` fetches one GGUF file of a repository."""

from __future__ import annotations

import os
import re

# what the loaders read: weights, configs, tokenizers, templates (never .bin / .pth / ONNX copies)
_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) or (model.endswith(".gguf") and model.count("/") >= 2
                                           and not model.startswith(("/", ".", "~")))


def _offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in (
        "1", "ON", "YES", "TRUE")


def cache_dir(download_dir: str | None = None) -> str:
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local folder or file for `model`; ValueError saying where it looked when there is none."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        if revision not in (None, "main") and f"{os.sep}snapshots{os.sep}" not in os.path.abspath(path):
            raise ValueError(f"revision={revision!r} selects a Hugging Face Hub commit, but {model!r} is a local "
                             "path: check out that revision there, or pass the model id.")
        return path
    if not looks_like_repo_id(model):
        raise ValueError(f"Model path {model!r} does not exist: pass a Hugging Face model folder, a .gguf file or "
                         "a Hugging Face model id (org/name).")
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ValueError(f"{model!r} is not a local path, and huggingface_hub is not installed to fetch it.") from None
    where = cache_dir(download_dir)
    offline = _offline()
    try:
        if model.endswith(".gguf") and model.count("/") >= 2:
            org, name, filename = model.split("/", 2)
            return hf_hub_download(f"{org}/{name}", filename, revision=revision, cache_dir=where,
                                   local_files_only=offline)
        return snapshot_download(model, revision=revision, cache_dir=where, allow_patterns=_PATTERNS,
                                 local_files_only=offline)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise ValueError(f"{model!r}{f' at revision {revision!r}' if revision else ''} could not be fetched from "
                         f"the Hugging Face Hub: {type(exc).__name__} (private or gated models need HF_TOKEN).") from None
    except (LocalEntryNotFoundError, OSError, Exception) as exc:  # noqa: BLE001 - offline, no network, HTTP errors
        why = "HF_HUB_OFFLINE is set" if offline else f"it could not be downloaded ({type(exc).__name__})"
        raise ValueError(f"{model!r} is not in the Hugging Face cache at {where} and {why}: download it where a "
                         f"network is reachable (huggingface-cli download {model}) or pass a local folder.") from None
