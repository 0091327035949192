"""``GET /debug``: the status page rendered by a real headless Chromium against a running router.

The browser is Debian's ``chromium`` (``scripts/setup.sh --with-browser`` installs it; ``make
test`` does). Without it these tests fail: the page is only checked by running its JavaScript.
"""

from __future__ import annotations

import asyncio
import html
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from router.status import rows
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(180)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
DOCS_PNG = Path(__file__).resolve().parent.parent / "docs" / "status-page.png"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError(
        "no headless browser: install Debian's chromium (scripts/setup.sh --with-browser)"
    )


async def _browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Chromium loads ``url``, runs its scripts for up to 8 s of virtual time (the page's fetches
    complete within it), then does what ``extra`` asks (dump the DOM, take a screenshot)."""
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",  # tests run as root in containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=8000",
        "--window-size=1400,900",
        *extra,
        url,
    ]
    # In a thread: this event loop serves the router the browser reads.
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=120)


def _engine_rows(dom: str) -> list[tuple[str, str]]:
    return [
        (html.unescape(w), dp)
        for w, dp in re.findall(r'<tr class="engine" data-worker="([^"]+)" data-dp="(\d+)"', dom)
    ]


async def test_status_page_shows_every_engine_and_the_last_decisions(tmp_path: Path) -> None:
    with running_fleet(2, dp_size=2, num_gpu_blocks=256, **FAST) as ws:
        cfg = config_for(ws)
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:

            async def live() -> bool:
                doc = (await c.get(base + "/debug/index")).json()
                return bool(doc["workers"]) and all(r["events"] == "live" for r in rows(doc))

            await until(live, 30, "every engine subscribed and live")
            page = await c.get(base + "/debug")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "<script" in page.text and "http://" not in page.text.split("<body")[0]

            before = await _browse(base + "/debug", tmp_path / "profile", "--dump-dom")
            assert before.returncode == 0, before.stderr[-2000:]
            dom = before.stdout
            assert int(re.search(r'data-refreshes="(\d+)"', dom).group(1)) >= 1, dom[:2000]
            assert _engine_rows(dom) == [(w.url, str(rank)) for w in ws for rank in range(2)]
            assert 'class="decision"' not in dom and "no request routed yet" in dom

            chosen, ids = [], []
            for i in range(6):  # three prompts, each sent twice: the second finds its prefix
                prompt = words(300, f"page{i % 3}") + f" turn {i}"
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                chosen.append(r.headers["x-kvrouter-worker"])
                ids.append(r.headers["x-request-id"])

            after = await _browse(base + "/debug", tmp_path / "profile", "--dump-dom")
            assert after.returncode == 0, after.stderr[-2000:]
            dom = after.stdout
            decisions = re.findall(r'<tr class="decision" data-worker="([^"]+)"', dom)
            assert [html.unescape(d) for d in decisions] == chosen[::-1]  # newest first
            row = dom[dom.index('<tr class="decision"') :].split("</tr>")[0]
            assert f">{ids[-1]}<" in row  # the request id the client got back
            hit, prompt = map(int, re.search(r">(\d+) / (\d+)", row).groups())
            assert prompt >= 300 and 0 <= hit <= prompt, row
            assert 'id="error" style="display: block' not in dom
            assert dom.count('class="bar"') == 1  # this minute's hit-rate bar

            shot = tmp_path / "status-page.png"
            taken = await _browse(
                base + "/debug", tmp_path / "profile", f"--screenshot={shot}", "--hide-scrollbars"
            )
            assert taken.returncode == 0, taken.stderr[-2000:]
            assert shot.stat().st_size > 10_000
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if not DOCS_PNG.exists():  # the README's picture; delete it to take a new one
                DOCS_PNG.write_bytes(shot.read_bytes())


async def test_status_page_needs_the_admin_token_like_the_other_debug_views() -> None:
    cfg = config_for(["http://127.0.0.1:9"], server={"admin_token": "secret"})
    async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:
        assert (await c.get(base + "/debug")).status_code == 401
        ok = await c.get(base + "/debug", headers={"authorization": "Bearer secret"})
        assert ok.status_code == 200 and "<svg" in ok.text
