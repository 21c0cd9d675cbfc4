"""A step's rows as the compiled graph (compiled_model.py) takes them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch
import torch.utils._pytree as pytree

from services.engine_worker.step_inputs import FlatBatch, RequestState, flatten
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class GraphBatch:
    """A step's rows as the compiled graph takes them: every size here is dynamic."""

    # Token id, position and the block its K/V goes to, of each decode row (B,) and each
    # prefill row (P,): apart, not as T rows, so that the graph knows T = B + P and needs no
    # guard on how T splits (one that held for the first step would fail the next).
    decode_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    prefill_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    decode_table: torch.Tensor  # (B, max blocks) block table of each decode row, 0-padded
    decode_context_lens: torch.Tensor  # (B,)
    prefill_segments: torch.Tensor  # (S, 3) first prefill row, rows, context length
    prefill_blocks: torch.Tensor  # (S, max blocks)
    sample_rows: torch.Tensor  # (R,)

    @staticmethod
    def of(flat: FlatBatch) -> GraphBatch:
        def table(rows: list[list[int]]) -> torch.Tensor:
            if not rows:
                return torch.zeros((0, 1), dtype=torch.long)
            width = max(len(row) for row in rows)
            return torch.tensor([row + [0] * (width - len(row)) for row in rows])

        first = flat.prefill_query_starts[0]  # decode rows come first

        def rows(part: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ids, positions, blocks = flat.input_ids, flat.positions, flat.token_blocks
            return (
                torch.tensor(ids[part], dtype=torch.long),
                torch.tensor(positions[part], dtype=torch.long),
                torch.tensor(blocks[part], dtype=torch.long),
            )

        segments = [
            (start - first, end - start, context)
            for start, end, context in zip(
                flat.prefill_query_starts[:-1],
                flat.prefill_query_starts[1:],
                flat.prefill_context_lens,
                strict=True,
            )
        ]
        return GraphBatch(
            rows(slice(0, first)),
            rows(slice(first, None)),
            _long_tensor(flat.decode_table),
            torch.tensor(flat.decode_context_lens, dtype=torch.long),
            torch.tensor(segments, dtype=torch.long).view(len(segments), 3),
            table(flat.prefill_blocks),
            torch.tensor(flat.logit_rows, dtype=torch.long),
        )

    @staticmethod
    def export_example(prefilling: bool, block_size: int) -> GraphBatch:
        """The batch a program is exported for, whatever step first needed it: a decode row
        beside a prompt of two blocks (`prefilling`), or the decode row alone.

        Its sizes are the compiler's hints, not limits: the program serves every size (each
        ranges over 0..inf: `saved_programs.takes_any_size`). A hint of 0 breaks Inductor, which
        divides by it when it lays out the output (a one-row engine's prefill steps have no
        decode rows: `ZeroDivisionError` in `_size_hinting`), and hints taken from the first
        step made the code depend on the engine's step limits. Block ids 0 and 1: the pool
        is cut to two blocks for the compiler (`saved_programs._shrunk`)."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prompt = list(range(block_size + 1))
        decode = RequestState("example-decode", prompt[:2], [0], 1, params, 1)
        prefill = RequestState("example-prefill", prompt, [0, 1], 0, params, len(prompt))
        scheduled = [(decode, 1), (prefill, len(prompt))] if prefilling else [(decode, 1)]
        return GraphBatch.of(flatten(scheduled, block_size))

    def dynamic_sizes(self) -> list[tuple[torch.Tensor, int]]:
        """Every (tensor, dimension) whose size varies from step to step."""
        rows = (*self.decode_rows, *self.prefill_rows, self.sample_rows)
        firsts = (*rows, self.decode_table, self.decode_context_lens, self.prefill_segments)
        return [
            *((tensor, 0) for tensor in (*firsts, self.prefill_blocks)),
            (self.decode_table, 1),
            (self.prefill_blocks, 1),
        ]

    def mark_dynamic(self, hints: GraphBatch | None = None) -> None:
        """Its varying sizes marked for a trace; `hints`: a batch whose sizes the compiler
        takes as its hints instead (export_example says why)."""
        sizes = self.dynamic_sizes()
        hinted = [t.shape[d] for t, d in hints.dynamic_sizes()] if hints else [None] * len(sizes)
        for (tensor, dim), hint in zip(sizes, hinted, strict=True):
            torch._dynamo.mark_dynamic(tensor, dim, hint_override=hint)


def _long_tensor(array: numpy.ndarray) -> torch.Tensor:
    """A copy with C strides: an empty array's strides may be zeros (numpy 2.4's (0, 1)
    table), which the graph's stride guards would take for another layout and recompile."""
    return torch.empty(array.shape, dtype=torch.long).copy_(torch.from_numpy(array))


# Its tensors are a saved program's inputs (saved_programs.py).
pytree.register_dataclass(GraphBatch)
