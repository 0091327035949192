"""The router's prompt keys cover what every hit rule reads: the GPU rule stops at ``n - 1``
tokens, but a CPU chunk may end exactly at ``n`` (vLLM then loads it and recomputes the last
token)."""

from __future__ import annotations

import asyncio

from indexer.index import PrefixIndex
from router.tokenize import PromptTokenizer
from tests.test_index import MODEL, W0, Engine, prompt


def _tokenized_match(index: PrefixIndex, tokens: list[int]) -> tuple[int, int]:
    tok = PromptTokenizer(index.unit)
    got = asyncio.run(tok.tokenize({"prompt": tokens}, False, index.root(MODEL), None))
    m = index.match_keys(got.keys, got.n_tokens, [W0])[W0]
    return m.gpu_tokens, m.cpu_tokens


def test_cpu_extension_of_a_prompt_that_ends_on_a_chunk_boundary() -> None:
    index, eng, p = PrefixIndex(cpu_chunk_tokens=256), Engine(), prompt(512)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 32, 16)])
    chunks = [eng.stored(p, 0, 16, 16, medium="CPU"), eng.stored(p, 16, 32, 16, medium="CPU")]
    index.apply(W0, chunks)
    index.apply(W0, eng.removed(p, list(range(31, -1, -1)), 16))
    m = index.match(p, index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (0, 512)
    assert _tokenized_match(index, p) == (0, 512), "the router's keys reach the chunk's end"


def test_gpu_hit_still_stops_at_n_minus_1() -> None:
    index, eng, p = PrefixIndex(cpu_chunk_tokens=256), Engine(), prompt(512)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 32, 16)])
    assert _tokenized_match(index, p) == (496, 0)
