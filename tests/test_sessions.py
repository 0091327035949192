"""Session affinity: a conversation's next turn prefers the engine of its last turn (soft),
or stays there (hard), even when the index has nothing to say (events lost, index reset)."""

from __future__ import annotations

import httpx
from test_router_support import config_for, serve_router, until, words

from router.sessions import SessionTable, session_key
from simulator.testing import running_fleet

FAST = {"decode_ms": 1, "prefill_tps": 400000}


def test_session_table_expires_and_is_bounded() -> None:
    t = SessionTable(ttl_s=10.0, max_sessions=2)
    t.bind("a", ("w", 0), 64, 111, 0.0)
    t.bind("b", ("w", 1), 32, 222, 1.0)
    assert t.get("a", 5.0) == (("w", 0), 64, 111, 0.0)  # ..., when it was bound
    t.bind("c", ("w", 2), 16, 333, 2.0)  # over the bound: the least recently used goes
    assert t.get("b", 5.0) is None and len(t) == 2
    assert t.get("a", 10.5) is None  # expired
    assert session_key({"x-session-id": "s1"}, {"user": "u"}, "x-session-id", True) == "s1"
    assert session_key({}, {"user": "u"}, "x-session-id", True) == "u"
    assert session_key({}, {"user": "u"}, "x-session-id", False) is None


async def _turns(mode: str, explained: list[dict] | None = None) -> tuple[list[str], list[str]]:
    """Four turns of one conversation and of an unrelated request with the same session key,
    with the index's events switched off, so only affinity can keep the conversation home.
    ``explained``: receives ``/debug/route``'s answer for each turn, asked just before it."""
    with running_fleet(3, **FAST) as ws:
        cfg = config_for(ws, session={"mode": mode}, policy={"speculative_ttl_s": 0.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            for w in ws:
                await c.post(w.url + "/sim/faults", json={"events_enabled": False})
            hdr = {"x-session-id": "conv-1"}
            prompt = words(300, "conv")
            served, unrelated = [], []
            for turn in range(4):
                prompt += " " + words(40, f"turn{turn}")
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
                if explained is not None:
                    e = await c.post(base + "/debug/route", json=body, headers=hdr)
                    explained.append(e.json())
                r = await c.post(base + "/v1/completions", json=body, headers=hdr)
                served.append(r.headers["x-kvrouter-worker"])
            for i in range(3):
                body = {"model": "sim-model", "prompt": words(300, f"other{i}"), "max_tokens": 1}
                r = await c.post(base + "/v1/completions", json=body, headers=hdr)
                unrelated.append(r.headers["x-kvrouter-worker"])
            return served, unrelated


async def test_soft_affinity_keeps_a_conversation_on_its_engine() -> None:
    served, _ = await _turns("soft")
    assert len(set(served)) == 1, served


async def test_without_affinity_the_conversation_wanders() -> None:
    served, _ = await _turns("off")
    assert len(set(served)) > 1, served


async def test_hard_affinity_pins_even_unrelated_prompts() -> None:
    served, unrelated = await _turns("hard")
    assert len(set(served + unrelated)) == 1, (served, unrelated)


async def test_debug_route_explains_the_decision_the_session_makes() -> None:
    """``/debug/route`` with the session's header credits the bound engine as the request
    itself is credited (the last turn's prompt), so it names the engine the turn goes to."""
    explained: list[dict] = []
    served, _ = await _turns("soft", explained)
    # The first turn is a tie among idle engines, broken at random; the others are bound.
    assert [e["chosen"] for e in explained[1:]] == served[1:]
    for e in explained[1:]:
        bound = next(w for w in e["workers"] if w["url"] == e["chosen"])
        assert bound["speculative_hit_tokens"] >= 300, bound


async def test_a_reset_at_the_worker_ends_the_credit_of_sessions_bound_there() -> None:
    """A session's next turn is credited on the engine that served its last one, which the
    index may not show yet. Once that engine's cache is reset (``POST /reset_prefix_cache`` at
    the worker, announced by ``AllBlocksCleared``) nothing of the last turn is there: no credit,
    and no speculative entry recorded there before the reset, either."""
    with running_fleet(2, **FAST) as ws:
        cfg = config_for(ws, session={"mode": "soft"}, policy={"speculative_ttl_s": 60.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            hdr = {"x-session-id": "conv-reset"}
            prompt = words(300, "reset-conv")
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
            r = await c.post(base + "/v1/completions", json=body, headers=hdr)
            url = r.headers["x-kvrouter-worker"]
            other = {"model": "sim-model", "prompt": words(300, "reset-other"), "max_tokens": 1}

            async def credit(b: dict, h: dict | None = None) -> int:
                e = (await c.post(base + "/debug/route", json=b, headers=h or {})).json()
                return next(w for w in e["workers"] if w["url"] == url)["speculative_hit_tokens"]

            # An entry for a prompt routed there, and the session's next turn: both credited.
            r = await c.post(base + "/v1/completions", json=other, headers={"x-session-id": "o"})
            if r.headers["x-kvrouter-worker"] != url:
                other = body  # the other engine took it: check the session's own entry
            turn = {**body, "prompt": prompt + " " + words(40, "next")}
            assert await credit(turn, hdr) >= 256
            assert await credit(other) >= 256
            cleared = router.index.engine_stats((url, 0)).counters["cleared"]
            r = await c.post(url + "/reset_prefix_cache")
            assert r.json() == {"success": True}, r.text
            # vLLM announces it with the engine's next step: a request of its own makes one.
            direct = {"model": "sim-model", "prompt": words(50, "nudge"), "max_tokens": 1}
            assert (await c.post(url + "/v1/completions", json=direct)).status_code == 200
            await until(
                lambda: router.index.engine_stats((url, 0)).counters["cleared"] > cleared,
                10,
                "the reset to reach the index",
            )
            assert await credit(turn, hdr) == 0
            assert await credit(other) == 0
            # The session's turn, served again there, is credited again for the one after.
            r = await c.post(base + "/v1/completions", json=turn, headers=hdr)
            assert r.status_code == 200
            later = {**turn, "prompt": turn["prompt"] + " " + words(40, "later")}
            if r.headers["x-kvrouter-worker"] == url:
                assert await credit(later, hdr) >= 256
