"""Positions in ``.tg`` sources and the one error type every user mistake becomes.

A :class:`TgError` prints as ``file:line:col: message`` followed by the source line and a caret
under the column, the format compilers use, e.g.::

    examples/bad.tg:4:9: undefined variable 'answr' (did you mean 'answer'?)
        "A: {answr}"
            ^
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """A source file: the path as shown in messages, and its text."""

    path: str
    text: str = field(repr=False)

    def line(self, n: int) -> str:
        lines = self.text.split("\n")
        return lines[n - 1].rstrip("\r") if 1 <= n <= len(lines) else ""


@dataclass(frozen=True)
class Pos:
    """A 1-based line and column in a source."""

    source: Source = field(repr=False)
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.source.path}:{self.line}:{self.col}"

    def error(self, message: str) -> "TgError":
        """A :class:`TgError` here (how the interpreter reports a reduction written at this position
        that fails when computed: ``Reduce.where``)."""
        return TgError(message, self)


class TgError(Exception):
    """A mistake in a ``.tg`` program (syntax or meaning) or in the values given for its parameters."""

    def __init__(self, message: str, pos: Pos | None = None, *, path: str | None = None) -> None:
        super().__init__(message)
        self.message, self.pos = message, pos
        self.path = pos.source.path if pos is not None else path

    @property
    def line(self) -> int | None:
        return self.pos.line if self.pos else None

    @property
    def col(self) -> int | None:
        return self.pos.col if self.pos else None

    def __str__(self) -> str:
        if self.pos is None:
            return f"{self.path}: {self.message}" if self.path else self.message
        text = self.pos.source.line(self.pos.line).replace("\t", " ")
        caret = " " * (max(self.pos.col, 1) - 1) + "^"
        return f"{self.pos}: {self.message}\n    {text}\n    {caret}"
