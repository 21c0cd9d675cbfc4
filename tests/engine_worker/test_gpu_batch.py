"""The cupy backend's host-side batch: the same tokens, positions and KV slots as the torch
batch, and the block tables and offsets the kernels read. Pure numpy: runs without a GPU."""

from __future__ import annotations

import numpy
import torch

from services.engine_worker.cupy_backend.batch import build_gpu_batch
from services.engine_worker.step_inputs import RequestState
from services.engine_worker.torch_backend.batch import build_batch
from shared.sampling import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def state(
    name: str, tokens: int, computed: int, blocks: list[int], prompt: int | None = None
) -> RequestState:
    """A prompt of `prompt` tokens (all of them by default) and what it generated after."""
    ids = list(range(100, 100 + tokens))
    return RequestState(name, ids, blocks, computed, GREEDY, tokens if prompt is None else prompt)


def scheduled() -> list[tuple[RequestState, int]]:
    return [
        (state("decode-a", 6, 5, [7, 3], prompt=5), 1),  # position 5: block 3, offset 1
        (state("prefill-fresh", 5, 0, [1, 2]), 5),  # whole prompt
        (state("decode-b", 2, 1, [9], prompt=1), 1),
        (state("prefill-cached", 10, 8, [4, 5, 6]), 2),  # 8 cached, 2 new: samples
        (state("prefill-chunk", 12, 0, [10, 11, 12]), 6),  # first chunk: does not sample
    ]


def test_the_same_tokens_positions_and_samples_as_the_torch_batch() -> None:
    gpu = build_gpu_batch(scheduled(), BLOCK)
    cpu = build_batch(scheduled(), BLOCK, kv_heads=1, num_heads=1, head_dim=1)
    assert gpu.input_ids.tolist() == cpu.input_ids.tolist()
    assert gpu.positions.tolist() == cpu.positions.tolist()
    assert gpu.sample_rows.tolist() == cpu.sample_rows.tolist()
    assert [s.request_id for s in gpu.sampling_states] == [
        s.request_id for s in cpu.sampling_states
    ]
    # With one head of dimension 1, the torch V write rows are exactly the slots.
    assert gpu.slots.tolist() == cpu.meta.value_write.tolist()


def test_decode_and_prefill_tables() -> None:
    gpu = build_gpu_batch(scheduled(), BLOCK)
    assert gpu.num_decodes == 2 and not gpu.decode_only
    assert gpu.decode_context_lens.tolist() == [6, 2]
    assert gpu.decode_block_tables.tolist() == [[7, 3], [9, 0]]  # padded with block 0
    assert gpu.prefill_query_starts.tolist() == [2, 7, 9, 15]
    assert gpu.prefill_context_lens.tolist() == [5, 10, 6]
    assert gpu.prefill_block_tables.tolist() == [[1, 2, 0], [4, 5, 6], [10, 11, 0]]
    assert gpu.max_query_len == 6
    assert gpu.slots.dtype == numpy.int64 and gpu.input_ids.dtype == numpy.int32


def test_a_decode_only_step_and_a_fixed_table_width() -> None:
    decodes = [(state("a", 6, 5, [7, 3], prompt=4), 1), (state("b", 2, 1, [9], prompt=1), 1)]
    gpu = build_gpu_batch(decodes, BLOCK, decode_width=8)
    assert gpu.decode_only and gpu.decode_block_tables.shape == (2, 8)
    assert gpu.prefill_query_starts.tolist() == [2]
    assert torch.equal(
        torch.from_numpy(gpu.decode_context_lens), torch.tensor([6, 2], dtype=torch.int32)
    )


def test_a_prompts_last_token_computed_alone_is_a_prefill() -> None:
    """Its rest cached (or chunked before): a cold prefill computes that token with prefill
    attention, so this one must too for the same bits (torch and cupy batches alike)."""
    last = [(state("cached-all-but-one", 9, 8, [4, 5, 6]), 1)]
    gpu = build_gpu_batch(last, BLOCK)
    cpu = build_batch(last, BLOCK, kv_heads=1, num_heads=1, head_dim=1)
    assert gpu.num_decodes == 0 and gpu.prefill_context_lens.tolist() == [9]
    assert cpu.meta.decode is None and [s.num_tokens for s in cpu.meta.prefills] == [1]
