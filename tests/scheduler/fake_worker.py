"""A worker with no model: it keeps the real worker's bookkeeping and a simulated KV pool.

Each token "computed" is written into its slot (block, offset); before a request samples, every
position of its context is read back through its block table and must hold its own token. So a
prefix-cache or block-sharing bug shows up as a wrong read, not just as odd counts. The next
token is a hash of the history, so outputs are deterministic and comparable across runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shared.step import SampledToken, StepPlan, StepResult


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    num_drafts: int = 0


def next_token(history: list[int], vocab: int) -> int:
    digest = hashlib.blake2b(repr([*history[-6:], len(history)]).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab


class FakeWorker:
    def __init__(self, block_size: int, vocab: int = 50) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.states: dict[str, _State] = {}
        self.slots: dict[tuple[int, int], int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.states.pop(request_id, None)
        for source, destination in plan.block_copies:  # before this step writes anything
            for offset in range(self.block_size):
                token = self.slots.get((source, offset))
                if token is None:
                    self.slots.pop((destination, offset), None)
                else:
                    self.slots[(destination, offset)] = token
        scheduled = []
        for new in plan.new_requests:
            state = _State(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.states[new.request_id] = state
            scheduled.append((new.request_id, state, new.num_scheduled_tokens))
        for running in plan.running_requests:
            state = self.states[running.request_id]
            state.block_ids.extend(running.new_block_ids)
            state.token_ids.extend(running.draft_token_ids)
            state.num_drafts = len(running.draft_token_ids)
            scheduled.append((running.request_id, state, running.num_scheduled_tokens))
        sampled = []
        for request_id, state, num_new in scheduled:
            end = state.num_computed + num_new
            assert end <= len(state.token_ids), f"{request_id}: scheduled past its known tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{request_id}: too few blocks"
            for position in range(state.num_computed, end):
                self.slots[self._slot(state, position)] = state.token_ids[position]
            state.num_computed = end
        for request_id, state, _ in scheduled:
            if state.num_computed == len(state.token_ids):
                accepted = self._verify(state)
                for position in range(state.num_computed):  # attention reads the whole context
                    found = self.slots.get(self._slot(state, position))
                    assert found == state.token_ids[position], (
                        f"{request_id}: position {position} reads {found}, "
                        f"expected {state.token_ids[position]}"
                    )
                token = next_token(state.token_ids, self.vocab)
                state.token_ids.append(token)
                sampled.append(SampledToken(request_id, token, num_accepted_drafts=accepted))
        return StepResult(plan.step_id, tuple(sampled))

    def _verify(self, state: _State) -> int:
        """A speculating request keeps the drafts its next tokens would have been; the rest of
        its tokens, computed count and blocks past them are rolled back (as the worker does)."""
        if not state.num_drafts:
            return 0
        known = len(state.token_ids) - state.num_drafts
        accepted = 0
        while accepted < state.num_drafts and state.token_ids[known + accepted] == next_token(
            state.token_ids[: known + accepted], self.vocab
        ):
            accepted += 1
        del state.token_ids[known + accepted :]
        state.num_computed = len(state.token_ids)
        del state.block_ids[-(-state.num_computed // self.block_size) :]
        state.num_drafts = 0
        return accepted

    def _slot(self, state: _State, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size
