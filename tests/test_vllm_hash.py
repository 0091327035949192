"""The hash-chain locator (indexer/vllm_hash.py): vLLM's chain recomputed under each algorithm
whose seed is knowable, the algorithm settled by the first listed hash it places. The real
captures (tests/test_real_captures.py: ``mistral-sliding`` with vLLM's default ``sha256``,
``mistral-cbor`` with ``sha256_cbor``) are the ground truth; these pin the encoding and the
settling."""

from __future__ import annotations

import pytest

from indexer.vllm_hash import ALGORITHMS, VllmHashLocator, cbor_canonical

# RFC 8949 Appendix A.
VECTORS = [
    (0, "00"),
    (23, "17"),
    (24, "1818"),
    (100, "1864"),
    (1000, "1903e8"),
    (1000000, "1a000f4240"),
    (1000000000000, "1b000000e8d4a51000"),
    (-1, "20"),
    (-1000, "3903e7"),
    ("", "60"),
    ("a", "6161"),
    ("IETF", "6449455446"),
    (b"", "40"),
    (b"\x01\x02\x03\x04", "4401020304"),
    ((), "80"),
    ((1, 2, 3), "83010203"),
    ((1, (2, 3), (4, 5)), "8301820203820405"),
    (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    (None, "f6"),
]


@pytest.mark.parametrize(("obj", "hexed"), VECTORS)
def test_canonical_cbor_matches_the_rfc(obj: object, hexed: str) -> None:
    assert cbor_canonical(obj).hex() == hexed


def test_what_cbor_cannot_carry_is_refused() -> None:
    for bad in (True, 1.5, {"a": 1}, 2**64):
        with pytest.raises((TypeError, ValueError)):
            cbor_canonical(bad)


def _vllm_chain(algorithm: str, blocks: list[tuple[int, ...]], seed: str) -> list[int]:
    """vLLM's ``hash_block_tokens`` chain from ``NONE_HASH``, low 64 bits per block."""
    fn = ALGORITHMS[algorithm]
    digest, out = fn(seed), []
    for block in blocks:
        digest = fn((digest, block, None))
        out.append(int.from_bytes(digest[-8:], "big"))
    return out


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_chain_is_placed_and_settles_its_algorithm(algorithm: str) -> None:
    tokens = list(range(500, 564))
    blocks = [tuple(tokens[i : i + 16]) for i in range(0, 64, 16)]
    hashes = _vllm_chain(algorithm, blocks, "vllm-none-hash")
    loc = VllmHashLocator()
    assert loc.algorithms == ("sha256", "sha256_cbor")
    placed = loc.chain(None, tokens[:32], 16, [11, 12], listed=[hashes[1]])
    assert placed is not None and placed[hashes[0]] == 11 and placed[hashes[1]] == 12
    assert loc.algorithms == (algorithm,)
    # Continued from a parent, the chain stays in the parent's algorithm: one hash per block.
    more = loc.chain(hashes[1], tokens[32:], 16, [13, 14], listed=[hashes[3]])
    assert more == {hashes[2]: 13, hashes[3]: 14}
    # Settled, a new chain from the root is computed once.
    assert len(loc.chain(None, tokens[:16], 16, [11]) or {}) == 1


def test_a_chain_under_an_unknown_seed_places_nothing_and_settles_nothing() -> None:
    tokens = list(range(16))
    other = _vllm_chain("sha256", [tuple(tokens)], "a-random-seed")
    loc = VllmHashLocator()
    placed = loc.chain(None, tokens, 16, [1], listed=other)
    assert placed is not None and other[0] not in placed
    assert loc.algorithms == ("sha256", "sha256_cbor")
    assert loc.chain(12345, tokens, 16, [1]) is None, "an unknown parent"


def test_the_locator_stays_within_its_entries() -> None:
    loc = VllmHashLocator(max_entries=10)
    for i in range(20):
        loc.chain(None, [i] * 16, 16, [i])
    assert len(loc) == 10
