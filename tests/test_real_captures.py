"""Ground truth from a real vLLM 0.32 (CPU build): the index's predicted hit against the
``usage.prompt_tokens_details.cached_tokens`` vLLM reported, request by request.

Each capture (tests/fixtures/vllm-captures/NAME.capture.jsonl, written by
scripts/record_captures.py; docs/vllm-captures.md) holds vLLM's event frames in arrival order,
interleaved with the requests at the moment they were sent, after the event stream had gone
quiet. Replaying the frames into :class:`PrefixIndex` and matching each request where it sits
gives the prediction the router would have made; the router scores a request by
``gpu_tokens + cpu_tokens`` (router/verify.py), which is what vLLM counts as cached (local and
connector-loaded tokens alike).
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from indexer.index import EngineStats, PrefixIndex
from indexer.wire import BlockRemoved, BlockStored, decode_payload
from tests.ingest_impls import IMPLS, decoder
from tests.real_vllm_models import MODEL_GROUPS

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-captures"
ENGINE = ("http://vllm:8000", 0)


@pytest.fixture(autouse=True, params=IMPLS)
def ingest_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs with each decoder (tests/ingest_impls.py): Python and native."""
    monkeypatch.setattr(sys.modules[__name__], "decode_payload", decoder(request.param))


# name -> (model kind, CPU offloading); the kind's KV-cache groups, as its events declare them,
# are tests/real_vllm_models.py's MODEL_GROUPS.
CAPTURES: dict[str, tuple[str, bool]] = {
    "llama-dense": ("dense", False),
    "gemma3-hybrid": ("hybrid", False),
    "mistral-sliding": ("sliding", False),
    "llama-offload": ("dense", True),
    "gemma3-offload": ("hybrid", True),
    "mistral-cbor": ("sliding", False),
    "gemma3-fine": ("hybrid", False),
    "qwen3next-mamba": ("mamba", False),
    "gptoss-sinks": ("sinks", False),
    "llama4-chunked-local": ("llama4", False),
}

# Where the index and vLLM 0.32 part ways; docs/vllm-captures.md gives vLLM's rule, the code
# that deviates, and a fix for each. Strict: a fix makes the test pass and the marker must go.


@dataclass
class Replayed:
    header: dict[str, Any]
    stats: EngineStats | None = None
    requests: int = 0
    exact: int = 0
    over: list[str] = field(default_factory=list)
    under: list[str] = field(default_factory=list)
    events: Counter[str] = field(default_factory=Counter)
    cached: list[int] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.header['capture']}: {self.exact}/{self.requests} exact; "
            f"under {len(self.under)} {self.under[:5]}; over {len(self.over)} {self.over[:5]}"
        )


def load(name: str) -> list[dict[str, Any]]:
    path = FIXTURES / f"{name}.capture.jsonl"
    assert path.is_file(), f"missing fixture {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]


def prompt_of(request: dict[str, Any], earlier: list[list[int]]) -> list[int]:
    """The request's token ids; a record may name an earlier request it shares a prefix with
    (``same_prefix_as``, ``prefix_tokens``) and list only the rest (scripts/record_captures.py)."""
    if "token_ids" in request:
        tokens = request["token_ids"]
    else:
        shared = earlier[request["same_prefix_as"]][: request["prefix_tokens"]]
        assert len(shared) == request["prefix_tokens"]
        tokens = shared + request["token_ids_tail"]
    earlier.append(tokens)
    return tokens


def replay(name: str, attention_chunk: int | str | None = "model") -> Replayed:
    """Apply every frame in order; at each request, compare prediction and vLLM's report.
    ``attention_chunk``: what the index is told of a chunked-local-attention model's chunk
    (``"model"``: the model's own, as the router reads it from the model's config)."""
    lines = load(name)
    header = lines[0]
    assert header["type"] == "header"
    cpu = header["cpu_offload"]
    if attention_chunk == "model":
        attention_chunk = header.get("attention_chunk_size")
    assert not isinstance(attention_chunk, str)
    # As the router builds it (router/core.py): unit gcd(16, block size), configured chunk sizes.
    index = PrefixIndex(
        unit=math.gcd(16, header["block_size"]),
        cpu_chunk_tokens=cpu["chunk_tokens"] if cpu else 256,
        attention_chunk=attention_chunk,
    )
    model = header["served_model_name"]
    index.add_engine(ENGINE, model)
    root = index.root(model)
    out = Replayed(header)
    prompts: list[list[int]] = []
    expected_seq = 0
    for line in lines[1:]:
        if line["type"] == "frame":
            assert line["seq"] == expected_seq, "frames are contiguous from 0"
            expected_seq += 1
            batch = decode_payload(base64.b64decode(line["payload"]))
            assert (batch.unknown_events, batch.unknown_fields) == (0, 0)
            for ev in batch.events:
                if isinstance(ev, BlockStored | BlockRemoved):
                    out.events[f"{type(ev).__name__} {ev.medium}"] += 1
            index.apply(ENGINE, batch.events)
            continue
        assert line["type"] == "request"
        tokens = prompt_of(line, prompts)
        assert line["prompt_tokens"] == len(tokens)
        m = index.match(tokens, root)[ENGINE]
        predicted = m.gpu_tokens + m.cpu_tokens
        cached = line["cached_tokens"]
        out.requests += 1
        out.cached.append(cached)
        note = f"{line['label']}: {m.gpu_tokens}+{m.cpu_tokens} vs {cached}"
        if predicted == cached:
            out.exact += 1
        elif predicted > cached:
            out.over.append(note)
        else:
            out.under.append(note)
    out.stats = index.engine_stats(ENGINE)
    return out


