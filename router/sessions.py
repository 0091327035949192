"""Session affinity: a conversation's requests prefer the engine that served its last turn.

A request names its session by a header (``session.header``, default ``x-session-id``) or the
OpenAI ``user`` field (``session.user_field``). The engine that served the session's last turn
holds that turn's prompt in its prefix cache unless it evicted it since, so ``soft`` mode
credits it, when the new prompt extends that one (its content key at that length is the last
turn's), as a speculative hit of that length: preferred the way a cached prefix is, and load
can still send the turn elsewhere. A session key reused for an unrelated prompt (a per-user
``user`` field) gets no credit. ``hard`` mode pins the session to its engine while
that engine is healthy. Bindings expire after ``session.ttl_s`` without a turn and are bounded
by ``session.max_sessions`` (least recently used first out).

:class:`SessionTable` keeps the bindings in this replica; :class:`Sessions` is what routing
uses, and with ``redis.url`` :class:`router.shared_sessions.RedisSessions` implements it over
a SessionTable, so a binding made on one replica is honoured by the others.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from indexer.index import EngineId

__all__ = ["Binding", "SessionTable", "Sessions", "session_key"]

Binding = tuple[EngineId, int, int, float]
"""(engine, the session's last turn's length in tokens, its deepest content key, when it was
bound on this process's monotonic clock: for another replica's binding, as far as its time
left tells)."""


class Sessions(Protocol):
    async def lookup(self, key: str, now: float) -> Binding | None: ...

    def bind(self, key: str, engine: EngineId, tokens: int, last_key: int, now: float) -> None: ...

    async def close(self) -> None: ...


class SessionTable:
    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._bound: OrderedDict[str, tuple[EngineId, int, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def __contains__(self, key: str) -> bool:
        return key in self._bound

    async def lookup(self, key: str, now: float) -> Binding | None:
        return self.get(key, now)

    async def close(self) -> None:
        return None

    def get(self, key: str, now: float) -> Binding | None:
        """The session's :data:`Binding`, if still live."""
        got = self._bound.get(key)
        if got is None:
            return None
        engine, tokens, last_key, until = got
        if until <= now:
            del self._bound[key]
            return None
        self._bound.move_to_end(key)
        return engine, tokens, last_key, until - self.ttl_s

    def bind(
        self,
        key: str,
        engine: EngineId,
        tokens: int,
        last_key: int,
        now: float,
        ttl_s: float | None = None,
    ) -> None:
        """Bind ``key`` for ``ttl_s`` (default ``self.ttl_s``; a binding another replica made
        lasts what is left of its own)."""
        until = now + (self.ttl_s if ttl_s is None else ttl_s)
        self._bound[key] = (engine, tokens, last_key, until)
        self._bound.move_to_end(key)
        while len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)


def session_key(headers: Any, body: dict[str, Any], header: str, user_field: bool) -> str | None:
    """The request's session: the header (case-insensitive), else the ``user`` field."""
    value = headers.get(header) if headers is not None else None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value:
        return str(value)[:256]
    user = body.get("user") if user_field else None
    return user[:256] if isinstance(user, str) and user else None
