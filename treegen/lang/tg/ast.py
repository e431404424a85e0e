"""The ``.tg`` syntax tree: frozen dataclasses, each with the :class:`Pos` it was written at.

The parser builds it (:mod:`treegen.lang.tg.parser`), the checker types it
(:mod:`treegen.lang.tg.check`), and the lowering walks it, driving the same
:class:`~treegen.lang.state.State` API the Python DSL uses (:mod:`treegen.lang.tg.lower`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from treegen.lang.tg.errors import Pos, Source


# values -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lit:
    """A string or number written in the source."""

    value: str | int | float
    pos: Pos


@dataclass(frozen=True)
class Var:
    """A variable read: a parameter, a loop variable, or a value set by gen/select/join."""

    name: str
    pos: Pos


@dataclass(frozen=True)
class ListLit:
    items: tuple["Value", ...]
    pos: Pos


Value = Union[Lit, Var, ListLit]


# statements ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """``param name: type = default``; ``type`` is None when not written (then taken from the default)."""

    name: str
    type: str | None
    default: Value | None
    pos: Pos
    type_pos: Pos | None = None


@dataclass(frozen=True)
class Text:
    """Prompt text: literal pieces and ``{variable}`` reads, in order."""

    parts: tuple[str | Var, ...]
    pos: Pos


@dataclass(frozen=True)
class Message:
    """A chat message of ``role`` whose content is ``body`` (text, gen, select)."""

    role: str
    body: tuple["Statement", ...]
    pos: Pos


@dataclass(frozen=True)
class Keyword:
    """``name=value`` in a gen's parameters or a reduction's arguments."""

    name: str
    value: Value
    pos: Pos


@dataclass(frozen=True)
class Gen:
    name: str
    args: tuple[Keyword, ...]
    pos: Pos


@dataclass(frozen=True)
class Select:
    name: str
    choices: Value
    pos: Pos


@dataclass(frozen=True)
class Reduction:
    """``target = fn(args..., key=value...)`` inside a join."""

    target: str
    fn: str
    args: tuple[Value, ...]
    kwargs: tuple[Keyword, ...]
    pos: Pos


@dataclass(frozen=True)
class Join:
    reductions: tuple[Reduction, ...]
    pos: Pos


@dataclass(frozen=True)
class Fork:
    """``fork N`` (kind "count"), ``fork var in range(N)`` ("range"), ``fork var in LIST`` ("each")."""

    kind: str
    var: str | None
    source: Value
    body: tuple["Statement", ...]
    join: Join | None
    pos: Pos


@dataclass(frozen=True)
class Include:
    """``include "path"``: ``body`` holds the included file's statements once resolved."""

    path: str
    body: tuple["Statement", ...] | None
    pos: Pos
    resolved: str | None = None


Statement = Union[Param, Text, Message, Gen, Select, Fork, Join, Include]


@dataclass(frozen=True)
class TgFile:
    source: Source
    params: tuple[Param, ...]
    body: tuple[Statement, ...]
