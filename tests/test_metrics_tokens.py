"""/metrics: build info and prompt / completion tokens per model, with a bounded model label."""

from __future__ import annotations

import json
from importlib.metadata import version
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_router_support import FAST, config_for, serve_router, until, words

from router.metrics import model_label
from router.workers import ModelNames
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


async def _stream_usage(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    async with c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


async def test_tokens_per_model_and_build_info() -> None:
    with running_fleet(2, num_gpu_blocks=256, **FAST) as ws:
        cfg = config_for(ws)
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: router.registry.models.base == "sim-model", 20, "model learned")
            prompt = completion = 0
            for i in range(3):
                body = {"model": "sim-model", "prompt": words(100, f"m{i}"), "max_tokens": 3 + i}
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                prompt += r.json()["usage"]["prompt_tokens"]
                completion += r.json()["usage"]["completion_tokens"]
            streamed = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": words(50, "s")}],
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            usage = await _stream_usage(c, base + "/v1/chat/completions", streamed)
            assert usage["completion_tokens"] == 5
            prompt += usage["prompt_tokens"]
            completion += usage["completion_tokens"]
            for name in ("made-up-1", "made-up-2"):  # the worker refuses them: 404
                body = {"model": name, "prompt": "x", "max_tokens": 1}
                assert (await c.post(base + "/v1/completions", json=body)).status_code == 404

            async def counted() -> str | None:
                text = (await c.get(base + "/metrics")).text
                got = _samples(text, "kvrouter_model_completion_tokens_total")
                return text if got.get((("model", "sim-model"),)) == completion else None

            text = await until(counted, 10, "completion tokens counted")
            prompts = _samples(text, "kvrouter_model_prompt_tokens_total")
            assert prompts == {(("model", "sim-model"),): prompt}
            assert "made-up" not in text
            info = _samples(text, "kvrouter_build_info")
            assert info == {(("version", version("kvrouter")),): 1.0}


def test_model_label_is_bounded_by_the_names_the_fleet_serves() -> None:
    models = ModelNames(None)
    assert model_label(models, "anything") == "other" and model_label(models, None) == "other"
    models.learn([{"id": "base-7b"}, {"id": "alias-7b"}, {"id": "sql-lora", "parent": "base-7b"}])
    assert [model_label(models, n) for n in ("base-7b", "alias-7b", "sql-lora", None)] == [
        "base-7b",
        "alias-7b",
        "sql-lora",
        "base-7b",
    ]
    assert model_label(models, "nope") == "other" and model_label(models, 12) == "other"
