"""The paged KV pool, sized from a memory budget rather than from the context length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine_worker.architecture import ModelArchitecture
from shared.errors import KvmeshError, Reason


@dataclass(frozen=True)
class KVCacheShape:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    @staticmethod
    def from_budget(
        arch: ModelArchitecture, block_size: int, budget_bytes: int, dtype: torch.dtype
    ) -> KVCacheShape:
        element = torch.empty((), dtype=dtype).element_size()
        block_bytes = arch.kv_bytes_per_token(element) * block_size
        num_blocks = budget_bytes // block_bytes
        if num_blocks < 2:
            raise KvmeshError(
                Reason.KV_CACHE_TOO_SMALL,
                f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{block_bytes} bytes; at least 2 are needed",
            )
        return KVCacheShape(
            num_blocks, block_size, arch.num_kv_heads, arch.head_dim, arch.num_layers
        )

    def num_bytes(self, element_bytes: int) -> int:
        per_block = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size
        return self.num_blocks * per_block * element_bytes


class KVCache:
    """Per layer, K as (num_blocks, num_kv_heads, head_dim, block_size) and V as
    (num_blocks, num_kv_heads, block_size, head_dim): the layouts decode attention reads rows of
    (see attention.py). Both are views of one pool allocated once.
    """

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: str = "cpu") -> None:
        self.shape = shape
        dims = (
            shape.num_layers,
            2,
            shape.num_blocks,
            shape.num_kv_heads,
            shape.block_size,
            shape.head_dim,
        )
        self.pool = torch.zeros(dims, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Each (source, destination): the destination block becomes the source's copy, in
        every layer, K and V (a fork's own copy of its sibling's partial block)."""
        if pairs:
            sources, destinations = (list(column) for column in zip(*pairs, strict=True))
            self.pool[:, :, destinations] = self.pool[:, :, sources]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.shape
        keys = self.pool[index, 0].view(
            shape.num_blocks, shape.num_kv_heads, shape.head_dim, shape.block_size
        )
        return keys, self.pool[index, 1]
