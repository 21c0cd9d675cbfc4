"""The collector's view of a process: a service's start-up heap leaves it each time the service
turns ready, and a benchmark's client keeps its own heap out of view only while it measures."""

from __future__ import annotations

import gc
import weakref

import pytest

from shared.runtime import service
from shared.runtime.heap import frozen_heap
from shared.runtime.service import ServiceRuntime


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_frozen_heap_hides_what_exists_and_gives_it_back() -> None:
    gc.unfreeze()
    before = Node()
    alive = weakref.ref(before)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not see it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


async def test_a_service_freezes_each_time_it_turns_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    freezes: list[None] = []
    monkeypatch.setattr(service, "freeze_startup_heap", lambda: freezes.append(None))
    runtime = ServiceRuntime("test", "127.0.0.1", 0)
    await runtime.set_ready(True)
    await runtime.set_ready(True)  # a gateway's registry says ready on every backend change
    assert len(freezes) == 1 and runtime.ready_once.is_set()
    await runtime.set_ready(False)  # a scheduler whose worker was lost ...
    await runtime.set_ready(True)  # ... builds a new scheduler for the next one
    assert len(freezes) == 2
