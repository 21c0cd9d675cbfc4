"""Packed weights as files a prepared model maps instead of dequantizing and repacking.

Two torch files, each loaded with `mmap=True`: the 4-bit projections' parts (in either kernel's
layout: the artifact's key pins the CPU that chose it), loaded in inference mode because
`Int4Linear` makes them there (the compiled step's guards see the difference), and everything
else. An int8 projection is stored as its int8 rows and scales (in `kvmesh::int8_dot`'s layout
where that runs): fbgemm's packed form is an opaque object, prepacked again at load (the
default model's head: ~0.2 s).
"""

from __future__ import annotations

import torch

from services.engine_worker.torch_backend.int4_dot import Int4DotLinear
from services.engine_worker.torch_backend.int8_dot import Int8DotLinear
from services.engine_worker.torch_backend.linear import Int4Linear, Int8Linear, Projection
from services.engine_worker.torch_backend.weights import Int8Embedding, TorchLayer, TorchWeights

INT4_FILE = "weights-int4.pt"
OTHER_FILE = "weights.pt"
_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def save_packed(weights: TorchWeights, directory: str) -> list[str]:
    """The files written, relative to `directory`."""
    if weights.format != "packed" or not isinstance(weights.embed, Int8Embedding):
        raise ValueError("only packed weights are saved")
    int4: dict[str, torch.Tensor] = {}
    other: dict[str, torch.Tensor] = {
        "embed.rows": weights.embed.rows,
        "embed.scale": weights.embed.scale,
        "final_norm": weights.final_norm,
    }
    _put(other, int4, "lm_head", weights.lm_head)
    for index, layer in enumerate(weights.layers):
        for name, norm in layer.norms.items():
            other[f"{index}.{name}"] = norm
        for name in _PROJECTIONS:
            _put(other, int4, f"{index}.{name}", getattr(layer, name))
    torch.save(int4, f"{directory}/{INT4_FILE}")
    torch.save(other, f"{directory}/{OTHER_FILE}")
    return [INT4_FILE, OTHER_FILE]


def _put(
    other: dict[str, torch.Tensor], int4: dict[str, torch.Tensor], key: str, projection: Projection
) -> None:
    if isinstance(projection, Int4DotLinear):
        int4[f"{key}.nibbles"] = projection.nibbles
        int4[f"{key}.scales"], int4[f"{key}.mins"] = projection.scales, projection.mins
    elif isinstance(projection, Int4Linear):
        int4[f"{key}.packed"] = projection._packed
        int4[f"{key}.scale_zero"] = projection._scale_zero
        if projection.dense_parts is not None:
            int4[f"{key}.scale"], int4[f"{key}.zero"] = projection.dense_parts
    elif isinstance(projection, Int8DotLinear):
        other[f"{key}.int8_dot"], other[f"{key}.row_scale"] = (
            projection.weights,
            projection.row_scales,
        )
    elif isinstance(projection, Int8Linear):
        other[f"{key}.rows"], other[f"{key}.row_scale"] = projection.rows_and_scales
    else:
        raise TypeError(f"not a packed projection: {type(projection).__name__}")
    if projection.bias is not None:  # a normal tensor in both (`bias.float()` keeps it)
        other[f"{key}.bias"] = projection.bias


def load_packed(directory: str, num_layers: int) -> TorchWeights:
    with torch.inference_mode():
        int4 = torch.load(f"{directory}/{INT4_FILE}", mmap=True, weights_only=True)
    other = torch.load(f"{directory}/{OTHER_FILE}", mmap=True, weights_only=True)

    def projection(key: str) -> Projection:
        if f"{key}.nibbles" in int4:
            nibbles, scales, mins = (int4[f"{key}.{p}"] for p in ("nibbles", "scales", "mins"))
            return Int4DotLinear.from_parts(nibbles, scales, mins, other.get(f"{key}.bias"))
        if f"{key}.packed" in int4:
            dense = (int4[f"{key}.scale"], int4[f"{key}.zero"]) if f"{key}.scale" in int4 else None
            return Int4Linear.from_parts(
                int4[f"{key}.packed"], int4[f"{key}.scale_zero"], dense, other.get(f"{key}.bias")
            )
        if f"{key}.int8_dot" in other:
            return Int8DotLinear.from_parts(
                other[f"{key}.int8_dot"], other[f"{key}.row_scale"], other.get(f"{key}.bias")
            )
        return Int8Linear.from_rows(
            other[f"{key}.rows"], other[f"{key}.row_scale"], other.get(f"{key}.bias")
        )

    layers = tuple(
        TorchLayer(
            input_norm=other[f"{index}.input_norm"],
            qkv=projection(f"{index}.qkv"),
            o_proj=projection(f"{index}.o_proj"),
            post_norm=other[f"{index}.post_norm"],
            gate_up=projection(f"{index}.gate_up"),
            down=projection(f"{index}.down"),
            qk_norm=other.get(f"{index}.qk_norm"),
            attn_out_norm=other.get(f"{index}.attn_out_norm"),
            mlp_out_norm=other.get(f"{index}.mlp_out_norm"),
        )
        for index in range(num_layers)
    )
    embed = Int8Embedding.from_rows(other["embed.rows"], other["embed.scale"])
    return TorchWeights("packed", embed, layers, other["final_norm"], projection("lm_head"))
