"""Bad input to the in-process Engine: clear, stable reasons, and nothing left behind."""

from __future__ import annotations

import pytest

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, parse_bytes
from shared.errors import KvmeshError, Reason
from shared.sampling import MIN_TEMPERATURE, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> Engine:
    return Engine(
        EngineConfig(
            model=tiny_llama_dir, max_model_len=128, cache=CacheConfig(kv_memory_bytes=4 << 20)
        )
    )


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ([], Reason.EMPTY_PROMPT),
        ([1] * 128, Reason.PROMPT_TOO_LONG),
        ([1, 512], Reason.INVALID_ARGUMENT),  # outside the vocabulary
        ([1, -3], Reason.INVALID_ARGUMENT),
        ({"prompt": "x", "token_ids": [1]}, Reason.INVALID_ARGUMENT),
        ({"messages": []}, Reason.INVALID_ARGUMENT),
        (3.5, Reason.INVALID_ARGUMENT),
        ("text needs a tokenizer", Reason.TOKENIZER_UNAVAILABLE),
    ],
)
def test_bad_prompts_are_refused_with_a_reason(
    engine: Engine, prompt: object, reason: Reason
) -> None:
    with pytest.raises(KvmeshError) as caught:
        engine.add_request(prompt, GREEDY)  # type: ignore[arg-type]
    assert caught.value.reason is reason
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", 0),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-300),  # logits divided by it are infinite
        ("repetition_penalty", 1e300),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("-inf")),
        ("logprobs", 21),
    ],
)
def test_bad_sampling_params_are_refused(engine: Engine, field: str, value: float) -> None:
    with pytest.raises(KvmeshError) as caught:  # the in-process engine is its own edge
        engine.add_request([1, 2, 3], SamplingParams(**{field: value}))
    assert caught.value.reason is Reason.INVALID_SAMPLING_PARAMS and field in caught.value.message
    assert not engine.has_unfinished()


def test_a_temperature_below_the_floor_samples_at_the_floor(engine: Engine) -> None:
    """1e-320 would make every logit infinite; it runs at MIN_TEMPERATURE, as vLLM's clamp."""
    params = SamplingParams(max_tokens=4, temperature=1e-320, seed=7, ignore_eos=True)
    assert params.temperature == MIN_TEMPERATURE
    [completion] = engine.generate([[1, 2, 3]], params)
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"


def test_generation_stops_at_the_context_length(engine: Engine) -> None:
    [completion] = engine.generate(
        [[3] * 120], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    )
    assert completion.finish_reason == "length" and len(completion.token_ids) == 8


def test_sizes_parse_with_units() -> None:
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512M") == 512 << 20
    assert parse_bytes("1048576") == 1 << 20
    with pytest.raises(KvmeshError):
        parse_bytes("lots")


def test_one_bad_prompt_in_a_batch_submits_none(engine: Engine) -> None:
    with pytest.raises(KvmeshError) as caught:
        engine.generate([[5, 6, 7], [8, 9], [1, 9999]], GREEDY)
    assert caught.value.reason is Reason.INVALID_ARGUMENT
    assert not engine.has_unfinished()
    load = engine.scheduler.load()
    assert load.num_free_blocks == load.num_blocks


def test_generation_config_end_tokens_stop_generation(tiny_llama_dir: str, tmp_path) -> None:
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    free = Engine(EngineConfig(model=str(model_dir))).generate([[5, 6, 7, 8]], params)[0]
    assert free.finish_reason == "length"
    end_token = free.token_ids[5]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end_token]}))
    ended = Engine(EngineConfig(model=str(model_dir))).generate([[5, 6, 7, 8]], params)[0]
    assert ended.finish_reason == "stop"
    assert ended.token_ids == free.token_ids[: free.token_ids.index(end_token) + 1]


def test_streaming_text_without_a_tokenizer_gives_a_reason(engine: Engine) -> None:
    with pytest.raises(KvmeshError) as caught:
        next(engine.stream([5, 6, 7], GREEDY))
    assert caught.value.reason is Reason.TOKENIZER_UNAVAILABLE
    assert not engine.has_unfinished()
