"""Reading a worker's /tokenize answer: the ids found by the fast path are always the answer's
top-level ``tokens``, and anything that is not a valid answer is a TokenizeError."""

from __future__ import annotations

import json

import pytest

from router.tokenize import TokenizeError, decode_tokenize_response

IDS = [0, 7, 31999, 4294967295, 12]


@pytest.mark.parametrize(
    "body",
    [
        # vLLM's own layout (pydantic, compact), and with spaces and newlines.
        json.dumps({"count": 5, "max_model_len": 4096, "tokens": IDS, "token_strs": None}),
        json.dumps({"count": 5, "tokens": IDS}, indent=2),
        # Fields in another order; token strings before the ids, one of them mimicking the key.
        json.dumps({"token_strs": ['"tokens":[1]', "tokens"], "tokens": IDS, "count": 5}),
        # A nested "tokens" key before the real one: found first, then refused by the check.
        json.dumps({"meta": {"tokens": [9, 9]}, "tokens": IDS}),
        # No count at all.
        json.dumps({"tokens": IDS}),
    ],
)
def test_the_top_level_tokens_are_read_exactly(body: str) -> None:
    got = decode_tokenize_response(body.encode())
    assert got.tolist() == IDS
    assert json.loads(got.json) == IDS  # what goes upstream is that same array


def test_duplicate_keys_read_as_msgspec_reads_them() -> None:
    got = decode_tokenize_response(b'{"tokens": [1, 2], "tokens": [3]}')
    assert got.tolist() == [3]


def test_an_empty_prompt_is_an_empty_array() -> None:
    got = decode_tokenize_response(b'{"count":0,"tokens":[]}')
    assert got.tolist() == [] and got.json == b"[]"


@pytest.mark.parametrize(
    "body",
    [
        b'{"count": 3, "tokens": [1, 2]}',  # count disagrees
        b'{"tokens": [1, -2]}',
        b'{"tokens": [1, 2.0]}',
        b'{"tokens": [4294967296]}',
        b'{"tokens": ["1"]}',
        b'{"tokens": [[1]]}',
        b'{"tokens": [1, 2]',  # truncated
        b'{"tokens": [1, 2]} trailing',
        b'{"tokens": null}',
        b'{"count": 2}',
        b"[1, 2]",
        b"",
        b"\xff\xfe",
    ],
)
def test_anything_else_is_a_tokenize_error(body: bytes) -> None:
    with pytest.raises(TokenizeError, match="bad /tokenize response"):
        decode_tokenize_response(body)
