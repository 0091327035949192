"""A set of served model names the self-check learns a worker behaviour for."""

from __future__ import annotations

from typing import Any

__all__ = ["ModelSet"]


class ModelSet:
    """The models whose workers behave some way: every model (``everywhere``, configured), or
    those :meth:`learn` is told of. ``None`` stands for a body that names no model, which the
    fleet's default model serves."""

    def __init__(self, *, everywhere: bool = False) -> None:
        self.everywhere = everywhere
        self.models: set[str | None] = set()

    def covers(self, model: Any) -> bool:
        return self.everywhere or (bool(self.models) and model in self.models)

    def learn(self, names: list[Any], *, default: bool = False) -> None:
        """The workers serving these model names behave so; ``default``: one of them is the
        model a body naming none is served."""
        self.models.update(n for n in names if isinstance(n, str))
        if default:
            self.models.add(None)
