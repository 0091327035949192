"""Frames recorded from a real vLLM 0.32 (CPU build): decoding and indexing what vLLM really sends.

See tests/fixtures/vllm-captures/README.md for what each capture shows.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from indexer.index import PrefixIndex
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, decode_payload
from tests.ingest_impls import IMPLS, decoder

CAPTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-captures"
NAMES = [
    "llama-b32",
    "gemma3-swa",
    "gemma3-swa-dense",
    "mistral-swa",
    "llama-offload-sd",
    "llama-offload-legacy",
]
ENGINE = ("http://vllm:8000", 0)

MODEL = "tiny"


@pytest.fixture(autouse=True, params=IMPLS)
def ingest_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs with each decoder (tests/ingest_impls.py): Python and native."""
    monkeypatch.setattr(sys.modules[__name__], "decode_payload", decoder(request.param))


def frames(name: str) -> list[list[bytes]]:
    path = CAPTURES / f"{name}.frames.jsonl"
    assert path.is_file(), f"missing fixture {path}"
    lines = path.read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]


def batches(name: str) -> list[DecodedBatch]:
    return [decode_payload(f[2]) for f in frames(name)]


def replay(name: str, upto: int | None = None) -> tuple[PrefixIndex, list[list[int]]]:
    """Index after applying the capture's first ``upto`` messages, and the prompts seen
    (token_ids of GPU stores from token 0)."""
    index = PrefixIndex(unit=32, cpu_chunk_tokens=256)
    index.add_engine(ENGINE, MODEL)
    prompts: list[list[int]] = []
    for batch in batches(name)[:upto]:
        for ev in batch.events:
            from_root = isinstance(ev, BlockStored) and ev.parent_block_hash is None
            if from_root and ev.medium == "GPU" and ev.token_ids and ev.token_ids not in prompts:
                prompts.append(ev.token_ids)
        index.apply(ENGINE, batch.events)
    return index, prompts


def hit(index: PrefixIndex, tokens: list[int]) -> tuple[int, int]:
    m = index.match(tokens, index.root(MODEL))[ENGINE]
    return m.gpu_tokens, m.cpu_tokens


@pytest.mark.parametrize("name", NAMES)
def test_every_frame_decodes_with_nothing_unknown(name: str) -> None:
    msgs = frames(name)
    assert msgs
    for seq, msg in enumerate(msgs):
        assert len(msg) == 3
        assert msg[0] == b"kv-events"
        assert int.from_bytes(msg[1], "big") == seq  # from 0, no gaps in these captures
        batch = decode_payload(msg[2])
        assert batch.data_parallel_rank == 0
        assert (batch.unknown_events, batch.unknown_fields) == (0, 0)
        assert batch.events


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("llama-b32", {0: ("full_attention", 32, None)}),
        ("gemma3-swa", {0: ("sliding_window", 32, 64), 1: ("full_attention", 32, None)}),
        ("gemma3-swa-dense", {0: ("sliding_window", 32, 64), 1: ("full_attention", 32, None)}),
        ("mistral-swa", {0: ("sliding_window", 32, 64)}),
        ("llama-offload-sd", {0: ("full_attention", 32, None)}),
    ],
)
def test_group_kinds_and_block_sizes_learned(name: str, groups: dict) -> None:
    index, _ = replay(name)
    learned = index.engine_stats(ENGINE).groups
    assert {
        g: (v["kind"], v["block_size"], v["sliding_window"]) for g, v in learned.items()
    } == groups


def test_sparse_sliding_window_lists_subset_of_full_attention_hashes() -> None:
    sparse_seen = 0
    for batch in batches("gemma3-swa"):
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        full = {h for e in stored if e.group_idx == 1 for h in e.block_hashes}
        for ev in stored:
            if ev.group_idx == 0 and len(ev.block_hashes) < len(ev.token_ids) // ev.block_size:
                sparse_seen += 1
                assert set(ev.block_hashes) <= full  # same values for the same boundary
    assert sparse_seen >= 3
    index, _ = replay("gemma3-swa")
    assert index.engine_stats(ENGINE).counters["unresolved_hashes"] == 0


def test_sparse_swa_event_indexes_only_the_listed_tail() -> None:
    index, prompts = replay("gemma3-swa", upto=1)  # one 192-token prompt, SWA lists 2 blocks
    assert index.engine_stats(ENGINE).resident == {"0/GPU": 2, "1/GPU": 6}
    p = prompts[0]
    assert hit(index, [*p, 1]) == (192, 0)
    # A request sharing only 128 tokens: the window (2 blocks of 32) ending at 128 was never
    # cached in the sliding group, so vLLM finds no hit at all.
    assert hit(index, [*p[:128], 9, 9, 9]) == (0, 0)


