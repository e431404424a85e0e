"""The IR both front ends lower to: small frozen operations appended to a program's states.

A program is a set of *states* (streams of tokens); each operation is appended to one state. The
Python DSL appends them as the user's function runs; the ``.tg`` language appends them while walking
its syntax tree. Forks create child states, joins gather their variables; both are expressed by the
:class:`~treegen.lang.dsl.State` API rather than by op objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from treegen.runtime.sampler import SamplingParams

ROLES = ("system", "user", "assistant")


class _Appendable:
    """``"Q: " + gen("a")`` builds a :class:`Seq` of ops."""

    def __add__(self, other):
        return Seq(as_ops(self) + as_ops(other))

    def __radd__(self, other):
        return Seq(as_ops(other) + as_ops(self))


@dataclass(frozen=True)
class Text(_Appendable):
    """Append literal text (tokenised on its own, ids concatenated)."""

    text: str


@dataclass(frozen=True)
class RoleBegin(_Appendable):
    """Open a chat message of ``role``: the chat template's text before the content."""

    role: str


@dataclass(frozen=True)
class RoleEnd(_Appendable):
    """Close a chat message of ``role``: the chat template's text after the content."""

    role: str


@dataclass(frozen=True)
class Gen(_Appendable):
    """Generate into variable ``name`` with ``params``."""

    name: str
    params: SamplingParams


@dataclass(frozen=True)
class Select(_Appendable):
    """Append the ``choices`` entry with the highest length-normalised log-probability; store it in ``name``."""

    name: str
    choices: tuple[str, ...]


Op = Text | RoleBegin | RoleEnd | Gen | Select

REDUCTIONS = ("vote", "best", "top_k", "concat")


@dataclass(frozen=True)
class Reduce:
    """A reduction at a join: one variable made from the joined branches' values of ``source``.

    kind: ``"vote"`` (majority of the answers ``extract`` finds; ties to the first seen),
    ``"best"`` / ``"top_k"`` (by ``by``: a variable the branches set, ``"logprob"`` — the mean token
    log-probability of the ``gen`` that made ``source`` — or a function of the value), or
    ``"concat"`` (the values joined by ``sep``, e.g. to become a new prompt). Recorded on the fork
    node of the sharing tree (attribute ``reductions``) so the compiled tree shows it.
    """

    kind: str
    source: str
    extract: object = None
    by: object = None
    k: int = 1
    sep: str = "\n"


class Seq(tuple):
    """A sequence of ops appended together (what ``user(...)`` or ``s += a + b`` builds)."""

    def __add__(self, other):
        return Seq(tuple(self) + tuple(as_ops(other)))

    def __radd__(self, other):
        return Seq(tuple(as_ops(other)) + tuple(self))


def as_ops(item) -> tuple:
    """Normalise what a user may append (str, op, Seq) to a tuple of ops; anything else is an error."""
    if isinstance(item, str):
        return (Text(item),)
    if isinstance(item, (Text, RoleBegin, RoleEnd, Gen, Select)):
        return (item,)
    if isinstance(item, Seq):
        return tuple(item)
    raise TypeError(
        f"cannot append {type(item).__name__} {item!r:.60}: append a str, gen(...), select(...), "
        "a role such as user(...), or (to a fork) a list with one item per branch or a function of the branch index"
    )
