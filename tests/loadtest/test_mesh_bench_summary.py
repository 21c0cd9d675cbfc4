"""The mesh benchmark's figures: decode counts only what arrives once every request started."""

import pytest

from loadtest.mesh_bench import summarize


def test_decode_rate_starts_when_the_last_request_has_its_first_token() -> None:
    # Two requests: first tokens at 1 s and 2 s, then 4 tokens each until 4 s.
    arrivals = [(1.0, 1), (1.5, 1), (2.0, 1), (3.0, 2), (4.0, 2), (4.0, 2)]
    summary = summarize([1.0, 2.0], arrivals, elapsed=4.0)
    assert summary["output_tokens"] == 9
    assert summary["output_tok_s"] == pytest.approx(9 / 4)
    # The token at 1.5 s and both first tokens come before decode starts at 2 s.
    assert summary["decode_tok_s"] == pytest.approx(6 / 2)
    assert summary["ttft_p50_ms"] == pytest.approx(1500.0)
