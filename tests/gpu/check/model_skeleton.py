"""The default model without its weights, and a random-weight model written from it.

A GPU machine that reaches no registry gets the default model as a skeleton: every metadata key
(architecture, tokenizer, chat template) and each tensor's name, shape and type, ~3 MB where
the weights are 98 MB. It writes there the same model with random weights in the same tensor
types (Q4_1 projections, a Q8_0 embedding, F32 norms), which kvmesh and llama.cpp load as they
load the real one, and an F16 file of the same weights for llama.cpp's F16 run.

    python -m tests.gpu.check.model_skeleton skeleton SOURCE.gguf SKELETON.gguf
    python -m tests.gpu.check.model_skeleton random SKELETON.gguf TARGET.gguf [--f16]
"""

from __future__ import annotations

import argparse
import json

import numpy

from kvmesh.convert import copy_gguf_metadata

TENSORS_KEY = "kvmesh.skeleton.tensors"  # JSON: [[name, shape (GGUF order), type name], ...]
_SKIPPED_KEYS = ("GGUF.", "general.architecture", TENSORS_KEY)
_MOSTLY_F16 = 1  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16
# The embedding (also the LM head) N(0, 0.15): next-token distributions peaked enough that
# greedy choices are the weights', not rounding's. Projections N(0, 0.025): at 0.035 and more
# the 30 layers amplify bf16 rounding until a bf16 run's token is outside an fp32 run's top 3.
EMBEDDING_STD, PROJECTION_STD = 0.15, 0.025


def write_skeleton(source: str, target: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    copy_gguf_metadata(reader, writer, _SKIPPED_KEYS)
    tensors = [[t.name, t.shape.tolist(), t.tensor_type.name] for t in reader.tensors]
    writer.add_string(TENSORS_KEY, json.dumps(tensors))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random(skeleton: str, target: str, f16: bool = False, seed: int = 0) -> None:
    """The skeleton's model with random weights (norms near 1), each tensor in its recorded
    type, or F16 (norms F32) with `f16`: the same values either way."""
    import gguf

    reader = gguf.GGUFReader(skeleton)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    skipped = _SKIPPED_KEYS + (("general.file_type",) if f16 else ())
    copy_gguf_metadata(reader, writer, skipped)
    if f16:
        writer.add_file_type(_MOSTLY_F16)
    rng = numpy.random.default_rng(seed)
    for name, shape, type_name in json.loads(reader.fields[TENSORS_KEY].contents()):
        rows_first = tuple(reversed(shape))
        if len(shape) == 1:
            values = 1.0 + 0.1 * rng.standard_normal(rows_first, dtype=numpy.float32)
        else:
            std = EMBEDDING_STD if name.startswith("token_embd") else PROJECTION_STD
            values = std * rng.standard_normal(rows_first, dtype=numpy.float32)
        qtype = gguf.GGMLQuantizationType[type_name]
        if f16 and qtype != gguf.GGMLQuantizationType.F32:
            qtype = gguf.GGMLQuantizationType.F16
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    skeleton = commands.add_parser("skeleton")
    skeleton.add_argument("source")
    skeleton.add_argument("target")
    random = commands.add_parser("random")
    random.add_argument("skeleton")
    random.add_argument("target")
    random.add_argument("--f16", action="store_true")
    args = parser.parse_args()
    if args.command == "skeleton":
        write_skeleton(args.source, args.target)
    else:
        write_random(args.skeleton, args.target, args.f16)


if __name__ == "__main__":
    main()
