"""Greedy parity against transformers: the comparison rule and the reference runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TOP = 3


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    top: list[list[int]]  # top-3 token ids at each generated position


# Short questions the default model answers in a few tokens: greedy parity's prompts (also
# `make bench-startup`'s: a prepared model against a fresh preparation).
QUESTIONS = (
    (Path(__file__).parents[2] / "loadtest" / "texts" / "parity_questions.txt")
    .read_text()
    .splitlines()
)


def transformers_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, eos: int
) -> list[Greedy]:
    """One prompt at a time, so no padding touches the reference."""
    results = []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        top = [logits[0].topk(TOP).indices.tolist() for logits in out.logits]
        results.append(Greedy(tokens, top[: len(tokens)]))
    return results


def compare(ours: Greedy, reference: Greedy) -> str:
    """'match', 'near_tie' (first difference is a float near-tie: each side's token is in the
    other's top-3 there), or a description of the mismatch."""
    for position, (mine, theirs) in enumerate(zip(ours.tokens, reference.tokens, strict=False)):
        if mine != theirs:
            if mine in reference.top[position] and theirs in ours.top[position]:
                return "near_tie"
            return f"mismatch at {position}: {mine} vs {theirs}"
    if len(ours.tokens) != len(reference.tokens):
        return f"length {len(ours.tokens)} vs {len(reference.tokens)}"
    return "match"
