from __future__ import annotations

import pytest

from services.gateway.request.stop_strings import StopStringMatcher


def feed(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    released = "".join(matcher.push(piece) for piece in pieces)
    return released + matcher.flush(), matcher.matched


def test_a_stop_string_split_over_pieces_is_found_and_cut() -> None:
    assert feed(["END"], ["Hello E", "N", "D and more"]) == ("Hello ", "END")


def test_text_that_only_looks_like_a_stop_string_start_is_released_later() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("go ST") == "go "  # "ST" may start STOP: held back
    assert matcher.push("ART") == "START"
    assert matcher.flush() == ""


def test_the_earliest_match_wins_among_several_stops() -> None:
    assert feed(["world", "lo w"], ["hello", " world"]) == ("hel", "lo w")


def test_nothing_is_released_after_a_match() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.push("a\n") == "a"
    assert matcher.push("\nb") == ""
    assert matcher.push("more") == "" and matcher.flush() == ""


@pytest.mark.parametrize("pieces", [["👋🏽", "世界"], ["世", "界", "👋"]])
def test_multibyte_text_passes_through_whole(pieces: list[str]) -> None:
    assert feed(["<end>"], pieces) == ("".join(pieces), None)


def test_held_text_is_flushed_at_the_end_of_the_stream() -> None:
    assert feed(["###"], ["answer #", "#"]) == ("answer ##", None)
