"""Text tokenizers as HF `tokenizers` objects, from tokenizer.json or from GGUF metadata.

In shared/: the tokenizer service, the engine-worker (response formats need the vocabulary)
and the in-process engine all load the same one.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from tokenizers import Tokenizer, decoders

from shared.chat_template import render_chat_template
from shared.errors import KvmeshError, Reason
from shared.gguf_metadata import read_gguf_metadata
from shared.gguf_tokenizer import BYTE_OF_CHAR, SPACE_MARK, adds_bos, tokenizer_from_gguf
from shared.prompt_bound import check_length, longest_token_bytes
from shared.special_text import CLOSE, OPEN, fence, pieces, special_pattern
from shared.tool_prompt import renders_tools, with_tool_prompt

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TextTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        added = tokenizer.get_added_tokens_decoder().values()
        self._special = special_pattern(token.content for token in added if token.special)
        # The same vocabulary with special-token strings read as text: a chat's own strings.
        self._as_text = Tokenizer.from_str(tokenizer.to_str())
        self._as_text.encode_special_tokens = True
        self.longest_token_bytes = longest_token_bytes(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_tokens: int = 0
    ) -> list[int]:
        """With `max_tokens`, a text that certainly has more is refused PROMPT_TOO_LONG before
        it is encoded whole (prompt_bound.py)."""
        check_length(self.tokenizer, text, max_tokens, self.longest_token_bytes)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's own bytes, as logprobs show a token alone: possibly part of a UTF-8
        character, which decoding it alone would turn into U+FFFD."""
        added = self.tokenizer.get_added_tokens_decoder()
        pieces = []
        for token_id in token_ids:
            token = self.tokenizer.id_to_token(token_id)
            if token is None:
                pieces.append(b"")
            elif token_id in added:
                pieces.append(token.encode())
            elif self._byte_level:
                pieces.append(bytes(BYTE_OF_CHAR.get(char, 0x3F) for char in token))
            elif _BYTE_TOKEN.fullmatch(token):  # SentencePiece's byte fallback, <0xE2>
                pieces.append(bytes([int(token[3:5], 16)]))
            else:  # its visible spaces as spaces, a leading one kept (decode strips it)
                pieces.append(token.replace(SPACE_MARK, " ").encode())
        return pieces

    @property
    def _byte_level(self) -> bool:
        return isinstance(self.tokenizer.decoder, decoders.ByteLevel)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        max_tokens: int = 0,
    ) -> list[int]:
        """Token ids of a chat as the model expects it: the template writes any BOS itself,
        and only the template writes control tokens (special_text.py)."""
        if self._special is None:
            rendered = self.apply_chat_template(messages, tools)
            return self.encode(rendered, add_special_tokens=False, max_tokens=max_tokens)
        rendered = self.apply_chat_template(
            fence(messages, self._special), fence(tools, self._special) if tools else None
        )
        if max_tokens:
            unfenced = rendered.replace(OPEN, "").replace(CLOSE, "")
            check_length(self.tokenizer, unfenced, max_tokens, self.longest_token_bytes)
        ids: list[int] = []
        for piece, plain in pieces(rendered):
            encoder = self._as_text if plain else self.tokenizer
            ids += encoder.encode(piece, add_special_tokens=False).ids
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat as text. `tools` (OpenAI function specs) go to a template that renders
        them; for one that does not, kvmesh's tool prompt rewrites the messages."""
        if not self.chat_template:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, "this model has no chat template; send a prompt"
            )
        if not renders_tools(self.chat_template):
            messages, tools = with_tool_prompt(messages, tools or []), None
        return render_chat_template(
            self.chat_template,
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def load_tokenizer(path: str) -> TextTokenizer | None:
    """The artifact's tokenizer, or None when it ships none (token-id input still works)."""
    if os.path.isdir(path):
        return _from_hf_directory(path)
    return _from_gguf(path)


def _from_hf_directory(directory: str) -> TextTokenizer | None:
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        return None
    config: dict[str, Any] = {}
    config_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_file):
        with open(config_file, encoding="utf-8") as handle:
            config = json.load(handle)

    def token_text(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    return TextTokenizer(
        Tokenizer.from_file(tokenizer_file),
        chat_template=_chat_template(directory, config.get("chat_template")),
        bos_token=token_text(config.get("bos_token")),
        eos_token=token_text(config.get("eos_token")),
        add_bos=bool(config.get("add_bos_token", False)),
    )


def _chat_template(directory: str, configured: Any) -> str | None:
    """transformers keeps the template in tokenizer_config.json (a string, or a list of named
    templates) or, since 4.43, in chat_template.jinja beside it."""
    if isinstance(configured, list):
        named = {t.get("name"): t.get("template") for t in configured if isinstance(t, dict)}
        configured = named.get("default")
    if isinstance(configured, str):
        return configured
    template_file = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(template_file):
        with open(template_file, encoding="utf-8") as handle:
            return handle.read()
    return None


def _from_gguf(path: str) -> TextTokenizer | None:
    metadata = read_gguf_metadata(path)
    tokenizer = tokenizer_from_gguf(metadata)
    if tokenizer is None:
        return None  # no vocabulary, or a kind not built here (token-id input still works)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    return TextTokenizer(
        tokenizer,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos=adds_bos(metadata),
    )
