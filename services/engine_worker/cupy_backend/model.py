"""The Llama-family decoder on an NVIDIA GPU: our CUDA C kernels through CuPy, GEMMs in cuBLAS.

Same math and same fused weight layout as the torch CausalLM (torch_backend/model.py), over the
same ragged batch of flattened tokens. Every intermediate lives in the preallocated Workspace
(workspace.py) and every GEMM goes through our own cuBLAS handle, so one forward allocates
nothing and synchronises nothing: the decode forward can be captured as a CUDA graph and
replayed (graphs.py). 16-bit weights and KV, fp32 accumulation everywhere (cuBLAS compute type
32F, fp32 math in the kernels); logits come out in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import cupy
import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.rope import RopeSpec
from services.engine_worker.artifacts.weights import ModelWeights
from services.engine_worker.cupy_backend.batch import GpuBatch
from services.engine_worker.cupy_backend.cublas_gemm import CUDA_R_32F, CublasGemm
from services.engine_worker.cupy_backend.device_sampling import DeviceRows
from services.engine_worker.cupy_backend.kernels.bias_add import bias_add
from services.engine_worker.cupy_backend.kernels.library import DTypeSpec
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    FusedWrite,
    paged_decode_attention,
)
from services.engine_worker.cupy_backend.kernels.paged_prefill_attention import (
    paged_prefill_attention,
)
from services.engine_worker.cupy_backend.kernels.rms_norm import (
    add_rms_norm,
    embed_rms_norm,
    head_rms_norm,
)
from services.engine_worker.cupy_backend.kernels.rotary_and_cache import rotary_and_cache
from services.engine_worker.cupy_backend.kernels.sample_tokens import SamplingRows, sample_tokens
from services.engine_worker.cupy_backend.kernels.silu_and_mul import (
    gelu_tanh_and_mul,
    silu_and_mul,
)
from services.engine_worker.cupy_backend.kv_pool import GpuKVCache
from services.engine_worker.cupy_backend.workspace import Workspace

_TORCH_STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.int16}


def _rope_tables(rope: RopeSpec, head_dim: int, max_positions: int) -> tuple[Any, Any]:
    """cos and sin, (positions, D / 2) float32 each."""
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    freqs = positions * rope.inv_freq(head_dim)[None, :]
    return cupy.asarray(freqs.cos().numpy()), cupy.asarray(freqs.sin().numpy())


def to_device(tensor: torch.Tensor, spec: DTypeSpec) -> Any:
    """A CPU tensor of the compute dtype as a CuPy array of its storage type."""
    host = tensor.contiguous().view(_TORCH_STORAGE[spec.name]).numpy()
    return cupy.asarray(host).view(spec.storage)


@dataclass(frozen=True)
class GpuLayer:
    input_norm: Any
    qkv: Any  # (hidden, q + 2 kv)
    qkv_bias: Any | None
    o_proj: Any  # (q, hidden)
    o_bias: Any | None
    post_norm: Any
    gate_up: Any  # (hidden, 2 inter)
    down: Any  # (inter, hidden)
    qk_norm: Any | None = None  # (heads + kv_heads, head_dim): Qwen3's per-head Q/K norms
    # Gemma's norms of the attention's and the MLP's outputs, before their residual adds.
    attn_out_norm: Any | None = None
    mlp_out_norm: Any | None = None


class GpuWeights:
    def __init__(self, weights: ModelWeights, spec: DTypeSpec) -> None:
        def put(tensor: torch.Tensor | None) -> Any:
            return None if tensor is None else to_device(tensor, spec)

        self.embed = put(weights.embed)
        self.final_norm = put(weights.final_norm)
        self.lm_head = put(weights.lm_head)
        self.layers = tuple(
            GpuLayer(**{f.name: put(getattr(layer, f.name)) for f in fields(GpuLayer)})
            for layer in weights.layers
        )


@dataclass(frozen=True)
class DeviceBatch:
    """A GpuBatch's arrays on the device (fixed buffers when a CUDA graph replays them)."""

    input_ids: Any
    positions: Any
    slots: Any
    decode_block_tables: Any
    decode_context_lens: Any
    prefill_block_tables: Any
    prefill_query_starts: Any
    prefill_context_lens: Any
    max_query_len: int
    sample_rows: Any
    num_decodes: int
    sampling: SamplingRows  # each sampled row's parameters (device_sampling.py)

    @staticmethod
    def upload(batch: GpuBatch, sampling: DeviceRows) -> DeviceBatch:
        return DeviceBatch(
            cupy.asarray(batch.input_ids),
            cupy.asarray(batch.positions),
            cupy.asarray(batch.slots),
            cupy.asarray(batch.decode_block_tables),
            cupy.asarray(batch.decode_context_lens),
            cupy.asarray(batch.prefill_block_tables),
            cupy.asarray(batch.prefill_query_starts),
            cupy.asarray(batch.prefill_context_lens),
            batch.max_query_len,
            cupy.asarray(batch.sample_rows),
            batch.num_decodes,
            SamplingRows(
                **{name: cupy.asarray(values) for name, values in sampling.arrays.items()},
                adjustments=cupy.asarray(sampling.adjustments),
            ),
        )


