"""Chunked local attention (Llama 4's layout), whose chunk vLLM's KV events do not carry.

The index against vLLM itself is tests/test_real_captures.py (the ``llama4-chunked-local``
capture: exact told the model's chunk, never over told nothing). Here: the simulator's chunked
group against that index over random conversations with evictions, where the router learns the
chunk (its configuration, a local model folder), and the self-check naming the missing setting.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import config_for, serve_router, until, write_tokenizer

from indexer.index import PrefixIndex
from indexer.wire import decode_payload
from router.config import ConfigError, parse_config
from router.core import Router
from router.tokenize import model_attention_chunk
from simulator.engine import EngineConfig
from simulator.fleet import FastFleet
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
CHUNK = 64
LONGEST = 480  # tokens: 30 blocks a group, of a pool of 100
ENGINE = ("sim", 0)


def _conversations(seed: int, n: int) -> list[list[int]]:
    """Prompts of a few conversations, each turn extending the last past several chunks (a
    conversation past ``LONGEST`` tokens starts over), and branches from earlier points of a
    history, interleaved so that the pool evicts between turns."""
    rng = random.Random(seed)

    def fresh(k: int) -> list[int]:
        return [rng.randrange(100, 30_000) for _ in range(k)]

    history = {c: fresh(rng.randrange(20, 90)) for c in range(5)}
    out = []
    for _ in range(n):
        c = rng.randrange(5)
        history[c] = history[c] + fresh(rng.randrange(8, 70))
        if len(history[c]) > LONGEST:
            history[c] = fresh(rng.randrange(20, 90))
        out.append(history[c])
        if rng.random() < 0.2:
            out.append(history[c][: rng.randrange(1, len(history[c]))] + fresh(30))
    return out


def _replay(attention_chunk: int | None, seed: int) -> tuple[list[tuple[int, int]], int]:
    """(predicted, cached) per request of one simulated chunked-attention engine, one request
    at a time, the index fed every batch before the next request; and blocks evicted."""
    cfg = EngineConfig(block_size=BLOCK, num_gpu_blocks=100, groups=f"chunked:{CHUNK},full")
    fleet = FastFleet(1, cfg)
    index = PrefixIndex(unit=BLOCK, attention_chunk=attention_chunk)
    index.add_engine(ENGINE, "m")
    root = index.root("m")
    pairs: list[tuple[int, int]] = []
    t = 0.0
    for i, prompt in enumerate(_conversations(seed, 60)):
        predicted = index.match(prompt, root)[ENGINE].gpu_tokens
        fleet.submit(0, f"r{i}", prompt, 4, t)
        fleet.run_until(t + 1e4)
        t = fleet.now
        (done,) = fleet.completed()
        pairs.append((predicted, done.cached_tokens))
        for _w, _rank, _seq, payload in fleet.drain_events():
            index.apply(ENGINE, decode_payload(payload).events)
    stats = index.engine_stats(ENGINE)
    assert stats is not None
    assert stats.groups[0] == {
        "kind": "chunked_local_attention",
        "block_size": BLOCK,
        "sliding_window": None,
        "attention_chunk": attention_chunk,
    }
    return pairs, stats.counters["blocks_removed"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_simulators_chunked_group_is_what_the_index_predicts(seed: int) -> None:
    """Told the chunk, the index predicts every hit the simulator finds; told nothing, never
    more, and less where a chunk's earlier blocks were evicted (so the chunk is exercised)."""
    pairs, evicted = _replay(CHUNK, seed)
    assert evicted > 0, "the scenario evicts"
    assert sum(1 for _, cached in pairs if cached) >= 15, "the scenario hits"
    assert [p for p, c in pairs] == [c for _, c in pairs]
    unknown, _ = _replay(None, seed)
    assert all(p <= c for p, c in unknown), unknown
    assert sum(1 for p, c in unknown if p < c) >= 1, "an earlier chunk evicted under a hit"


def _folder(tmp_path: Path, config: object) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_the_chunk_is_read_from_the_local_models_config(tmp_path: Path) -> None:
    """Llama 4's own config nests it under text_config; a text-only one has it at the top."""
    nested = _folder(tmp_path / "a", {"text_config": {"attention_chunk_size": 8192}})
    assert model_attention_chunk(str(nested)) == 8192
    assert model_attention_chunk(str(nested / "tokenizer.json")) == 8192
    flat = _folder(tmp_path / "b", {"attention_chunk_size": 4096})
    assert model_attention_chunk(str(flat)) == 4096
    for odd in ({}, {"attention_chunk_size": None}, {"attention_chunk_size": True}, [1]):
        assert model_attention_chunk(str(_folder(tmp_path / "c", odd))) is None
    (tmp_path / "d").mkdir()
    assert model_attention_chunk(str(tmp_path / "d")) is None
    (tmp_path / "d" / "config.json").write_text("{not json")
    assert model_attention_chunk(str(tmp_path / "d")) is None


def test_the_configured_chunk_wins_over_the_model_folder(tmp_path: Path) -> None:
    folder = Path(write_tokenizer(tmp_path / "m"))
    (folder / "config.json").write_text(json.dumps({"attention_chunk_size": 8192}))
    base = {"workers": [{"url": "http://127.0.0.1:1"}]}
    local = {"tokenizer": {"mode": "local", "path": str(folder)}}
    assert Router(parse_config(base | local)).index.attention_chunk == 8192
    told = base | local | {"model": {"attention_chunk_tokens": 256}}
    assert Router(parse_config(told)).index.attention_chunk == 256
    assert Router(parse_config(base)).index.attention_chunk is None
    with pytest.raises(ConfigError, match=r"model\.attention_chunk_tokens"):
        parse_config(base | {"model": {"attention_chunk_tokens": 0}})


async def test_the_self_check_names_the_missing_chunk_and_is_exact_once_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker whose events declare a chunked group: the self-check says the chunk is
    unknown and which setting gives it; configured, it passes and the probe's hit is exact."""
    fast = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
    with running_fleet(1, num_gpu_blocks=1024, groups=f"chunked:{CHUNK},full", **fast) as ws:
        for chunk, want in ((None, "chunk_unknown"), (CHUNK, "ok")):
            cfg = config_for(ws, model={"attention_chunk_tokens": chunk})
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvrouter"):
                async with serve_router(cfg) as (base, router):
                    url = ws[0].url

                    def checked(url: str = url) -> dict[str, Any] | None:
                        res = router.selfcheck.debug(url) or {}
                        return res if res.get("groups") else None

                    res = await until(
                        checked,
                        30,
                        "the self-check",
                    )
                    assert (res["events"], res["hits"], res["groups"]) == ("ok", "ok", want), res
                    async with httpx.AsyncClient(timeout=30) as c:
                        index = (await c.get(base + "/debug/index")).json()
                    (engine,) = index["workers"][0]["engines"]
                    assert engine["groups"]["0"]["attention_chunk"] == chunk
            warned = [r.getMessage() for r in caplog.records if "attention_chunk" in r.getMessage()]
            assert bool(warned) == (chunk is None), warned
            if chunk is None:
                assert "model.attention_chunk_tokens" in res["groups_detail"]
