"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a ragged batch of flattened tokens.

Every tensor in the layer loop is (T, ...) where T is the step's total token count: prefill
chunks and decodes share each matmul; only attention looks at request boundaries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.kv_cache import KVCache
from services.engine_worker.torch_backend.attention import (
    AttentionMetadata,
    paged_attention,
    write_kv,
)
from services.engine_worker.torch_backend.weights import TorchWeights


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos/signed_sin: (T, 1, D). transformers' rotate_half convention:
    rotate_half(x) * sin == roll(x, D/2) * signed_sin, with the first half of sin negated once
    in the table: a sign flip is exact, so this is bit for bit the same with no slices, negation
    or concatenation per step (addcmul would fuse the multiply-add and round differently)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class CausalLM:
    def __init__(
        self, arch: ModelArchitecture, weights: TorchWeights, max_positions: int, dtype: torch.dtype
    ) -> None:
        self.arch = arch
        self.weights = weights
        self.cos, sin = arch.rope.cos_sin(arch.head_dim, max_positions, dtype)
        self.signed_sin = torch.cat(
            (-sin[:, : arch.head_dim // 2], sin[:, arch.head_dim // 2 :]), 1
        )
        self.scale = arch.head_dim**-0.5
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
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # (T, 1, D)
        sin = self.signed_sin.index_select(0, positions).unsqueeze(1)
        x = w.embed(input_ids).to(self.cos.dtype)  # (T, hidden)
        for index, layer in enumerate(w.layers):
            h = F.rms_norm(x, hidden_shape, layer.input_norm, arch.rms_norm_eps)
            qkv = layer.qkv(h)
            # Q and K heads sit side by side in the fused output: norm (Qwen3) and rotate them
            # in one pass.
            qk = qkv[:, : self._qk_size].view(num_tokens, -1, arch.head_dim)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (arch.head_dim,), None, arch.rms_norm_eps) * layer.qk_norm
            qk = _rotate(qk, cos, sin)
            q, k = qk[:, : arch.num_heads], qk[:, arch.num_heads :]
            v = qkv[:, self._qk_size :]
            k_cache, v_cache = kv_cache.layer(index)
            write_kv(
                k_cache, v_cache, k, v.view(num_tokens, arch.num_kv_heads, arch.head_dim), meta
            )
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self._exact_over_cache)
            x = x + layer.o_proj(attn)
            h = F.rms_norm(x, hidden_shape, layer.post_norm, arch.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        # Only rows that sample need the final norm and the (large) vocabulary projection.
        x = F.rms_norm(
            x.index_select(0, sample_rows), hidden_shape, w.final_norm, arch.rms_norm_eps
        )
        return w.lm_head(x).float()
