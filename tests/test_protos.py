"""The wire contract: generated code is current, and every field is documented."""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "protos" / "kvmesh" / "v1").glob("*.proto"))
_FIELD = re.compile(r"^\s*(optional |repeated )?[\w.<>, ]+ \w+ = \d+;")
_ENUM_VALUE = re.compile(r"^\s*[A-Z0-9_]+ = \d+;")


def test_generated_code_is_reproducible(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
        check=True,
    )
    committed = ROOT / "shared" / "pb" / "kvmesh" / "v1"
    fresh = tmp_path / "kvmesh" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    _, mismatch, errors = filecmp.cmpfiles(committed, fresh, names, shallow=False)
    assert not mismatch and not errors, f"stale generated code, run `make protos`: {mismatch}"


def test_every_field_and_enum_value_has_a_comment() -> None:
    undocumented = []
    for proto in PROTOS:
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            declares = _FIELD.match(line) or _ENUM_VALUE.match(line)
            if declares and not lines[number - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{number + 1}: {line.strip()}")
    assert not undocumented, "\n".join(undocumented)


def test_fields_whose_zero_would_be_wrong_are_optional() -> None:
    common = (ROOT / "protos" / "kvmesh" / "v1" / "common.proto").read_text()
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs"):
        assert re.search(rf"optional \w+ {name} = ", common), name
