"""Progress of long runs (``kvrouter demo``, bench/routing_bench.py) on stderr.

A line per phase; within a phase, a bar redrawn in place when stderr is a terminal, else a line
at every tenth of the way (logs and CI keep a readable record). ``quiet`` (the commands'
``--json``) prints nothing, so stdout's JSON is the whole output.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

__all__ = ["Progress"]

T = TypeVar("T")
_WIDTH = 24


class Progress:
    def __init__(self, quiet: bool = False, *, bar: bool = True, stream: TextIO | None = None):
        """``bar=False``: lines even on a terminal (several processes share it). ``stream``:
        stderr by default, looked up when writing (tests and tools replace ``sys.stderr``)."""
        self._stream = stream
        self.quiet = quiet
        self._bar = bar
        self._drawn = False
        self._tenth: dict[str, int] = {}

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def phase(self, text: str) -> None:
        """One line: a phase starts or ends."""
        if self.quiet:
            return
        self._end_bar()
        self._line(text)

    def update(self, label: str, fraction: float, detail: str = "") -> None:
        """``label`` is ``fraction`` (0..1) done; ``detail`` says of what."""
        if self.quiet:
            return
        fraction = min(max(fraction, 0.0), 1.0)
        if self._bar and self.stream.isatty():
            filled = round(fraction * _WIDTH)
            bar = "#" * filled + "-" * (_WIDTH - filled)
            line = f"\r  {label} [{bar}] {fraction * 100:3.0f}% {detail}"
            self.stream.write(line + "\033[K")  # erase what a longer previous line left
            self.stream.flush()
            self._drawn = True
            return
        tenth = int(fraction * 10)
        if tenth > self._tenth.get(label, -1):
            self._tenth[label] = tenth
            self._line(f"  {label} {fraction * 100:3.0f}% {detail}")

    def iterate(self, items: Iterable[T], label: str, total: int) -> Iterator[T]:
        """``items``, updating the progress about a hundred times on the way."""
        step = max(total // 100, 1)
        for i, item in enumerate(items):
            if i % step == 0:
                self.update(label, i / total if total else 1.0, f"{i}/{total}")
            yield item
        self.update(label, 1.0, f"{total}/{total}")
        self._end_bar()

    def _line(self, text: str) -> None:
        # One write: print() writes the newline apart, and forked processes sharing stderr
        # (the bench's --jobs) would interleave their lines.
        self.stream.write(text + "\n")
        self.stream.flush()

    def _end_bar(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
