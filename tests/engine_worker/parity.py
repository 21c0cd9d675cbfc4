"""Greedy parity against transformers: the comparison rule and the reference runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def hf_model(path: str):
    """transformers' own model of a checkpoint directory or a GGUF file (its own GGUF loader),
    in float32."""
    from transformers import AutoModelForCausalLM

    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


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


def kvmesh_greedy(
    model: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[Greedy], Any]:
    """kvmesh's greedy tokens and top-3 for `model` (a file or directory), float32 weights, and
    the engine that ran them."""
    from kvmesh.engine import Engine
    from shared.config import CacheConfig, EngineConfig
    from shared.sampling import SamplingParams

    engine = Engine(
        EngineConfig(model=model, weights="float32", cache=CacheConfig(kv_memory_bytes=8 << 20))
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP)
    completions = engine.generate(prompts, params)
    ours = [Greedy(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in completions]
    return ours, engine


def assert_mostly_matches(ours: list[Greedy], reference: list[Greedy]) -> None:
    """Every prompt equal up to a near-tie, all but one equal outright."""
    verdicts = [compare(o, r) for o, r in zip(ours, reference, strict=True)]
    assert verdicts.count("match") >= len(verdicts) - 1, verdicts
    assert set(verdicts) <= {"match", "near_tie"}, verdicts
