"""Bad HTTP input, fuzzed: hypothesis-generated bodies, JSON shapes, headers, methods.

The router's API routes read raw bodies (its OpenAPI schema has no request schemas), so
schemathesis would only send empty bodies; this generates the inputs itself. Target: the real
``kvrouter serve`` process in front of one simulated worker. Property: no response is a 5xx
other than 502/503/504 (which are legitimately about the upstream), the process never dies, and
its stderr shows no traceback. Bounded: ~30-60 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.testing import find_port_block, running_fleet

pytestmark = pytest.mark.timeout(240)

ALLOWED_5XX = {502, 503, 504}
FUZZ = settings(
    max_examples=int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "600")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    flags = {"decode_ms": 0.2, "prefill_tps": 2_000_000, "max_model_len": 4096}
    with running_fleet(1, num_gpu_blocks=512, **flags) as ws, tempfile.TemporaryDirectory() as d:
        port = find_port_block(1)
        cfg = os.path.join(d, "kvrouter.yaml")
        with open(cfg, "w") as f:
            json.dump(
                {
                    "server": {
                        "host": "127.0.0.1",
                        "port": port,
                        "max_body_bytes": 65536,
                        "request_timeout_s": 10.0,
                    },
                    "workers": [{"url": ws[0].url}],
                },
                f,
            )
        errf = open(os.path.join(d, "stderr"), "w+b")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", cfg],
            stdout=subprocess.DEVNULL,
            stderr=errf,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline or proc.poll() is not None:
                    errf.seek(0)
                    err = errf.read().decode(errors="replace")
                    pytest.fail(f"router did not start (exit {proc.poll()}): {err[-2000:]}")
                time.sleep(0.1)
            yield url
            assert proc.poll() is None, "the router process died"
            errf.seek(0)
            err = errf.read().decode(errors="replace")
            assert "Traceback" not in err and "internal error" not in err, err[-3000:]
        finally:
            proc.terminate()
            proc.wait(10)
            errf.close()


@pytest.fixture(scope="module")
def client(router_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router_url, timeout=30) as c:
        yield c


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
any_json = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
small_tokens = st.lists(st.integers(min_value=-5, max_value=40000), min_size=0, max_size=60)
prompt = st.one_of(
    st.text(max_size=300),
    small_tokens,
    st.lists(small_tokens, max_size=3),
    st.lists(st.text(max_size=20), max_size=3),
    any_json,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus", ""]) | any_json},
    optional={"content": st.text(max_size=200) | any_json, "name": any_json},
)
common = {
    "model": st.sampled_from(["sim-model", "other", ""]) | any_json,
    "max_tokens": st.integers(min_value=-3, max_value=12) | any_json,
    "stream": st.booleans() | any_json,
    "stream_options": any_json,
    "cache_salt": st.text(max_size=10) | any_json,
    "temperature": any_json,
    "n": any_json,
}
completion_body = st.fixed_dictionaries({}, optional={"prompt": prompt, **common})
chat_body = st.fixed_dictionaries(
    {}, optional={"messages": st.lists(message, max_size=4) | any_json, **common}
)
header_name = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-!#$%&'*+.^_`|~",
    min_size=1,
    max_size=20,
)
header_value = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60
).map(str.strip)
headers = st.dictionaries(header_name, header_value, max_size=4)
PATHS = ["/v1/completions", "/v1/chat/completions", "/debug/route"]


def _check(r: httpx.Response, what: Any) -> None:
    assert r.status_code < 500 or r.status_code in ALLOWED_5XX, (r.status_code, r.text, what)
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        assert "error" in r.json(), r.text


def _post(c: httpx.Client, path: str, content: bytes, hdrs: dict[str, str]) -> httpx.Response:
    h = {
        k: v
        for k, v in hdrs.items()
        if k.lower() not in ("content-length", "host", "transfer-encoding")
    }
    return c.post(path, content=content, headers={"content-type": "application/json", **h})


@FUZZ
@given(body=completion_body, path=st.sampled_from(PATHS), hdrs=headers)
def test_fuzz_completion_shapes(client: httpx.Client, body: dict, path: str, hdrs: dict) -> None:
    r = _post(client, path, json.dumps(body).encode(), hdrs)
    _check(r, (body, hdrs))


@FUZZ
@given(body=chat_body, path=st.sampled_from(PATHS), hdrs=headers)
def test_fuzz_chat_shapes(client: httpx.Client, body: dict, path: str, hdrs: dict) -> None:
    r = _post(client, path, json.dumps(body).encode(), hdrs)
    _check(r, body)


@FUZZ
@given(
    raw=st.binary(max_size=400) | any_json.map(lambda x: json.dumps(x).encode()),
    path=st.sampled_from([*PATHS, "/v1/models", "/health", "/metrics", "/debug/index", "/nope"]),
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"]),
)
def test_fuzz_raw_bodies_and_methods(
    client: httpx.Client, raw: bytes, path: str, method: str
) -> None:
    r = client.request(method, path, content=raw)
    _check(r, (method, path, raw[:80]))
