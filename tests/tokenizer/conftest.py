"""The default model's tokenizer, loaded once for the tokenizer tests."""

from __future__ import annotations

import pytest

from shared.text_tokenizer import TextTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(default_model_path: str) -> TextTokenizer:
    loaded = load_tokenizer(default_model_path)
    assert loaded is not None
    return loaded
