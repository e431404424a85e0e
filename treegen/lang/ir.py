"""The IR both front ends lower to: small frozen operations appended to a program's states.

A program is a set of *states* (streams of tokens); each operation is appended to one state. The
Python DSL appends them as the user's function runs; the ``.tg`` language appends them while walking
its syntax tree. Forks create child states, joins gather their variables; both are expressed by the
:class:`~treegen.lang.dsl.State` API rather than by op objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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

REDUCTIONS = ("collect", "vote", "best", "top_k", "concat")


@dataclass(frozen=True)
class Reduce:
    """A reduction at a join: one variable made from the joined branches' values of ``source``.

    kind: ``"collect"`` (the values as a list, under a new name), ``"vote"`` (majority of the answers
    ``extract`` finds; ties to the first seen), ``"best"`` / ``"top_k"`` (by ``by``: a variable the
    branches set, ``"logprob"`` — the mean token log-probability of the ``gen`` that made ``source`` —
    or a function of the value; ties to the first branch), or ``"concat"`` (the values joined by
    ``sep``, e.g. to become a new prompt). The rules are those of :mod:`treegen.lang.reduce`.

    Both front ends build these nodes (``treegen.vote(...)`` etc. in Python, ``join { x = vote(...) }``
    in ``.tg``) and pass them to :meth:`State.join <treegen.lang.state.State.join>`, which records
    each on the fork node of the sharing tree (attribute ``reductions``: ``{"name", "kind", "source",
    "by"}``, ``by`` a variable name, ``"logprob"``, a function's name or None) and computes it when
    first read, or when the program finishes. How it was decided is then in ``state.info[name]``::

        {"reduction": kind, "source": source, "branches": n,     # every kind
         "votes": {answer: count},          # vote: in order of first appearance; texts without an answer do not vote
         "scores": [float, ...],            # best, top_k: every branch's score, as reduce.score reads it (-inf: none)
         "winners": [branch index, ...],    # vote: the branches whose answer won; best: [the best branch];
                                            # top_k: the kept branches, best first
         "incomplete": [branch index, ...]} # only when some: constrained gens that ended unmet (cut short, or
                                            # at a dead end): vote, best and top_k never pick their texts
                                            # (best: None when every branch's is incomplete); collect and
                                            # concat keep them

    ``where``: where the reduction was written, for errors when it is computed (e.g. a score that is
    a list): None, or an object with ``error(message) -> Exception`` (a ``.tg``
    :class:`~treegen.lang.tg.errors.Pos`, which gives a ``TgError`` at ``file:line:col``). It is not
    part of the node's identity (equality).
    """

    kind: str
    source: str
    extract: object = None
    by: object = None
    k: int = 1
    sep: str = "\n"
    where: object = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in REDUCTIONS:
            raise ValueError(f"unknown reduction kind {self.kind!r}; the kinds are {', '.join(REDUCTIONS)}")
        if self.kind == "vote":  # (checked where the vote is written, not when the join is read after every gen ran)
            check_extract(self.extract, f"vote({self.source!r})")


def check_extract(extract, what: str = "vote") -> None:
    """Refuse a vote's ``extract`` that cannot find answers: a string that is not a valid regular
    expression (ValueError naming the pattern and why), or anything but a regex, a compiled pattern,
    a function ``text -> answer`` or None (TypeError)."""
    if isinstance(extract, str):
        try:
            re.compile(extract)
        except re.error as e:
            raise ValueError(f"{what}: extract {extract!r} is not a valid regular expression: {e}") from None
    elif not (extract is None or isinstance(extract, re.Pattern) or callable(extract)):
        raise TypeError(f"{what}: extract must be a regex, a function text -> answer, or None, "
                        f"got {type(extract).__name__}")


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