def test_sliding_only_eviction_leaves_prefix_partly_usable() -> None:
    """gemma3-swa-dense msg 4 evicts sliding-window blocks 1-3 of the first prompt while full
    attention keeps all 6: the full prompt stays usable (its window tail, blocks 4-5, is
    resident), a 128-token prefix falls back to 32 (a run from block 0) -- not 128, not 0."""
    index, prompts = replay("gemma3-swa-dense", upto=5)
    removed = [e for e in batches("gemma3-swa-dense")[4].events if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in removed} == {0}
    p = prompts[0]
    assert hit(index, [*p, 1]) == (192, 0)
    explain = index.match([*p[:128], 9], index.root(MODEL))[ENGINE]
    assert explain.gpu_tokens == 32
    assert {g.kind: g.hit_tokens for g in explain.groups} == {
        "full_attention": 128,
        "sliding_window": 32,
    }


def test_sliding_window_only_model_hashes_located_exactly() -> None:
    index, prompts = replay("mistral-swa")
    counters = index.engine_stats(ENGINE).counters
    assert counters["unresolved_hashes"] == 0
    assert counters["cleared"] == 1
    # After the reset only prompt A (192 tokens cached, SWA tail = blocks 4-5) is resident.
    assert hit(index, [*prompts[0], 1]) == (192, 0)
    assert index.engine_stats(ENGINE).resident == {"0/GPU": 2}


def test_report_mode_full_reannounce_is_not_a_new_copy() -> None:
    for name, events in (("llama-b32", 1), ("gemma3-swa", 2)):  # one event per KV-cache group
        index, _ = replay(name)
        assert index.engine_stats(ENGINE).counters["reannounced"] == events, name
    index, _ = replay("gemma3-swa")
    assert (
        index.engine_stats(ENGINE).resident["0/GPU"] < index.engine_stats(ENGINE).resident["1/GPU"]
    ), "the sliding group holds only its tails, not the re-announced positions"


def test_all_blocks_cleared_published_with_next_request() -> None:
    msgs = batches("llama-b32")
    cleared = [
        i for i, b in enumerate(msgs) if any(isinstance(e, AllBlocksCleared) for e in b.events)
    ]
    assert len(cleared) == 1
    batch = msgs[cleared[0]]
    assert isinstance(batch.events[0], AllBlocksCleared)
    assert any(isinstance(e, BlockStored) for e in batch.events[1:])
    index, _ = replay("llama-b32", upto=cleared[0])
    assert index.resident_blocks(ENGINE) > 0
    index.apply(ENGINE, batch.events[:1])
    assert index.resident_blocks(ENGINE) == 0


def test_self_describing_cpu_events_share_keys_with_gpu_and_extend_hits() -> None:
    msgs = batches("llama-offload-sd")
    gpu_hashes = {
        h
        for b in msgs
        for e in b.events
        if isinstance(e, BlockStored) and e.medium == "GPU"
        for h in e.block_hashes
    }
    cpu = [e for b in msgs for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu and all(len(e.block_hashes) == 8 and len(e.token_ids) == 256 for e in cpu)
    assert all(e.block_size == 32 for e in cpu)
    assert {h for e in cpu for h in e.block_hashes} <= gpu_hashes
    # After msg 7 the GPU has evicted the 512-token prompt's tail: 192 tokens on GPU, the rest
    # loadable as whole CPU chunks up to 512.
    index, prompts = replay("llama-offload-sd", upto=8)
    long_prompt = next(p for p in prompts if len(p) == 512)
    assert hit(index, [*long_prompt, 1]) == (192, 320)
    # Exactly 512 tokens: both chunks load, and vLLM reports them cached in full (it recomputes
    # the last token only after admission).
    assert hit(index, long_prompt) == (192, 320)
    assert index.engine_stats(ENGINE).counters["unresolved_hashes"] == 0


def test_placeholder_cpu_events_resolve_to_the_same_hits() -> None:
    msgs = batches("llama-offload-legacy")
    cpu = [e for b in msgs for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu and all(
        (len(e.block_hashes), e.token_ids, e.block_size, e.parent_block_hash) == (1, [], 0, None)
        for e in cpu
    )
    legacy, prompts = replay("llama-offload-legacy", upto=8)
    described, _ = replay("llama-offload-sd", upto=8)
    assert legacy.engine_stats(ENGINE).counters["unresolved_hashes"] == 0
    for p in prompts:
        assert hit(legacy, [*p, 1]) == hit(described, [*p, 1])
    long_prompt = next(p for p in prompts if len(p) == 512)
    assert hit(legacy, [*long_prompt, 1]) == (192, 320)
