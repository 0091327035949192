"""``kvrouter doctor`` against real simulated workers (``kvrouter-sim`` subprocesses, real HTTP
and ZMQ on loopback): a healthy fleet exits 0; every misconfiguration is reported with the flag
that fixes it and a non-zero exit; the JSON shape; every run bounded in time."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import TOOLS_TEMPLATE, write_tokenizer

from router.doctor import Options, Report, diagnose, main
from simulator.testing import find_port_block, running_fleet

SIM = {"block_size": 16, "num_gpu_blocks": 512}
# Short waits keep the failing cases quick; a healthy simulated worker answers in milliseconds.
FAST = ["--events-wait", "1.5", "--timeout", "2", "--deadline", "20"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main([*FAST, "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def check(doc: dict[str, Any], url: str, name: str) -> dict[str, Any]:
    w = next(w for w in doc["workers"] if w["url"] == url)
    return next(c for c in w["checks"] if c["check"] == name)


def fleet_check(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in doc["fleet"] if c["check"] == name)


def failing(doc: dict[str, Any]) -> set[str]:
    rows = [c for w in doc["workers"] for c in w["checks"]]
    return {c["check"] for c in rows if c["status"] == "fail"}


def test_healthy_fleet_exits_zero_with_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    with running_fleet(2, lora=["ad1"], **SIM) as ws:
        code = main([*FAST, *(w.url for w in ws)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "routable: every check passed" in out and "FAIL" not in out and "fix:" not in out
    header = out.splitlines()[0]
    assert header.split() == ["WORKER", "CHECK", "STATUS", "DETAIL"]
    # aligned columns: every row's STATUS starts where the header's does
    col = header.index("STATUS")
    rows = [ln for ln in out.splitlines()[1:] if ln.strip() and not ln.startswith("routable")]
    assert rows and all(ln[col : col + 2] == "OK" for ln in rows), out


def test_json_shape_and_facts(capsys: pytest.CaptureFixture[str]) -> None:
    with running_fleet(1, dp_size=2, lora=["ad1", "ad2"], **SIM) as (w,):
        code, doc = run(capsys, w.url)
    assert code == 0 and doc["ok"] is True and doc["exit_code"] == 0, doc
    assert set(doc) == {"ok", "exit_code", "elapsed_s", "workers", "fleet"}
    (rep,) = doc["workers"]
    assert rep["url"] == w.url
    assert rep["models"] == ["sim-model"] and rep["loras"] == ["ad1", "ad2"]
    assert rep["dp_size"] == 2 and rep["block_sizes"] == [16]
    assert rep["events_endpoints"] == [w.rank_endpoints(r)[0] for r in (0, 1)]
    assert rep["replay_endpoints"] == [w.rank_endpoints(r)[1] for r in (0, 1)]
    assert rep["cached_tokens"] and rep["cached_tokens"] % 16 == 0
    assert abs(rep["clock_skew_s"]) < 1.0
    names = [c["check"] for c in rep["checks"]]
    assert set(names) == {
        "reach",
        "models",
        "tokenizer",
        "chat",
        "events",
        "replay",
        "usage",
        "prefix-cache",
        "block-size",
        "groups",
        "dp",
        "clock",
    }
    for c in rep["checks"] + doc["fleet"]:
        assert set(c) == {"check", "status", "detail", "fix"} and c["status"] == "ok", c
    assert {c["check"] for c in doc["fleet"]} == {"tokenizer", "models", "loras", "block-size"}


@pytest.mark.parametrize(
    ("flags", "fails", "fix"),
    [
        ({"no_events": True}, {"events"}, "--kv-events-config"),
        ({"no_replay": True}, {"replay"}, '"replay_endpoint"'),
        ({"no_prompt_tokens_details": True}, {"usage"}, "--enable-prompt-tokens-details"),
        ({"no_prefix_caching": True}, {"prefix-cache", "events"}, "--enable-prefix-caching"),
        ({"event_clock_skew": 30}, {"clock"}, "NTP"),
        ({"event_block_size_lie": 32}, {"block-size"}, "--block-size"),
    ],
)
def test_each_misconfiguration_names_its_fix(
    capsys: pytest.CaptureFixture[str], flags: dict[str, Any], fails: set[str], fix: str
) -> None:
    with running_fleet(1, **{**SIM, **flags}) as (w,):
        code, doc = run(capsys, w.url)
    assert code == 1 and doc["ok"] is False
    assert failing(doc) == fails, doc
    for name in fails:
        assert fix in check(doc, w.url, name)["fix"], doc


def test_a_chunked_attention_model_is_routable_once_told_its_chunk(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Llama 4's layout: vLLM's events name the chunked group but not its chunk, which the
    router must be told; a warning (never more than vLLM hits), with the setting that fixes it."""
    with running_fleet(1, groups="chunked:64,full", **SIM) as (w,):
        code, doc = run(capsys, w.url)
    groups = check(doc, w.url, "groups")
    assert code == 0 and failing(doc) == set(), doc
    assert groups["status"] == "warn", groups
    assert "0: chunked_local_attention, 1: full_attention" in groups["detail"]
    assert "model.attention_chunk_tokens" in groups["fix"]


