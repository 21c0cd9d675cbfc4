"""Speculative decoding's draft side: tokens proposed from text already seen, no draft model.

A running request's step computes its last known token plus up to k draft tokens; the worker
verifies them against the model's own choices (services/engine_worker/verification.py) and
returns how many it accepted. Two proposers, both pure Python:

- `NgramProposer` (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding): the
  latest earlier occurrence of the context's last n tokens (n from ngram_max down to
  ngram_min) in the prompt and output so far, and what followed it.
- `SuffixProposer` (suffix decoding): a bounded-depth suffix trie of the request's own tokens,
  and one shared by the scheduler over the outputs of its recently finished requests (one per
  cache salt), so an agent loop that repeats a tool's output or an answer the model gave before
  is proposed from it. A draft token is the most frequent continuation of the longest suffix of
  the context (plus the draft so far) found in either trie, while its frequency share stays high.

`Speculator` sets each request's proposal length from the share of its drafts it recently
accepted and the batch size (see there): on a CPU a verified row costs a part of a decode step
that grows with the batch, so a request whose text does not repeat stops paying for drafts.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request
from shared.config import SpeculativeConfig

LEARNING_RATE = 0.4  # weight of a step's share of accepted drafts in a request's average
HIGHEST_BAR = 0.9  # however large the batch, a request that copies this well still drafts
PROBE_EVERY = 16  # steps between single drafts of a request below the bar


class Proposer(Protocol):
    def propose(self, request: Request, max_tokens: int) -> list[int]: ...

    def forget(self, request: Request) -> None:
        """The request finished: drop what was indexed for it (and learn from its output)."""


class _NgramIndex:
    """For each n-gram of one request's tokens, the end of its latest occurrence, indexed
    incrementally (tokens only ever grow) up to, not including, the context's last n-gram."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_min, ngram_max + 1)
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.indexed_to = 0

    def lookup(self, tokens: list[int], max_tokens: int) -> list[int]:
        for end in range(self.indexed_to, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.latest_end[tuple(tokens[end - n : end])] = end
        self.indexed_to = len(tokens)
        for n in reversed(self.sizes):
            found = self.latest_end.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if found is not None:  # an overlapping copy: a repeat near the end keeps repeating
                draft: list[int] = []
                for position in range(found, found + max_tokens):
                    length = len(tokens)
                    draft.append(
                        tokens[position] if position < length else draft[position - length]
                    )
                return draft
        return []


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _NgramIndex(self.ngram_min, self.ngram_max)
        return index.lookup(request.token_ids, max_tokens)

    def forget(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)


class SuffixTrie:
    """Occurrence counts of every token sequence of up to `depth` tokens in the sequences added
    (a node is [count, children]); sequences can be removed again, which bounds a shared trie."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: list = [0, {}]

    def extend(self, tokens: list[int], start: int, end: int, delta: int = 1) -> None:
        """Counts the sequences ending at each of tokens[start:end] (the earlier tokens were
        added before); `delta` -1 takes them out again, latest first, so a sequence's
        extensions are gone before it is (a count never exceeds its prefix's)."""
        positions = range(start, end) if delta > 0 else range(end - 1, start - 1, -1)
        for last in positions:
            for first in range(max(0, last - self.depth + 1), last + 1):
                self._count(tokens[first : last + 1], delta)

    def _count(self, path: list[int], delta: int) -> None:
        node, parent = self.root, self.root
        for token in path:
            child = node[1].get(token)
            if child is None:
                if delta < 0:
                    return
                child = node[1][token] = [0, {}]
            parent, node = node, child
        node[0] += delta
        if node[0] <= 0:
            del parent[1][path[-1]]

    def next_token(self, context: list[int]) -> tuple[int, int, float] | None:
        """(token, matched suffix length, its share of the suffix's continuations) for the
        longest suffix of `context` that has a continuation here, or None."""
        for length in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length :]:
                node = node[1].get(token)
                if node is None:
                    break
            if node is None or not node[1]:
                continue
            token, (count, _) = max(node[1].items(), key=lambda item: item[1][0])
            return token, length, count / sum(child[0] for child in node[1].values())
        return None


class SuffixProposer:
    """Per-request tries over prompt and output, and shared tries over the outputs of the last
    `shared_outputs` finished requests: one per cache salt, as the prefix cache keeps them
    apart, so a request's speed never tells what another tenant's answers were."""

    def __init__(self, depth: int = 8, min_share: float = 0.3, shared_outputs: int = 64) -> None:
        self.depth, self.min_share = depth, min_share
        self._own: dict[str, tuple[SuffixTrie, list[int]]] = {}
        self.shared: dict[bytes, SuffixTrie] = {}
        self._shared_outputs: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self._max_shared = shared_outputs

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        own, indexed = self._own.setdefault(request.request_id, (SuffixTrie(self.depth), [0]))
        tokens = request.token_ids
        own.extend(tokens, indexed[0], len(tokens))
        indexed[0] = len(tokens)
        shared = self.shared.get(request.cache_salt)
        tries = [own] if shared is None else [own, shared]
        context = tokens[-(self.depth - 1) :]
        draft: list[int] = []
        while len(draft) < max_tokens:
            picks = [pick for trie in tries if (pick := trie.next_token(context))]
            if not picks:
                break
            token, _, share = max(picks, key=lambda pick: pick[1])  # the longer match
            if share < self.min_share:
                break
            draft.append(token)
            context = [*context, token][-(self.depth - 1) :]
        return draft

    def forget(self, request: Request) -> None:
        self._own.pop(request.request_id, None)
        output = request.token_ids[request.prompt_len :]
        if not output:
            return
        salt = request.cache_salt
        self.shared.setdefault(salt, SuffixTrie(self.depth)).extend(output, 0, len(output))
        self._shared_outputs.append((salt, output))
        if len(self._shared_outputs) > self._max_shared:
            salt, oldest = self._shared_outputs.popleft()
            self.shared[salt].extend(oldest, 0, len(oldest), delta=-1)
            if not self.shared[salt].root[1]:
                del self.shared[salt]


@dataclass
class _Pace:
    """One request's recent share of accepted drafts (an average weighted to its latest
    steps), and the steps since it last drafted."""

    acceptance: float = 0.5
    idle_steps: int = 0


class Speculator:
    """The scheduler's draft side; with speculation off it proposes nothing.

    How many drafts a request verifies is a cost rule: the j-th draft is accepted with about
    acceptance**j, and it is worth its row when that beats what the row costs against the
    tokens the step makes anyway. That bar is `draft_row_cost` alone (a batch of one, where a
    row is cheap beside the weights the step reads) and grows with the batch, whose rows a
    CPU's matmuls pay for one by one: at 8 requests only requests that copy well draft.
    """

    def __init__(self, config: SpeculativeConfig, blocks: BlockManager, max_model_len: int) -> None:
        self.config, self.blocks, self.max_model_len = config, blocks, max_model_len
        self.proposer: Proposer | None = None
        if config.method == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer()
        self._paces: dict[str, _Pace] = {}
        self.num_draft_tokens = 0  # lifetime totals, for metrics
        self.num_accepted_drafts = 0

    def drafts(self, request: Request, num_new: int, budget: int, batch: int) -> tuple[int, ...]:
        """Draft tokens a decoding request verifies beside its next one, this step, in a batch
        of `batch` running requests."""
        if self.proposer is None or request.sampling.disable_speculation:
            return ()
        if num_new != 1 or request.num_output_tokens == 0:  # a prefill (chunk): no drafts
            return ()
        pace = self._paces.setdefault(request.request_id, _Pace())
        limit = min(
            self._length(pace, batch), draft_room(request, budget, self.max_model_len, self.blocks)
        )
        return tuple(self.proposer.propose(request, limit)) if limit > 0 else ()

    def _length(self, pace: _Pace, batch: int) -> int:
        bar = min(HIGHEST_BAR, self.config.draft_row_cost * (batch + 1) / 2)
        length = 0
        while length < self.config.max_draft_tokens and pace.acceptance ** (length + 1) >= bar:
            length += 1
        if length == 0:  # below the bar: one draft now and then, to notice a change
            pace.idle_steps += 1
            if pace.idle_steps >= PROBE_EVERY:
                length, pace.idle_steps = 1, 0
        return length

    def settle(self, request: Request, proposed: int, accepted: int) -> None:
        """After a step verified `proposed` drafts and accepted the first `accepted`: the
        request's counts and next proposal length; the blocks reserved past its computed
        tokens go back."""
        self.blocks.trim(request)
        request.num_draft_tokens += proposed
        request.num_accepted_drafts += accepted
        self.num_draft_tokens += proposed
        self.num_accepted_drafts += accepted
        pace = self._paces.get(request.request_id)
        if pace is not None:
            pace.acceptance += LEARNING_RATE * (accepted / proposed - pace.acceptance)

    def forget(self, request: Request) -> None:
        if self.proposer is not None:
            self._paces.pop(request.request_id, None)
            self.proposer.forget(request)


def draft_room(request: Request, budget: int, max_model_len: int, blocks: BlockManager) -> int:
    """How many drafts a decoding request may verify this step: within the step's budget, its
    max_tokens, the context length, and the free blocks (drafts never preempt anyone)."""
    slots = (len(request.block_ids) + blocks.num_free_blocks) * blocks.block_size
    room = min(
        budget - 1,
        request.sampling.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
        slots - request.num_computed_tokens - 1,
    )
    return max(0, room)