class CupyCausalLM:
    def __init__(
        self,
        arch: ModelArchitecture,
        weights: ModelWeights,
        max_positions: int,
        spec: DTypeSpec,
        gemm: CublasGemm,
    ) -> None:
        self.arch = arch
        self.spec = spec
        self.gemm = gemm
        self.weights = GpuWeights(weights, spec)
        style = arch.style
        self.cos, self.sin = _rope_tables(arch.rope, arch.head_dim, max_positions)
        # Sliding layers (Gemma 3) read their window only, rotated with a RoPE of their own.
        self.local_cos, self.local_sin = (
            (self.cos, self.sin)
            if style.local_rope is None
            else _rope_tables(style.local_rope, arch.head_dim, max_positions)
        )
        self.window = style.sliding_window or 0
        self.scale = style.attention_scale or arch.head_dim**-0.5
        # Gemma's embedding scale as the compute dtype holds it, as the torch model applies it.
        self.embed_scale = 1.0
        if style.embed_scale is not None:
            self.embed_scale = float(
                torch.tensor(style.embed_scale, dtype=getattr(torch, spec.name))
            )
        self.activate = silu_and_mul if style.activation == "silu" else gelu_tanh_and_mul

    def forward(self, batch: DeviceBatch, cache: GpuKVCache, ws: Workspace) -> Any:
        """Logits (S, vocab) float32, a view into the workspace (valid until the next call).

        Launches per layer of a decode-only step: 2 norms (3 with a Q/K norm, 5 with Gemma's
        output norms too), 4 GEMMs, attention (with the rotary and the KV write), the gated
        activation; and outside the layers, the final
        norm and the LM head (the embedding is fused into the first norm); forward_and_sample
        adds the draw.
        Steps with prefill rows add one rotary + KV write per layer and prefill attention."""
        arch, w, spec, gemm = self.arch, self.weights, self.spec, self.gemm
        tokens = int(batch.input_ids.shape[0])
        samples = int(batch.sample_rows.shape[0])
        decodes = batch.num_decodes
        decode_only = decodes == tokens
        scratch = ws.decode_scratch(decodes)
        x, normed, qkv = ws.residual[:tokens], ws.normed[:tokens], ws.qkv[:tokens]
        attn, proj = ws.attn[:tokens], ws.proj[:tokens]
        eps = arch.rms_norm_eps
        embed_rms_norm(
            normed, x, w.embed, batch.input_ids, w.layers[0].input_norm, eps, spec, self.embed_scale
        )
        sliding_layers = arch.style.sliding_layers
        for index, layer in enumerate(w.layers):
            sliding = index in sliding_layers
            cos, sin = (self.local_cos, self.local_sin) if sliding else (self.cos, self.sin)
            window = self.window if sliding else 0
            if index:  # residual += the previous layer's MLP output; normed = its input norm.
                add_rms_norm(normed, x, layer.input_norm, eps, spec, delta=proj)
            gemm(normed, layer.qkv, qkv, spec)
            if layer.qk_norm is not None:
                head_rms_norm(qkv, layer.qk_norm, eps, spec)
            key_cache, value_cache = cache.layer(index)
            fused = None
            if decode_only:
                fused = FusedWrite(layer.qkv_bias, batch.positions, cos, sin, batch.slots)
            else:
                rotary_and_cache(
                    qkv,
                    layer.qkv_bias,
                    batch.positions,
                    cos,
                    sin,
                    batch.slots,
                    key_cache,
                    value_cache,
                    arch.num_heads,
                    spec,
                )
            if decodes:
                paged_decode_attention(
                    attn[:decodes],
                    qkv[:decodes],
                    key_cache,
                    value_cache,
                    batch.decode_block_tables,
                    batch.decode_context_lens,
                    arch.num_heads,
                    self.scale,
                    scratch,
                    spec,
                    fused,
                    window=window,
                )
            if not decode_only:
                paged_prefill_attention(
                    attn,
                    qkv,
                    key_cache,
                    value_cache,
                    batch.prefill_block_tables,
                    batch.prefill_query_starts,
                    batch.prefill_context_lens,
                    batch.max_query_len,
                    arch.num_heads,
                    self.scale,
                    spec,
                    window,
                )
            gemm(attn, layer.o_proj, proj, spec)
            if layer.o_bias is not None:
                bias_add(proj, layer.o_bias, spec)
            if layer.attn_out_norm is not None:  # in place: one row of `hidden` per token
                head_rms_norm(proj, layer.attn_out_norm.reshape(1, -1), eps, spec)
            add_rms_norm(normed, x, layer.post_norm, eps, spec, delta=proj)
            gemm(normed, layer.gate_up, ws.gate_up[:tokens], spec)
            self.activate(ws.act[:tokens], ws.gate_up[:tokens], spec)
            gemm(ws.act[:tokens], layer.down, proj, spec)
            if layer.mlp_out_norm is not None:
                head_rms_norm(proj, layer.mlp_out_norm.reshape(1, -1), eps, spec)
        # The last MLP add and the final norm only where a token is sampled.
        final = ws.final[:samples]
        add_rms_norm(final, x, w.final_norm, eps, spec, delta=proj, rows=batch.sample_rows)
        logits = ws.logits[:samples]
        gemm(final, w.lm_head, logits, spec, out_type=CUDA_R_32F)
        return logits

    def forward_and_sample(self, batch: DeviceBatch, cache: GpuKVCache, ws: Workspace) -> Any:
        """forward(), then every sampled row's token, its logprob and the top logprobs it asks
        for into the workspace's `sampled` buffer (rows the host samples get an argmax,
        unused). Returns the logits."""
        logits = self.forward(batch, cache, ws)
        sample_tokens(logits, batch.sampling, *ws.sampled_views(int(logits.shape[0])))
        return logits
