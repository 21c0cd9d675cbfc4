"""Sampling on the GPU inside the real cupy backend (on the CPU stand-in): penalties, logit
bias, seeds, filters and top logprobs give the torch backend's tokens, without the step
copying any logits back, within one copy in and one copy out."""

from __future__ import annotations

import dataclasses

import pytest

from shared.sampling import SamplingParams
from tests.cupy_standin.test_cupy_backend import engine, prompts, tokens

PENALIZED = {
    "greedy, repetition and bias": SamplingParams(
        max_tokens=12, temperature=0.0, repetition_penalty=1.3, logit_bias=((7, 3.0),),
        ignore_eos=True,
    ),
    "seeded, presence, frequency, top-p": SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.4,
        seed=11, ignore_eos=True, logprobs=2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PENALIZED))
def test_penalized_requests_sample_on_the_gpu_as_on_the_torch_backend(
    checkpoints, standin, name
) -> None:
    params = PENALIZED[name]
    expected = engine(checkpoints["llama"], "torch").generate(prompts(), params)
    ours = engine(checkpoints["llama"], "cupy").generate(prompts(), params)
    assert tokens(ours) == tokens(expected)
    if params.logprobs:
        for mine, theirs in zip(ours, expected, strict=True):
            assert [lp.top[0][0] for lp in mine.logprobs] == [
                lp.top[0][0] for lp in theirs.logprobs
            ]
    # No logits went to the host: every gather was a block copy's (none here).
    assert "cupy:gather" not in standin.launches


def test_a_penalized_batch_still_steps_in_one_copy_each_way(checkpoints, standin) -> None:
    ours = engine(checkpoints["llama"], "cupy")
    params = dataclasses.replace(PENALIZED["seeded, presence, frequency, top-p"], max_tokens=10)
    for index, prompt in enumerate(prompts(4)):
        ours.add_request(prompt, dataclasses.replace(params, seed=index))
    for _ in range(3):
        ours.step()
    measured = 0
    while ours.has_unfinished():
        launches, copies_in = len(standin.launches), standin.copies_to_device
        copies_out, waits = standin.copies_to_host, standin.synchronizations
        if len(ours.step()) < 4:
            break
        assert standin.launches[launches:] == ["graph"]
        assert standin.copies_to_device - copies_in == 1
        assert (standin.copies_to_host - copies_out, standin.synchronizations - waits) == (1, 1)
        measured += 1
    assert measured >= 5
