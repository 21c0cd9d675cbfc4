"""Rotary embedding frequencies (default, linear, llama3 and LongRoPE scaling, partial rotary) as
transformers computes them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from shared.errors import ModelValidationError


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # LongRoPE's per-frequency divisors within its original context (the only range served:
    # its long factors would re-rotate every cached key past it), and its cos/sin scale.
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial: float = 1.0  # the fraction of each head rotated (Phi-4-mini: 0.75)

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial)

    @staticmethod
    def from_hf_config(config: dict[str, Any], path: str) -> RopeSpec:
        # transformers 5.x writes `rope_parameters` (theta inside);
        # 4.x writes `rope_theta` + `rope_scaling`.
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "longrope"):
            raise ModelValidationError(
                path,
                "unsupported rope_type",
                expected="default, linear, llama3 or longrope",
                found=rope_type,
            )
        original = params.get(
            "original_max_position_embeddings", config.get("original_max_position_embeddings")
        )
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if rope_type == "longrope":
            if original is None:
                raise ModelValidationError(
                    path, "longrope needs original_max_position_embeddings", found=None
                )
            return RopeSpec._longrope(config, params, float(theta), int(original), float(partial))
        return RopeSpec(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original or 8192),
            partial=float(partial),
        )

    @staticmethod
    def _longrope(
        config: dict[str, Any], params: dict[str, Any], theta: float, original: int, partial: float
    ) -> RopeSpec:
        factor = params.get("factor") or config["max_position_embeddings"] / original
        attention_factor = params.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
        return RopeSpec(
            theta=theta,
            rope_type="longrope",
            original_max_position_embeddings=original,
            short_factor=tuple(float(x) for x in params["short_factor"]),
            attention_factor=float(attention_factor),
            partial=partial,
        )

    @staticmethod
    def from_gguf_metadata(meta: dict[str, Any], arch: str, head_dim: int) -> RopeSpec:
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        return RopeSpec(
            theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_type="linear" if scaling == "linear" else "default",
            factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0),
            partial=rotary / head_dim,
        )

    def with_gguf_longrope(self, meta: dict[str, Any], arch: str, short: list[float]) -> RopeSpec:
        """LongRoPE as llama.cpp's converter stores it (Phi-3 128k, Phi-4-mini): the short
        factors as a `rope_factors_short` tensor, the attention factor and original context in
        the metadata."""
        return dataclasses.replace(
            self,
            rope_type="longrope",
            short_factor=tuple(short),
            attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor") or 1.0),
            original_max_position_embeddings=int(
                meta[f"{arch}.rope.scaling.original_context_length"]
            ),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """(rotary_dim / 2,) float32 inverse frequencies."""
        dim = self.rotary_dim(head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        if self.rope_type == "longrope":
            return 1.0 / (torch.tensor(self.short_factor) * self.theta**exponents)
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)

    def cos_sin(
        self, head_dim: int, max_positions: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(max_positions, head_dim) cos and sin tables, halves duplicated as in rotate_half; the
        dimensions past a partial rotary's are left as they are (cos 1, sin 0)."""
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq(head_dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        kept = head_dim - emb.shape[1]
        if kept:
            cos = torch.cat((cos, torch.ones(max_positions, kept)), 1)
            sin = torch.cat((sin, torch.zeros(max_positions, kept)), 1)
        return cos.to(dtype), sin.to(dtype)
