"""HF model directories: config.json plus safetensors (single file or sharded index).

Headers are parsed and checked by us before anything is mapped, so a truncated or corrupt file
gives one clear error; tensors are then memory-mapped (copy-on-write) and viewed without a copy.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, replace
from typing import Any

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture, token_ids_of
from services.engine_worker.artifacts.weights import validate_tensor_table
from shared.errors import ModelValidationError

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class _TensorEntry:
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise ModelValidationError(path, "file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelValidationError(path, f"not valid JSON ({error})") from None


class HFArtifact:
    def __init__(self, directory: str) -> None:
        self.path = directory
        self.config: dict[str, Any] = _read_json(os.path.join(directory, "config.json"))
        architecture = ModelArchitecture.from_hf_config(
            self.config, os.path.join(directory, "config.json")
        )
        # generation_config.json may name more end tokens (a chat model's end-of-turn, say).
        generation_file = os.path.join(directory, "generation_config.json")
        if os.path.exists(generation_file):
            generation = _read_json(generation_file)
            extra = generation.get("eos_token_id") if isinstance(generation, dict) else None
            eos = architecture.eos_token_ids + token_ids_of(extra)
            architecture = replace(architecture, eos_token_ids=tuple(dict.fromkeys(eos)))
        self.architecture = architecture
        self.files = self._weight_files()
        self.entries: dict[str, _TensorEntry] = {}
        for file in self.files:
            self.entries.update(self._read_header(file))
        self._maps: dict[str, mmap.mmap] = {}

    @property
    def quantization(self) -> str:
        return "+".join(sorted({e.dtype for e in self.entries.values()}))

    def _weight_files(self) -> list[str]:
        single = os.path.join(self.path, "model.safetensors")
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(single):
            return [single]
        if os.path.exists(index):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelValidationError(index, "weight_map is missing or empty")
            return [os.path.join(self.path, f) for f in sorted(set(weight_map.values()))]
        raise ModelValidationError(
            self.path, "no model.safetensors or model.safetensors.index.json"
        )

    def _read_header(self, file: str) -> dict[str, _TensorEntry]:
        try:
            size = os.path.getsize(file)
            with open(file, "rb") as handle:
                prefix = handle.read(8)
                if len(prefix) < 8:
                    raise ModelValidationError(
                        file, "file is truncated", expected=">= 8 bytes", found=f"{size} bytes"
                    )
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(_MAX_HEADER_BYTES, size - 8):
                    raise ModelValidationError(
                        file,
                        "corrupt safetensors header length",
                        expected=f"<= {size - 8}",
                        found=header_len,
                    )
                header = json.loads(handle.read(header_len))
        except FileNotFoundError:
            raise ModelValidationError(file, "file is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ModelValidationError(file, f"corrupt safetensors header ({error})") from None
        entries = {}
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = info.get("dtype"), tuple(info.get("shape", ()))
            if dtype not in _DTYPES:
                raise ModelValidationError(
                    file, "unsupported dtype", tensor=name, expected=sorted(_DTYPES), found=dtype
                )
            begin, end = (data_start + o for o in info["data_offsets"])
            numel = 1
            for dim in shape:
                numel *= dim
            if end - begin != numel * _DTYPES[dtype].itemsize:
                raise ModelValidationError(
                    file,
                    "tensor byte length does not match its shape",
                    tensor=name,
                    expected=numel * _DTYPES[dtype].itemsize,
                    found=end - begin,
                )
            if end > size:
                raise ModelValidationError(
                    file,
                    "file is truncated",
                    tensor=name,
                    expected=f">= {end} bytes",
                    found=f"{size} bytes",
                )
            entries[name] = _TensorEntry(file, dtype, shape, begin, end)
        return entries

    def validate(self) -> None:
        validate_tensor_table(
            self.path, self.architecture, {n: e.shape for n, e in self.entries.items()}
        )

    def load(self, name: str) -> torch.Tensor:
        """A view of the mapped file; converting or fusing it is the only copy."""
        entry = self.entries[name]
        if entry.file not in self._maps:
            with open(entry.file, "rb") as handle:
                self._maps[entry.file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        if entry.end == entry.begin:
            return torch.empty(entry.shape, dtype=_DTYPES[entry.dtype])
        flat = torch.frombuffer(
            self._maps[entry.file],
            dtype=_DTYPES[entry.dtype],
            count=(entry.end - entry.begin) // _DTYPES[entry.dtype].itemsize,
            offset=entry.begin,
        )
        return flat.view(entry.shape)

    def load_int4(self, name: str) -> None:
        """safetensors hold float tensors: no 4-bit groups (`--quantize int4` makes them)."""
        return None
