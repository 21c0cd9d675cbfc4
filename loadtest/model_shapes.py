"""Random-weight F16 GGUF files in a published model's shapes, for GPU benchmarks of models we
cannot ship: kvmesh and llama.cpp then load the same file.

The tokenizer and chat template come from a GGUF we have (the default model, or the GPU
check's skeleton of it), its vocabulary padded with reserved control tokens up to the shape's
vocabulary size, so both engines load a tokenizer as they do for the real model. Weights are
streamed tensor by tensor (an 8B model is never whole in memory), drawn from one pool of random
values at a random offset each: the same bytes an engine moves, at a fraction of the time
random numbers for 8 billion values would take.

    python -m loadtest.model_shapes llama3-8b SOURCE.gguf TARGET.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy

_MOSTLY_F16 = 1  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16
_POOL = 1 << 24  # random values drawn once, read at a random offset per tensor
_PROJECTION_STD, _EMBEDDING_STD = 0.02, 0.15


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    # Llama-3.1-8B: what most people serve on one GPU.
    "llama3-8b": ModelShape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
}


def tensor_shapes(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, rows-first shape) of every tensor, in llama.cpp's names."""
    kv = shape.kv_heads * shape.head_dim
    tensors = [("token_embd.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn)),
        ]
    return [
        *tensors,
        ("output_norm.weight", (shape.hidden,)),
        ("output.weight", (shape.vocab, shape.hidden)),
    ]


def _metadata(reader: Any, writer: Any, shape: ModelShape) -> None:
    """The source's tokenizer and template, the shape's hyperparameters."""
    import gguf

    from kvmesh.convert import copy_gguf_metadata

    skipped = ("GGUF.", "general.", "llama.", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    copy_gguf_metadata(reader, writer, skipped)
    fields = reader.fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    if len(tokens) > shape.vocab:
        raise ValueError(f"the source's {len(tokens)} tokens exceed a {shape.vocab} vocabulary")
    padding = shape.vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(padding)]
    types += [int(gguf.TokenType.CONTROL)] * padding
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_name(f"random weights in {shape} shapes")
    writer.add_file_type(_MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)


def write_random_gguf(source: str, target: str, shape: ModelShape, seed: int = 0) -> None:
    """An F16 GGUF (norms F32) of `shape` with random weights and `source`'s tokenizer."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, "llama")
    _metadata(reader, writer, shape)
    tensors = tensor_shapes(shape)
    for name, rows_first in tensors:
        dtype = numpy.float32 if len(rows_first) == 1 else numpy.float16
        nbytes = int(numpy.prod(rows_first)) * numpy.dtype(dtype).itemsize
        writer.add_tensor_info(name, rows_first, numpy.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = numpy.random.default_rng(seed)
    pool = rng.standard_normal(_POOL, dtype=numpy.float32)
    pools = {std: (pool * std).astype(numpy.float16) for std in (_EMBEDDING_STD, _PROJECTION_STD)}
    for name, rows_first in tensors:
        if len(rows_first) == 1:
            values = 1.0 + 0.1 * pool[: rows_first[0]]
        else:
            std = _EMBEDDING_STD if name.startswith(("token_embd", "output.")) else _PROJECTION_STD
            start = int(rng.integers(_POOL))
            rolled = numpy.concatenate([pools[std][start:], pools[std][:start]])
            values = numpy.resize(rolled, int(numpy.prod(rows_first))).reshape(rows_first)
        writer.write_tensor_data(values)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("source", help="a GGUF whose tokenizer and chat template to take")
    parser.add_argument("target")
    args = parser.parse_args()
    write_random_gguf(args.source, args.target, SHAPES[args.shape])


if __name__ == "__main__":
    main()
