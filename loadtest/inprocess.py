"""Peers that run in this process: kvmesh's in-process Engine as a load target, and
transformers `generate` in static batches. Both are timed the way the network targets are."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvmesh.engine import Engine
from loadtest.driver import LoadShape, RunResult
from loadtest.targets import RequestRecord, Timer
from loadtest.workload import RequestSpec
from shared.outputs import finish_reason_label
from shared.sampling import SamplingParams

_Pending = tuple[RequestSpec, Timer, asyncio.Future, asyncio.AbstractEventLoop]


class EngineTarget:
    """The Engine stepped by a thread of its own; `send` submits and awaits the answer, so the
    same driver (open or closed loop) drives it as it drives a server."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._active: dict[str, tuple[Timer, asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine-target", daemon=True)

    async def __aenter__(self) -> EngineTarget:
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join(timeout=10)

    async def send(self, spec: RequestSpec) -> RequestRecord:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RequestRecord] = loop.create_future()
        self._inbox.put((spec, Timer(RequestRecord(spec.index, len(spec.prompt))), future, loop))
        return await future

    def _admit(self, pending: _Pending) -> None:
        spec, timer, future, loop = pending
        params = SamplingParams(max_tokens=spec.max_tokens, **spec.sampling)
        request_id = self.engine.add_request(spec.prompt, params)
        self._active[request_id] = (timer, future, loop)

    def _loop(self) -> None:
        while self._running:
            try:
                while True:
                    self._admit(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                try:
                    self._admit(self._inbox.get(timeout=0.05))
                except queue.Empty:
                    continue
            for output in self.engine.step():
                timer, future, loop = self._active[output.request_id]
                if output.new_token_ids:
                    timer.tokens(len(output.new_token_ids))
                if output.finish_reason is not None:
                    del self._active[output.request_id]
                    record = timer.end("completed", finish_reason_label(output.finish_reason))
                    loop.call_soon_threadsafe(future.set_result, record)


def run_transformers(
    model_path: str, specs: Sequence[RequestSpec], concurrency: int, threads: int
) -> RunResult:
    """Closed loop in static batches of `concurrency`: each batch is left-padded and decoded
    until its longest request is done; a step's time is taken by a logits processor, so each
    request's TTFT, gaps and E2E are its own (E2E at its own last token)."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(threads)
    if os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
        )
    model.eval()

    class StepClock(LogitsProcessor):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.perf_counter())
            return scores

    records: list[RequestRecord] = []
    run_started = time.perf_counter()
    for first in range(0, len(specs), concurrency):
        group = specs[first : first + concurrency]
        width = max(len(s.prompt) for s in group)
        ids = torch.tensor([[2] * (width - len(s.prompt)) + s.prompt for s in group])
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in group])
        steps = max(s.max_tokens for s in group)
        clock = StepClock()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=2,
                logits_processor=LogitsProcessorList([clock]),
            )
        times = [t - started for t in clock.times]
        for spec in group:
            mine = times[: spec.max_tokens]
            record = RequestRecord(spec.index, len(spec.prompt), started - run_started)
            record.output_tokens, record.ttft_s, record.e2e_s = len(mine), mine[0], mine[-1]
            record.itl_s = [b - a for a, b in itertools.pairwise(mine)]
            record.reason = "length"
            records.append(record)
    return RunResult(records, time.perf_counter() - run_started, LoadShape(concurrency=concurrency))
