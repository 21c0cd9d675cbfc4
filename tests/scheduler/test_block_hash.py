from __future__ import annotations

from shared.block_hash import hash_block, hash_full_blocks


def test_hashes_chain_the_whole_prefix() -> None:
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same second block, different parent


def test_partial_blocks_have_no_hash_and_salt_separates_tenants() -> None:
    assert hash_full_blocks([1, 2, 3], 4) == []
    assert hash_block(0, [1, 2, 3, 4]) != hash_block(0, [1, 2, 3, 4], salt=b"tenant-a")


def test_hash_values_are_stable_across_processes() -> None:
    # Pinned: the gateway router and every scheduler must compute the same numbers.
    assert hash_block(0, [1, 2, 3, 4]) == hash_block(0, (1, 2, 3, 4))
    assert hash_block(0, [1, 2, 3, 4]) == 0x30238DD4B4B13F9C
