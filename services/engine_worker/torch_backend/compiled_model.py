"""A packed model's whole forward as a TorchInductor graph: the CPU step without per-op
overhead.

At batch 1 the eager forward makes ~7,100 torch calls a step for ~3.3 ms of 4-bit GEMMs in a
10.6 ms step (docs/design/cpu-engine.md). Compiled, every elementwise op, norm and
the decode attention of a layer fuse into a few C++ loops around the same 4-bit GEMM calls.
Where projections are int8 rows (AVX2 CPUs), their two-level input quantization (`Int8Linear.
product`) fuses into those loops and fbgemm's GEMM runs behind `kvmesh::int8_rows`.

Two graphs, one for steps with prefill rows and one for decode-only steps, serve every step:
the token count, decode rows, blocks per row and prefill segments are dynamic dimensions, and
`backed_size_oblivious` keeps sizes 0 and 1 from graphs of their own, so a row is computed by
the same kernels decoded alone or beside 31 others, a draft or a recompute (row-exact, as
`step_inputs.flatten` needs; tested). Where those are faster, 4-bit projections run prefill
rows as bfloat16 GEMMs over the weight dequantized for the step (graph_projections.py).
Weights and the KV cache are inputs, not constants: engines of one shape in a process share
the code. Prefill attention stays eager behind `kvmesh::cache_and_prefill` (SDPA per chunk),
so prefix-cached prefills keep cold bits. The decode-only graph calls no opaque op: its K/V
are written after it (graph_attention.py, which also says how decode attention reads the pool).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.kv_cache import KVCache
from services.engine_worker.torch_backend.attention import kv_write_indices
from services.engine_worker.torch_backend.graph_attention import DecodeKvWriter, decode_attention
from services.engine_worker.torch_backend.graph_batch import GraphBatch
from services.engine_worker.torch_backend.graph_projections import (
    PACKED_PROJECTIONS,
    ProjectionParts,
    project,
    projection_parts,
)
from services.engine_worker.torch_backend.model import CausalLM
from services.engine_worker.torch_backend.saved_programs import ProgramTable, StepCompileError
from services.engine_worker.torch_backend.weights import Int8Embedding, TorchWeights


def can_compile(weights: TorchWeights) -> bool:
    """The graph is written for packed projections (4-bit groups, or int8 rows where the 4-bit
    kernel is slow) and int8 embedding rows."""
    projections = [
        p for layer in weights.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    return isinstance(weights.embed, Int8Embedding) and all(
        isinstance(p, PACKED_PROJECTIONS) for p in projections
    )


# A layer: input norm, post-attention norm, qkv, o, gate_up and down projections, then the
# per-head Q/K norm weights (Qwen3) or None.
LayerParts = tuple[
    torch.Tensor,
    torch.Tensor,
    ProjectionParts,
    ProjectionParts,
    ProjectionParts,
    ProjectionParts,
    torch.Tensor | None,
]


def _graph(
    arch: ModelArchitecture,
    scale: float,
    by_block: bool,
    prefilling: bool,
    batch: GraphBatch,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    layers: list[LayerParts],
    embed_rows: torch.Tensor,
    embed_scale: torch.Tensor,
    final_norm: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The forward up to the final norm of the sampled rows: (R, hidden). A decode-only graph
    (not `prefilling`) also returns the new K and V of every layer, (layers, B, kv_heads, D),
    and their slots, for `DecodeKvWriter`."""
    heads, kv_heads, dim, eps = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps
    hidden = (arch.hidden_size,)
    decodes, prefills = batch.decode_rows[0].shape[0], batch.prefill_rows[0].shape[0]
    tokens = decodes + prefills
    input_ids, positions, write_blocks = (
        torch.cat(pair) for pair in zip(batch.decode_rows, batch.prefill_rows, strict=True)
    )
    num_blocks, block = batch.decode_table.shape[1], keys[0].shape[3]
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    key_write, value_write = kv_write_indices(write_blocks, positions, kv_heads, dim, block)
    # Position of each (block, slot) of a decode row's table, and which of them it does not read
    # from the pool: its own (taken from the row) and later.
    slots = torch.arange(num_blocks * block, device=cos.device).view(1, num_blocks, 1, 1, block)
    outside = slots >= batch.decode_context_lens.view(decodes, 1, 1, 1, 1) - 1
    new_keys: list[torch.Tensor] = []
    new_values: list[torch.Tensor] = []
    x = F.embedding(input_ids, embed_rows).float() * F.embedding(input_ids, embed_scale)
    for k_cache, v_cache, layer in zip(keys, values, layers, strict=True):
        in_norm, post_norm, qkv_proj, o_proj, gate_up, down, qk_norm = layer
        qkv = project(F.rms_norm(x, hidden, in_norm, eps), qkv_proj, decodes, prefilling)
        # Q and K heads side by side, normed (Qwen3) and rotated in one pass (swapping halves
        # is roll by D/2). Rows viewed whole, then sliced: a view of a column slice guards
        # tokens != 1.
        qk, v = qkv.view(tokens, -1, dim).split((heads + kv_heads, kv_heads), dim=1)
        if qk_norm is not None:  # fixed per model: no branch at run time
            qk = F.rms_norm(qk, (dim,), None, eps) * qk_norm
        qk = qk * cos + torch.cat((qk[..., dim // 2 :], qk[..., : dim // 2]), -1) * sin
        q, k = qk[:, :heads], qk[:, heads:]
        k_pooled, v_pooled = k.to(k_cache.dtype), v.to(v_cache.dtype)  # float16 by default
        if prefilling:  # the rows' K/V into the pool first: later rows of a request read them
            prefilled = torch.ops.kvmesh.cache_and_prefill(
                k_cache,
                v_cache,
                k_pooled,
                v_pooled,
                key_write,
                value_write,
                q.narrow(0, decodes, prefills),
                batch.prefill_segments,
                batch.prefill_blocks,
                scale,
                by_block,
            )
        else:  # written after the graph, every layer in one call (graph_attention.py)
            new_keys.append(k_pooled)
            new_values.append(v_pooled)
            prefilled = q.narrow(0, decodes, prefills)  # no rows: the graph's sizes only
        attn = decode_attention(
            q.narrow(0, 0, decodes),
            k_pooled.narrow(0, 0, decodes),
            v_pooled.narrow(0, 0, decodes),
            k_cache,
            v_cache,
            batch.decode_table,
            outside,
            scale,
        )
        attn = torch.cat((attn, prefilled.reshape(prefills, heads * dim)))
        x = x + project(attn, o_proj, decodes, prefilling)
        normed = F.rms_norm(x, hidden, post_norm, eps)
        gate, up = project(normed, gate_up, decodes, prefilling).chunk(2, dim=-1)
        x = x + project(F.silu(gate) * up, down, decodes, prefilling)
    hidden_rows = F.rms_norm(x.index_select(0, batch.sample_rows), hidden, final_norm, eps)
    if prefilling:
        return hidden_rows
    return hidden_rows, torch.stack(new_keys), torch.stack(new_values), key_write, value_write


_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"size_asserts": False}


class CompiledCausalLM:
    """`CausalLM.forward`'s contract on a `GraphBatch`, through one compiled graph."""

    def __init__(self, model: CausalLM, kv_cache: KVCache) -> None:
        self.model = model
        w = model.weights
        self._keys = [kv_cache.layer(i)[0] for i in range(model.arch.num_layers)]
        self._values = [kv_cache.layer(i)[1] for i in range(model.arch.num_layers)]
        self._write_decode_kv = DecodeKvWriter(self._keys, self._values)
        self._layers: list[LayerParts] = [
            (
                layer.input_norm,
                layer.post_norm,
                *map(projection_parts, (layer.qkv, layer.o_proj, layer.gate_up, layer.down)),
                layer.qk_norm,
            )  # type: ignore[misc]
            for layer in w.layers
        ]
        if not isinstance(w.embed, Int8Embedding):
            raise TypeError(f"the compiled step runs a packed embedding, not {type(w.embed)}")
        self._embed = (w.embed.rows, w.embed.scale)
        # The two graphs compiled ahead of time when the model is prepared (saved_programs.py);
        # else traced lazily, made on first use (torch.compile imports Dynamo: ~1 s).
        self.programs = ProgramTable()
        self._graph: Callable[..., Any] | None = None
        self._examples: dict[bool, GraphBatch] = {}  # by `prefilling`: what a trace is hinted by

    def load_programs(self, saved: dict[str, Path]) -> None:
        """The step's programs a prepared model saved (saved_programs.py)."""
        self.programs.load(saved)

    def _lazy_graph(self) -> Callable[..., Any]:
        if self._graph is None:
            # Its inputs are built here, not by strangers: no size/stride asserts on each of
            # them per call (~650 a step, 0.3 ms at batch 1).
            self._graph = torch.compile(_graph, fullgraph=True, dynamic=False, options=_OPTIONS)
        return self._graph

    def forward(self, batch: GraphBatch, chained_decodes: bool = False) -> torch.Tensor:
        """-> logits (R, vocab) of the sampled rows. `chained_decodes`: some decode row reads
        another of this step (a draft, a recompute), which must be in the pool first."""
        # The graph that writes each layer's rows before its attention, or the one that
        # writes them all after it.
        prefilling = batch.prefill_rows[0].shape[0] > 0 or chained_decodes
        name = "step-prefill" if prefilling else "step-decode"
        program: Callable[..., Any] | None = self.programs.programs.get(name)
        if program is None and self.programs.eager_fallback:  # nothing to mark, export or trace
            program = _graph
        if program is None:
            return self._traced(name, batch, prefilling)
        with torch.inference_mode():
            return self._logits(program(*self._args(batch, prefilling)))

    def _args(self, batch: GraphBatch, prefilling: bool) -> tuple[Any, ...]:
        """`_graph`'s arguments for a batch."""
        model = self.model
        return (
            model.arch,
            model.scale,
            model._exact_over_cache,
            prefilling,
            batch,
            self._keys,
            self._values,
            self._layers,
            *self._embed,
            model.weights.final_norm,
            model.cos,
            model.signed_sin,
        )

    def _logits(self, out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The head over a graph's hidden rows, after a decode-only graph's K/V write."""
        if isinstance(out, tuple):
            hidden, *new_kv = out
            self._write_decode_kv(*new_kv)
        else:
            hidden = out
        return self.model.weights.lm_head(hidden).float()

    def _traced(self, name: str, batch: GraphBatch, prefilling: bool) -> torch.Tensor:
        """A step with no program loaded: its graph traced lazily, or exported for a program
        compiled ahead of time (saved_programs.py), with the sizes it keeps dynamic."""
        # A lazy trace or an export: either way the compiler's hints are the sizes of a batch
        # of our choosing, not the first step's (a one-row engine's prefill has no decode rows:
        # GraphBatch.export_example).
        if prefilling not in self._examples:
            self._examples[prefilling] = GraphBatch.export_example(
                prefilling, self._keys[0].shape[3]
            )
        example = self._examples[prefilling]
        batch.mark_dynamic(hints=example)
        example.mark_dynamic()
        # Any KV budget, the same graph and program: marked before every trace, since an
        # export consumes the marks (a decode program exported after the prefill one had the
        # pool's block count fixed, and indexed past it under a larger --kv-memory).
        for tensor in (*self._keys, *self._values):
            torch._dynamo.mark_dynamic(tensor, 0)
        exported_for = self._args(example, prefilling)
        # Sizes 0 and 1 must not get a graph (and kernels) of their own: see the docstring.
        with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            program = self.programs.get(name, _graph, exported_for, options=_OPTIONS)
            with torch.inference_mode():
                try:
                    return self._logits(
                        (program or self._lazy_graph())(*self._args(batch, prefilling))
                    )
                except torch._dynamo.exc.BackendCompilerFailed as failed:
                    raise StepCompileError(f"compiling {name} failed: {failed}") from failed
