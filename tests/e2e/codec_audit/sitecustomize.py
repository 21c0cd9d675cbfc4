"""Loaded by every mesh process the request-path test starts (it puts this folder first on
PYTHONPATH): counts each sampling decode, encode and validation, one line per call, in the file
KVMESH_TEST_CODEC_LOG names, tagged with the service (`-m services.<name>`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

LOG = os.environ.get("KVMESH_TEST_CODEC_LOG")


def _counted(what: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        service = os.path.basename(os.path.dirname(sys.argv[0] if sys.argv else ""))
        with open(LOG or os.devnull, "a", encoding="utf-8") as log:  # one short append: atomic
            log.write(f"{service} {what}\n")
        return function(*args, **kwargs)

    return counted


if LOG:
    import shared.codec
    import shared.sampling

    shared.codec.sampling_from_pb = _counted("decode", shared.codec.sampling_from_pb)
    shared.codec.sampling_to_pb = _counted("encode", shared.codec.sampling_to_pb)
    params = shared.sampling.SamplingParams
    params.validate = _counted("validate", params.validate)  # type: ignore[method-assign]
