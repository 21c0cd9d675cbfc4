"""A BERT-family sentence encoder (all-MiniLM-L6-v2 and kin): token ids in, one vector out.

Read from a sentence-transformers directory: `config.json` and `model.safetensors` (the BERT
weights), `tokenizer.json` (WordPiece, with the [CLS] ... [SEP] template), `modules.json`
(whether vectors are L2-normalized), `1_Pooling/config.json` (mean or CLS pooling) and
`sentence_bert_config.json` (the longest input). Every input of a batch is padded to the
longest and masked, so a vector does not depend on what it was batched with.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer

from shared.errors import KvmeshError, ModelValidationError, Reason


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_length: int  # inputs are cut to this many tokens ([CLS] and [SEP] included)
    pooling: str  # "mean" or "cls"
    normalize: bool

    @staticmethod
    def read(path: str) -> EncoderConfig:
        config = _json(path, "config.json")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ModelValidationError(
                path, "unsupported activation", expected="gelu", found=config.get("hidden_act")
            )
        pooling = _json(path, os.path.join("1_Pooling", "config.json"), required=False)
        modules = _json(path, "modules.json", required=False) or []
        sentence = _json(path, "sentence_bert_config.json", required=False)
        max_positions = int(config["max_position_embeddings"])
        return EncoderConfig(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_positions=max_positions,
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            max_seq_length=min(int(sentence.get("max_seq_length", max_positions)), max_positions),
            pooling="cls" if pooling.get("pooling_mode_cls_token") else "mean",
            normalize=any(str(m.get("type", "")).endswith("Normalize") for m in modules),
        )


def _json(path: str, name: str, required: bool = True) -> Any:
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        if required:
            raise ModelValidationError(full, "missing")
        return {}
    with open(full, encoding="utf-8") as handle:
        return json.load(handle)


class SentenceEncoder:
    def __init__(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        self.path = path
        self.config = config = EncoderConfig.read(path)
        tokenizer_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_path):
            raise ModelValidationError(tokenizer_path, "missing: an encoder tokenizes its input")
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(config.max_seq_length)
        self.weights = _load_weights(path, config, dtype)
        self.num_parameters = sum(t.numel() for t in self.weights.values())

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise KvmeshError(Reason.EMPTY_PROMPT, "an embedding input needs at least one token")
        if len(ids) > self.config.max_seq_length:
            raise KvmeshError(
                Reason.PROMPT_TOO_LONG,
                f"an embedding input takes at most {self.config.max_seq_length} tokens, "
                f"got {len(ids)}",
            )
        if max(ids) >= self.config.vocab_size:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"token id {max(ids)} is past the vocabulary ({self.config.vocab_size})",
            )

    def embed_sorted(self, inputs: list[list[int]], chunk: int = 32) -> torch.Tensor:
        """Many inputs in forward passes of `chunk`, grouped by length so little is padding
        (as sentence-transformers' encode does); rows in input order."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        vectors = torch.empty((len(inputs), self.dimensions))
        for start in range(0, len(order), chunk):
            rows = order[start : start + chunk]
            vectors[rows] = self.embed([inputs[i] for i in rows])
        return vectors

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """(len(batch), hidden) float32 vectors for token-id inputs (already checked)."""
        config, w = self.config, self.weights
        longest = max(len(ids) for ids in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.bool)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = True
        positions = torch.arange(longest)
        hidden = w["embeddings.word_embeddings.weight"][ids]
        hidden = hidden + w["embeddings.position_embeddings.weight"][positions]
        hidden = hidden + w["embeddings.token_type_embeddings.weight"][0]
        hidden = self._norm(hidden, "embeddings.LayerNorm")
        attend = mask[:, None, None, :]  # keys that are real tokens, for every query
        heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
        for layer in range(config.num_layers):
            prefix = f"encoder.layer.{layer}."

            def linear(x: torch.Tensor, name: str, prefix: str = prefix) -> torch.Tensor:
                return F.linear(x, w[prefix + name + ".weight"], w[prefix + name + ".bias"])

            def split(x: torch.Tensor) -> torch.Tensor:
                return x.view(len(batch), longest, heads, head_dim).transpose(1, 2)

            query = split(linear(hidden, "attention.self.query"))
            key = split(linear(hidden, "attention.self.key"))
            value = split(linear(hidden, "attention.self.value"))
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=attend)
            context = context.transpose(1, 2).reshape(len(batch), longest, config.hidden_size)
            hidden = self._norm(
                hidden + linear(context, "attention.output.dense"),
                prefix + "attention.output.LayerNorm",
            )
            inner = F.gelu(linear(hidden, "intermediate.dense"))
            hidden = self._norm(hidden + linear(inner, "output.dense"), prefix + "output.LayerNorm")
        if config.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.weights
        return F.layer_norm(
            x,
            (self.config.hidden_size,),
            w[name + ".weight"],
            w[name + ".bias"],
            self.config.layer_norm_eps,
        )


def _expected_shapes(config: EncoderConfig) -> dict[str, tuple[int, ...]]:
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (config.max_positions, h),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for layer in range(config.num_layers):
        prefix = f"encoder.layer.{layer}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value"):
            shapes[prefix + name + ".weight"] = (h, h)
            shapes[prefix + name + ".bias"] = (h,)
        shapes[prefix + "attention.output.dense.weight"] = (h, h)
        shapes[prefix + "intermediate.dense.weight"] = (i, h)
        shapes[prefix + "intermediate.dense.bias"] = (i,)
        shapes[prefix + "output.dense.weight"] = (h, i)
        for name in ("attention.output.dense", "attention.output.LayerNorm", "output.dense"):
            shapes[prefix + name + ".bias"] = (h,)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[prefix + name + ".weight"] = (h,)
        shapes[prefix + "output.LayerNorm.bias"] = (h,)
    return shapes


def _load_weights(path: str, config: EncoderConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every expected tensor with its shape (a "bert." prefix is accepted), or a clear error."""
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ModelValidationError(file, "missing")
    weights: dict[str, torch.Tensor] = {}
    with safe_open(file, framework="pt") as tensors:
        names = set(tensors.keys())
        for name, shape in _expected_shapes(config).items():
            stored = name if name in names else f"bert.{name}"
            if stored not in names:
                raise ModelValidationError(file, "missing tensor", tensor=name)
            tensor = tensors.get_tensor(stored)
            if tuple(tensor.shape) != shape:
                raise ModelValidationError(
                    file,
                    "tensor has the wrong shape",
                    tensor=name,
                    expected=shape,
                    found=tuple(tensor.shape),
                )
            weights[name] = tensor.to(dtype)
    return weights
