"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; Gemma 2 and 3 with their
DecoderStyle) over a ragged batch of flattened tokens.

Every tensor in the layer loop is (T, ...) where T is the step's total token count: prefill
chunks and decodes share each matmul; only attention looks at request boundaries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.rope import RopeSpec
from services.engine_worker.kv_cache import KVCache
from services.engine_worker.torch_backend.attention import (
    AttentionMetadata,
    paged_attention,
    write_kv,
)
from services.engine_worker.torch_backend.weights import TorchWeights


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, order: torch.Tensor | None
) -> torch.Tensor:
    """x: (T, heads, D); cos/signed_sin: (T, 1, D). transformers' rotate_half convention:
    rotate_half(x) * sin == roll(x, D/2) * signed_sin, with the first half of sin negated once
    in the table: a sign flip is exact, so this is bit for bit the same with no slices, negation
    or concatenation per step (addcmul would fuse the multiply-add and round differently).
    `order`: a partial rotary's roll within its rotated dimensions (the rest meet cos 1, sin 0)."""
    if order is None:
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
    return x * cos + x.index_select(-1, order) * signed_sin


def _rope_tables(
    rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (`_rotate`'s), (max_positions, head_dim)."""
    cos, sin = rope.cos_sin(head_dim, max_positions, dtype)
    half = rope.rotary_dim(head_dim) // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), 1)


class CausalLM:
    def __init__(
        self, arch: ModelArchitecture, weights: TorchWeights, max_positions: int, dtype: torch.dtype
    ) -> None:
        self.arch = arch
        self.weights = weights
        self.cos, self.signed_sin = _rope_tables(arch.rope, arch.head_dim, max_positions, dtype)
        style = arch.style
        # Sliding layers' own RoPE (Gemma 3), else the global one.
        self.local_cos, self.local_signed_sin = (
            (self.cos, self.signed_sin)
            if style.local_rope is None
            else _rope_tables(style.local_rope, arch.head_dim, max_positions, dtype)
        )
        rotary = arch.rope.rotary_dim(arch.head_dim)
        self.rotary_order = None
        if rotary != arch.head_dim:  # out[i] = x[(i - rotary / 2) mod rotary], as roll gives
            dims = torch.arange(arch.head_dim)
            dims[:rotary] = (dims[:rotary] - rotary // 2) % rotary
            self.rotary_order = dims
        self.scale = style.attention_scale or arch.head_dim**-0.5
        self.window = style.sliding_window if style.sliding_layers else None
        self._activation = F.silu if style.activation == "silu" else _gelu_tanh
        self._qk_size = arch.q_size + arch.kv_size
        # Rounded activations need a cached prefix's prefill to give a cold prefill's bits.
        self._exact_over_cache = weights.format == "packed"

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: (T,); sample_rows: (S,) -> logits (S, vocab)."""
        arch, w = self.arch, self.weights
        hidden_shape = (arch.hidden_size,)
        num_tokens = input_ids.shape[0]
        style = arch.style
        rope = {False: self._rows(self.cos, self.signed_sin, positions)}
        if self.window is not None:
            rope[True] = self._rows(self.local_cos, self.local_signed_sin, positions)
        x = w.embed(input_ids).to(self.cos.dtype)  # (T, hidden)
        if style.embed_scale is not None:  # rounded to the activations' dtype, as Gemma does
            x = x * torch.tensor(style.embed_scale, dtype=x.dtype)
        for index, layer in enumerate(w.layers):
            sliding = index in style.sliding_layers
            cos, sin = rope[sliding]
            h = F.rms_norm(x, hidden_shape, layer.input_norm, arch.rms_norm_eps)
            qkv = layer.qkv(h)
            # Q and K heads sit side by side in the fused output: norm (Qwen3) and rotate them
            # in one pass.
            qk = qkv[:, : self._qk_size].view(num_tokens, -1, arch.head_dim)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (arch.head_dim,), None, arch.rms_norm_eps) * layer.qk_norm
            qk = _rotate(qk, cos, sin, self.rotary_order)
            q, k = qk[:, : arch.num_heads], qk[:, arch.num_heads :]
            v = qkv[:, self._qk_size :]
            k_cache, v_cache = kv_cache.layer(index)
            layer_meta = _windowed(meta) if sliding else meta
            write_kv(
                k_cache,
                v_cache,
                k,
                v.view(num_tokens, arch.num_kv_heads, arch.head_dim),
                layer_meta,
            )
            attn = paged_attention(
                q,
                k_cache,
                v_cache,
                layer_meta,
                self.scale,
                self._exact_over_cache,
                style.attn_softcap,
            )
            out = layer.o_proj(attn)
            if layer.attn_out_norm is not None:
                out = F.rms_norm(out, hidden_shape, layer.attn_out_norm, arch.rms_norm_eps)
            x = x + out
            h = F.rms_norm(x, hidden_shape, layer.post_norm, arch.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            out = layer.down(self._activation(gate) * up)
            if layer.mlp_out_norm is not None:
                out = F.rms_norm(out, hidden_shape, layer.mlp_out_norm, arch.rms_norm_eps)
            x = x + out
        # Only rows that sample need the final norm and the (large) vocabulary projection.
        x = F.rms_norm(
            x.index_select(0, sample_rows), hidden_shape, w.final_norm, arch.rms_norm_eps
        )
        logits = w.lm_head(x).float()
        if style.final_softcap is not None:
            logits = torch.tanh(logits / style.final_softcap) * style.final_softcap
        return logits

    def move_tables(self, device: torch.device) -> None:
        """The RoPE tables on the device the step runs on."""
        self.cos, self.signed_sin, self.local_cos, self.local_signed_sin = (
            t.to(device) for t in (self.cos, self.signed_sin, self.local_cos, self.local_signed_sin)
        )
        if self.rotary_order is not None:
            self.rotary_order = self.rotary_order.to(device)

    @staticmethod
    def _rows(
        cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows for the step's positions, (T, 1, D) each."""
        return (
            cos.index_select(0, positions).unsqueeze(1),
            signed_sin.index_select(0, positions).unsqueeze(1),
        )


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _windowed(meta: AttentionMetadata) -> AttentionMetadata:
    if meta.windowed is None:
        raise ValueError("a sliding layer needs the step's windowed attention metadata")
    return meta.windowed