@pytest.mark.parametrize("name", list(CAPTURES))
def test_capture_is_what_it_claims(name: str) -> None:
    """The fixture itself: a real 0.32 engine with the declared groups, enough requests, hits
    and evictions (and CPU loads with offloading), every frame decoding with nothing unknown."""
    kind, offload = CAPTURES[name]
    groups = MODEL_GROUPS[kind]
    r = replay(name)
    h = r.header
    assert (h["capture"], h["model_kind"], h["vllm_version"]) == (name, kind, "0.32.0")
    assert {
        g: (v["kind"], v["block_size"], v["sliding_window"]) for g, v in h["groups"].items()
    } == groups
    assert r.requests >= 35
    assert sum(1 for c in r.cached if c > 0) >= 25, "the scenario reuses prefixes"
    assert r.events["BlockRemoved GPU"] > 0, "the scenario evicts"
    assert (r.events["BlockStored CPU"] > 0) == offload
    if offload:
        assert r.events["BlockRemoved CPU"] > 0, "the CPU tier evicts too"


def test_captures_hold_150_requests() -> None:
    assert sum(replay(name).requests for name in CAPTURES) >= 150


@pytest.mark.parametrize("name", list(CAPTURES))
def test_predicted_hit_equals_vllm_cached_tokens(name: str, capsys) -> None:
    r = replay(name)
    with capsys.disabled():
        print(f"\n[real vLLM {r.header['vllm_version']}] {r.summary()}")
    assert r.exact == r.requests, r.summary()
    # Exact predictions from a wrong state would be luck: the index must also have followed
    # every event (no hash it could not place, no removal of a block it did not hold).
    assert r.stats is not None
    assert r.stats.counters["unresolved_hashes"] == 0
    assert r.stats.counters["unknown_removes"] == 0
    assert r.stats.counters["unknown_parent"] == 0


def test_a_match_unit_finer_than_the_blocks_is_never_over_predicted(capsys) -> None:
    """The mamba hybrid again with ``--prefix-match-unit 32`` under its 96-token blocks: vLLM
    then also hits at the unit boundaries inside a block, through partial entries whose place
    its events do not give (docs/vllm-reference.md, "Partial blocks"). The index keeps the
    groups' block sizes, never predicts more than vLLM finds, and is exact wherever vLLM's hit
    ends on a block end."""
    r = replay("qwen3next-fine")
    h = r.header
    with capsys.disabled():
        print(f"\n[real vLLM {h['vllm_version']}] {r.summary()}")
    assert {g: (v["kind"], v["block_size"]) for g, v in h["groups"].items()} == {
        "0": ("mamba", 96),
        "1": ("full_attention", 96),
    }
    assert r.stats is not None
    assert {g: v["block_size"] for g, v in r.stats.groups.items()} == {0: 96, 1: 96}
    assert r.over == []
    assert r.requests >= 35 and r.under, "the scenario hits between block ends"
    between = [c for c in r.cached if c % 96]
    assert len(r.under) <= len(between), r.summary()
    for note in r.under:
        assert int(note.rsplit(" ", 1)[1]) % 96, f"a block-end hit under-predicted: {note}"
    counters = r.stats.counters
    assert counters["partial_blocks"] > 0
    assert counters["unknown_parent"] == counters["unresolved_hashes"] == 0


def test_chunked_local_attention_needs_the_models_chunk(capsys) -> None:
    """Llama 4's layout (chunked local attention beside full attention), whose chunk vLLM's
    events do not carry: told the model's chunk the index is exact (above); not told, it reads
    the group as full attention and never predicts more than vLLM finds, only less where a
    chunk's earlier blocks were evicted; told a chunk of one block (every point a chunk
    boundary, no block of the group needed) it predicts hits vLLM does not find."""
    name = "llama4-chunked-local"
    header = load(name)[0]
    assert header["attention_chunk_size"] == 128
    unknown = replay(name, attention_chunk=None)
    one_block = replay(name, attention_chunk=header["block_size"])
    with capsys.disabled():
        print(f"\n[chunk unknown] {unknown.summary()}\n[chunk of a block] {one_block.summary()}")
    told = replay(name)
    assert told.stats is not None and unknown.stats is not None
    assert told.stats.groups[0]["attention_chunk"] == 128
    assert unknown.stats.groups[0]["attention_chunk"] is None
    assert unknown.over == [] and unknown.under, unknown.summary()
    assert one_block.over, one_block.summary()
