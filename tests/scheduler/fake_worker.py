"""A worker with no model: it keeps the real worker's bookkeeping and a simulated KV pool.

Each token "computed" is written into its slot (block, offset); before a request samples, every
position of its context is read back through its block table and must hold its own token. So a
prefix-cache or block-sharing bug shows up as a wrong read, not just as odd counts. The next
token is a hash of the history, so outputs are deterministic and comparable across runs.

With `tiers`, it also keeps a KV tier: a plan's block writes copy a block's slots under its
hash, a planned load copies them back (stopping at the first hash the tier lacks), so a load
of the wrong block also shows up as a wrong read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shared.step import LoadFailure, SampledToken, StepPlan, StepResult


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
    def __init__(self, block_size: int, vocab: int = 50, tiers: bool = False) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.states: dict[str, _State] = {}
        self.slots: dict[tuple[int, int], int] = {}
        self.tier: dict[int, tuple[int | None, ...]] | None = {} if tiers else None

    def leading(self, block_hashes: list[int]) -> int:
        """How many leading blocks its tier holds (what LookupBlocks answers)."""
        held = self.tier or {}
        return next((i for i, h in enumerate(block_hashes) if h not in held), len(block_hashes))

    def _load(self, new, state: _State) -> LoadFailure | None:  # type: ignore[no-untyped-def]
        first = new.num_computed_tokens // self.block_size - len(new.load_hashes)
        for index, block_hash in enumerate(new.load_hashes):
            content = (self.tier or {}).get(block_hash)
            if content is None:
                state.num_computed = (first + index) * self.block_size
                return LoadFailure(new.request_id, state.num_computed, "missing")
            for offset, token in enumerate(content):
                self.slots[(new.block_ids[first + index], offset)] = token
        return None

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.states.pop(request_id, None)
        if self.tier is not None:  # read out before this step overwrites any of them
            for write in plan.block_writes:
                slots = range(self.block_size)
                self.tier[write.block_hash] = tuple(
                    self.slots.get((write.block_id, o)) for o in slots
                )
        for source, destination in plan.block_copies:  # before this step writes anything
            for offset in range(self.block_size):
                token = self.slots.get((source, offset))
                if token is None:
                    self.slots.pop((destination, offset), None)
                else:
                    self.slots[(destination, offset)] = token
        scheduled = []
        short: list[LoadFailure] = []
        for new in plan.new_requests:
            state = _State(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.states[new.request_id] = state
            if new.load_hashes and (failure := self._load(new, state)) is not None:
                short.append(failure)
                continue
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
        return StepResult(plan.step_id, tuple(sampled), load_failures=tuple(short))

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
