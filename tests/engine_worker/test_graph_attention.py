"""The compiled step's decode attention (a row's own K/V from the row, the rest from the pool)
against plain softmax attention over the row's whole context, the decode-only step's KV write
against the pool layout, and which steps must write before attending (step_inputs.flatten)."""

from __future__ import annotations

import torch

from services.engine_worker.step_inputs import RequestState, flatten
from services.engine_worker.torch_backend.attention import kv_write_indices
from services.engine_worker.torch_backend.graph_attention import DecodeKvWriter, decode_attention
from shared.sampling import SamplingParams

KV_HEADS, GROUP, DIM, BLOCK, BLOCKS = 2, 3, 8, 4, 12


def pools(layers: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.zeros(BLOCKS, KV_HEADS, DIM, BLOCK, dtype=torch.float16) for _ in range(layers)]
    values = [torch.zeros(BLOCKS, KV_HEADS, BLOCK, DIM, dtype=torch.float16) for _ in range(layers)]
    return keys, values


def test_a_decode_row_attends_to_its_context_and_itself() -> None:
    torch.manual_seed(0)
    keys, values = pools()
    contexts, tables = [6, 1 + BLOCK * 2, 3], [[5, 2], [7, 1, 9], [3]]
    width = max(map(len, tables))
    table = torch.tensor([row + [0] * (width - len(row)) for row in tables])
    history = []
    for context, blocks in zip(contexts, tables, strict=True):
        k = torch.randn(context, KV_HEADS, DIM).half()
        v = torch.randn(context, KV_HEADS, DIM).half()
        positions = torch.arange(context - 1)  # the row's own is not in the pool yet
        where = torch.tensor(blocks)[positions // BLOCK]
        key_write, value_write = kv_write_indices(where, positions, KV_HEADS, DIM, BLOCK)
        DecodeKvWriter(keys, values)(k[None, :-1], v[None, :-1], key_write, value_write)
        history.append((k, v))
    q = torch.randn(len(contexts), KV_HEADS * GROUP, DIM)
    slots = torch.arange(width * BLOCK).view(1, width, 1, 1, BLOCK)
    outside = slots >= torch.tensor(contexts).view(-1, 1, 1, 1, 1) - 1
    own_k = torch.stack([k[-1] for k, _ in history])
    own_v = torch.stack([v[-1] for _, v in history])
    out = decode_attention(q, own_k, own_v, keys[0], values[0], table, outside, 0.5)
    for row, (k, v) in enumerate(history):
        k_heads = k.float().repeat_interleave(GROUP, dim=1).transpose(0, 1)  # (H, context, D)
        v_heads = v.float().repeat_interleave(GROUP, dim=1).transpose(0, 1)
        probs = torch.softmax(q[row].unsqueeze(1) @ k_heads.transpose(1, 2) * 0.5, dim=-1)
        expected = (probs @ v_heads).reshape(-1)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_the_write_puts_each_layers_rows_where_the_pool_keeps_them() -> None:
    keys, values = pools(layers=3)
    new_k = torch.randn(3, 2, KV_HEADS, DIM).half()
    new_v = torch.randn(3, 2, KV_HEADS, DIM).half()
    blocks, positions = torch.tensor([4, 9]), torch.tensor([17, 2])
    DecodeKvWriter(keys, values)(new_k, new_v, *kv_write_indices(blocks, positions, 2, DIM, 4))
    for layer in range(3):
        for row, (block, position) in enumerate(zip(blocks, positions, strict=True)):
            slot = int(position) % BLOCK
            assert torch.equal(keys[layer][block, :, :, slot], new_k[layer, row])
            assert torch.equal(values[layer][block, :, slot], new_v[layer, row])
    assert int((keys[0] != 0).sum()) <= 2 * KV_HEADS * DIM  # nothing else written


def state(name: str, tokens: int, prompt: int, computed: int, drafts: int = 0) -> RequestState:
    return RequestState(
        name,
        list(range(1, tokens + 1)),
        list(range(tokens // BLOCK + 1)),
        computed,
        SamplingParams(),
        prompt,
        num_drafts=drafts,
    )


def test_only_a_request_with_several_decode_rows_chains_them() -> None:
    plain = [(state("a", 9, 4, 8), 1), (state("b", 6, 3, 5), 1)]
    assert not flatten(plain, BLOCK).chained_decodes
    with_prefill = [*plain, (state("c", 5, 5, 0), 5)]
    assert not flatten(with_prefill, BLOCK).chained_decodes
    drafted = [*plain, (state("d", 12, 4, 8, drafts=3), 4)]
    assert flatten(drafted, BLOCK).chained_decodes
