"""``kvrouter serve`` with ``server.log_format: json``: every line a JSON object, one access line
per request with its decision, and request ids kept or made and returned."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_router_support import FAST, words

from router.logs import TextFormatter
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)


class _Lines:
    """A subprocess's stderr, line by line, read in a thread (no fixed sleeps)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def until(self, pred: Any, timeout: float, what: str) -> Any:
        """The first parsed line ``pred`` accepts (already read or arriving within ``timeout``)."""
        deadline = time.monotonic() + timeout
        i = 0
        while True:
            while i < len(self.lines):
                doc = json.loads(self.lines[i])
                i += 1
                if pred(doc):
                    return doc
            try:
                line = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                raise AssertionError(f"no log line for {what}; got:\n" + "\n".join(self.lines))
            if line:
                self.lines.append(line)


def _access(lines: _Lines, rid: str) -> dict[str, Any]:
    return lines.until(
        lambda d: d["logger"] == "kvrouter.access" and d.get("request_id") == rid, 20, rid
    )


def _serve(workers: list[Any]) -> Iterator[tuple[str, _Lines]]:
    env = {**os.environ, "KVROUTER_SERVER_DRAIN_DELAY_S": "0"}
    args = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    args += ["--log-format", "json", *(a for w in workers for a in ("--worker", w.url))]
    proc = subprocess.Popen(
        args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    lines = _Lines(proc.stderr)
    try:
        started = lines.until(lambda d: "Uvicorn running on" in d["msg"], 30, "uvicorn start")
        assert started["logger"].startswith("uvicorn") and started["level"] == "info"
        yield re.search(r"(http://\S+)", started["msg"]).group(1), lines
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_json_logs_name_each_request_and_its_decision() -> None:
    with running_fleet(2, num_gpu_blocks=256, **FAST) as ws, httpx.Client(timeout=30) as c:
        serving = _serve(ws)
        base, lines = next(serving)
        try:
            deadline = time.monotonic() + 30
            while c.get(base + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "router not ready"
                time.sleep(0.05)
            body = {"model": "sim-model", "prompt": words(200, "logs"), "max_tokens": 3}

            # The client's id is kept and returned; the access line names the decision.
            r = c.post(base + "/v1/completions", json=body, headers={"x-request-id": "cli-7"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "cli-7"
            line = _access(lines, "cli-7")
            assert line["status"] == 200 and line["path"] == "/v1/completions"
            assert line["model"] == "sim-model" and line["level"] == "info"
            assert line["worker"] == r.headers["x-kvrouter-worker"] and line["dp_rank"] == 0
            usage = r.json()["usage"]
            assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            assert line["completion_tokens"] == usage["completion_tokens"] == 3
            assert line["prompt_tokens"] >= 200 and line["predicted_hit_tokens"] >= 0
            assert 0 < line["duration_s"] < 30 and line["ts"].endswith("Z")

            # Without one, the router makes one, returns it, and each request gets its own.
            r2 = c.post(base + "/v1/completions", json=body)
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            r3 = c.post(base + "/v1/completions", json=stream)
            assert r2.status_code == r3.status_code == 200
            made = r2.headers["x-request-id"], r3.headers["x-request-id"]
            assert made[0] != made[1] and all(made)
            assert _access(lines, made[0])["cached_tokens"] >= 192  # the same prompt again
            streamed = _access(lines, made[1])
            assert streamed["status"] == 200 and 0 < streamed["ttft_s"] <= streamed["duration_s"]
            assert streamed["completion_tokens"] == 3  # from the usage event the client asked for

            # Refused before routing: still an id and a line, with the error.
            bad = c.post(base + "/v1/completions", json={"model": "sim-model"})
            assert bad.status_code == 400
            refused = _access(lines, bad.headers["x-request-id"])
            assert refused["status"] == 400 and "prompt" in refused["error"]
            assert "worker" not in refused
        finally:
            next(serving, None)
        assert lines.lines and all(json.loads(x) for x in lines.lines)  # every line is JSON


def test_text_format_appends_the_fields() -> None:
    import logging

    rec = logging.LogRecord("kvrouter.access", logging.INFO, __file__, 1, "request", None, None)
    rec.fields = {"request_id": "r1", "status": 200, "worker": None}
    line = TextFormatter().format(rec)
    assert line.endswith("INFO kvrouter.access: request request_id=r1 status=200")