def test_a_gpt_oss_worker_renders_chats_in_harmony(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM renders a GPT-OSS model's chat completions in harmony, not with the template its
    /tokenize applies: the probe chat's length tells, and the router renders them so."""
    with running_fleet(1, chat_format="harmony", **SIM) as (w,):
        code, doc = run(capsys, w.url)
    chat = check(doc, w.url, "chat")
    assert code == 0 and chat["status"] == "ok" and "harmony" in chat["detail"], doc
    with running_fleet(1, **SIM) as (w,):
        code, doc = run(capsys, w.url)
    assert "template" in check(doc, w.url, "chat")["detail"]


def test_a_worker_dropping_tools_under_tool_choice_none_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A worker started with ``--exclude-tools-when-tool-choice-none`` renders the probe chat
    with ``tool_choice: "none"`` without its tool; one without the flag renders it."""
    model = write_tokenizer(tmp_path / "model", template=TOOLS_TEMPLATE)
    for excluded in (True, False):
        flags = {"exclude_tools_when_tool_choice_none": excluded}
        with running_fleet(1, tokenizer=model, **flags, **SIM) as (w,):
            code, doc = run(capsys, w.url)
        tools = check(doc, w.url, "tools")
        assert code == 0 and tools["status"] == "ok", doc
        assert ("without its tools" in tools["detail"]) is excluded, tools


def test_clock_skew_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    with running_fleet(1, event_clock_skew=-7.5, **SIM) as (w,):
        code, doc = run(capsys, w.url)
    assert code == 1
    assert -7.6 < doc["workers"][0]["clock_skew_s"] < -7.4
    with running_fleet(1, event_clock_skew=1.0, **SIM) as (w,):
        code, doc = run(capsys, "--max-skew", "5", w.url)
    assert code == 0 and 0.9 < doc["workers"][0]["clock_skew_s"] < 1.1


def test_events_advertised_but_not_published(capsys: pytest.CaptureFixture[str]) -> None:
    with running_fleet(1, **SIM) as (w,):
        httpx.post(
            w.url + "/sim/faults", json={"events_enabled": False}, timeout=5
        ).raise_for_status()
        code, doc = run(capsys, w.url)
    ev = check(doc, w.url, "events")
    assert code == 1 and ev["status"] == "fail"
    assert "no BlockStored" in ev["detail"] and '"publisher": "zmq"' in ev["fix"]
    # caching is on: the repeated probe hits even though no event was seen
    assert check(doc, w.url, "prefix-cache")["status"] == "ok"


def test_configured_endpoints_unreachable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Endpoints given with the URL (or in a kvrouter config) are used instead of
    /kv_event_sources; a port nobody publishes on is reported as unreachable."""
    with running_fleet(1, **SIM) as (w,):
        dead = find_port_block(2)
        dead_replay = dead + 1
        cfg = tmp_path / "kvrouter.yaml"
        cfg.write_text(
            f"workers:\n  - url: {w.url}\n    events: tcp://127.0.0.1:{dead}\n"
            f"    replay: tcp://127.0.0.1:{dead_replay}\n"
        )
        t0 = time.monotonic()
        code, doc = run(capsys, "--config", str(cfg))
        took = time.monotonic() - t0
        good, _ = run(capsys, f"{w.url};events={w.events_endpoint};replay={w.replay_endpoint}")
    assert code == 1 and took < 15
    ev = check(doc, w.url, "events")
    assert ev["status"] == "fail" and f"tcp://127.0.0.1:{dead}" in ev["detail"]
    assert "reach the worker's ZMQ ports" in ev["fix"]
    assert check(doc, w.url, "replay")["status"] == "fail"
    assert good == 0


def test_fleet_differences(capsys: pytest.CaptureFixture[str]) -> None:
    """Tokenizer (chat template) and block size compared across the workers of a model; each
    difference fails with its fix. Another model, or an adapter on some workers only, is
    routable (requests go to the workers that serve them): a warning, not a failure."""
    with contextlib.ExitStack() as stack:
        (a,) = stack.enter_context(running_fleet(1, lora=["ad1"], **SIM))
        (b,) = stack.enter_context(
            running_fleet(1, lora=["ad1"], chat_template="alt", num_gpu_blocks=512, block_size=32)
        )
        (c,) = stack.enter_context(running_fleet(1, model="other-model", **SIM))
        (d,) = stack.enter_context(running_fleet(1, model="other-model", chat_template="alt"))
        code, doc = run(capsys, a.url, b.url, c.url, d.url)
    assert code == 1
    assert {f["check"] for f in doc["fleet"] if f["status"] == "fail"} == {
        "tokenizer",
        "block-size",
    }
    assert check(doc, a.url, "tokenizer")["status"] == "ok"
    tok = check(doc, b.url, "tokenizer")
    assert tok["status"] == "fail" and "chat" in tok["detail"] and "--chat-template" in tok["fix"]
    assert "prompt" not in tok["detail"]
    # other-model's two workers disagree with each other, not with sim-model's.
    assert sum(check(doc, u, "tokenizer")["status"] == "fail" for u in (c.url, d.url)) == 1
    models = fleet_check(doc, "models")
    assert models["status"] == "warn" and "other-model on 2" in models["detail"]
    assert all(check(doc, u, "models")["status"] == "ok" for u in (a.url, b.url, c.url))
    bs = fleet_check(doc, "block-size")
    assert "--block-size" in bs["fix"] and f"{b.url} 32" in bs["detail"]


def test_adapters_on_some_workers_are_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    with contextlib.ExitStack() as stack:
        (a,) = stack.enter_context(running_fleet(1, lora=["ad1"], **SIM))
        (b,) = stack.enter_context(running_fleet(1, **SIM))
        code, doc = run(capsys, a.url, b.url)
    assert code == 0
    loras = fleet_check(doc, "loras")
    assert loras["status"] == "warn" and "ad1" in loras["detail"]
    assert "lora.dynamic_loading" in loras["fix"]
    assert check(doc, b.url, "loras")["status"] == "warn"
    assert not any(f["status"] == "fail" for f in doc["fleet"])


def test_unreachable_worker_and_total_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{find_port_block(1)}"
    code, doc = run(capsys, dead)
    assert code == 1 and check(doc, dead, "reach")["status"] == "fail"
    with running_fleet(1, **SIM) as (w,):
        httpx.post(w.url + "/sim/faults", json={"stall_http": True}, timeout=5).raise_for_status()
        t0 = time.monotonic()
        code = main(["--json", "--timeout", "30", "--deadline", "1.5", w.url])
        took = time.monotonic() - t0
        doc = json.loads(capsys.readouterr().out)
        httpx.post(w.url + "/sim/faults", json={"stall_http": False}, timeout=5)
    assert code == 1 and took < 5, took
    dl = check(doc, w.url, "deadline")
    assert dl["status"] == "fail" and "1.5s deadline" in dl["detail"]


async def test_diagnose_api() -> None:
    with running_fleet(1, **SIM) as (w,):
        report = await diagnose([w.url], Options(events_wait_s=2.0, deadline_s=20.0))
    assert isinstance(report, Report) and report.ok and report.exit_code == 0
    assert report.workers[0].block_sizes == [16]


def test_probe_fits_a_short_context(capsys: pytest.CaptureFixture[str]) -> None:
    """The probe is cut to the worker's max_model_len (from /v1/models)."""
    with running_fleet(1, max_model_len=100, **SIM) as (w,):
        code, doc = run(capsys, w.url)
    assert code == 0, doc
    assert check(doc, w.url, "prefix-cache")["detail"].endswith("of 99 tokens")


def test_usage_errors() -> None:
    assert main([]) == 2
    assert main(["http://h:1;bogus=1"]) == 2
    assert main(["--timeout", "0", "http://h:1"]) == 2
