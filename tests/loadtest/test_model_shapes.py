"""The random-weight GGUF bench-gpu writes in a published model's shapes: Llama-3.1-8B's
tensor table, and a small shape of the same recipe that kvmesh loads and decodes with a
vocabulary padded past the source tokenizer's."""

from __future__ import annotations

from pathlib import Path

import numpy

from kvmesh.engine import Engine
from loadtest.model_shapes import SHAPES, ModelShape, tensor_shapes, write_random_gguf
from shared.config import CacheConfig, EngineConfig
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams


def test_the_llama3_8b_shape_has_its_eight_billion_parameters() -> None:
    shape = SHAPES["llama3-8b"]
    parameters = sum(int(numpy.prod(rows)) for _, rows in tensor_shapes(shape))
    assert parameters == 8_030_261_248  # Llama-3.1-8B, untied head
    assert (shape.head_dim, shape.heads // shape.kv_heads) == (128, 4)


def test_a_written_shape_loads_and_decodes_with_its_padded_vocabulary(tmp_path: Path) -> None:
    import gguf

    shape = ModelShape(128, 2, 4, 2, 256, 49152 + 64, 2048, 500000.0)
    path = str(tmp_path / "shape.gguf")
    write_random_gguf(default_model_path(), path, shape)
    reader = gguf.GGUFReader(path)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == shape.vocab
    assert reader.fields["llama.attention.head_count_kv"].contents() == shape.kv_heads
    engine = Engine(
        EngineConfig(model=path, backend="torch", cache=CacheConfig(kv_memory_bytes=16 << 20))
    )
    assert engine.worker.architecture.vocab_size == shape.vocab
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (done,) = engine.generate([[1, 2, 3, shape.vocab - 1]], params)  # a padded token's id
    assert done.error is None and len(done.token_ids) == 4
