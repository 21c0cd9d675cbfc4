"""Our one-pass GGUF metadata reader against the `gguf` package's own, on every value type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.gguf_metadata import read_gguf_metadata


def gguf_package_metadata(path: Path) -> dict[str, object]:
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    return {key: field.contents() for key, field in fields.items() if not key.startswith("GGUF.")}


def write(path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "naïve — ünïcode ✓")
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.ints", list(range(-3, 3)))
    writer.add_token_list([f"tok{i} ✓" for i in range(5000)] + ["", "Ġspace"])
    writer.add_token_types([1, 3] * 2501)
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_string("t.after", "still in step")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "values.gguf"
    write(path)
    ours = read_gguf_metadata(str(path))
    theirs = gguf_package_metadata(path)
    assert ours.keys() == theirs.keys()
    assert ours.pop("t.nested") == [[1, 2], [3]]  # the package flattens nested arrays
    for key, value in ours.items():
        assert value == theirs[key] and type(value) is type(theirs[key]), key
    assert ours["tokenizer.ggml.tokens"][-1] == "Ġspace" and ours["t.after"] == "still in step"


def test_not_a_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.bin"
    path.write_bytes(b"not a model at all" * 4)
    with pytest.raises(ValueError):
        read_gguf_metadata(str(path))
