"""The GPU sampler on a GPU: the same tests as on the CPU stand-in
(tests/cupy_standin/test_device_sampler.py), each filter's distribution, batch independence
of a seeded row, the counter generator and the top logprobs, against the real
sample_tokens.cu."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cupy_standin.test_device_sampler import (  # noqa: F401 (collected here)
    test_a_seeded_row_draws_the_same_token_in_any_batch,
    test_each_filter_draws_its_distribution,
    test_greedy_rows_take_the_lowest_id_among_ties,
    test_the_counter_generator_matches_the_hosts_and_is_uniform,
    test_top_logprobs_come_in_order_with_ties_by_lower_id,
)


@pytest.fixture
def cupy() -> Any:
    import cupy

    return cupy
