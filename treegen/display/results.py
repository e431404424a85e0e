"""Reading a run's states for display, without ever running anything.

``State.__getitem__`` runs queued ``gen`` calls when a value is pending; a display must not, so this
module reads ``State.vars`` directly: a pending value stays :data:`PENDING`, a joined list becomes a
:class:`Joined` that keeps, for each value, the branch state that made it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from treegen.display._view import clip, decode
from treegen.lang.interpreter import _Joined, _Pending

# info keys the views render specially; anything else (e.g. from a future reduction) is shown as key=value
KNOWN_INFO = frozenset({"finish_reason", "tokens", "start", "max_tokens", "stop", "scores", "choice_index", "branches"})


class _PendingValue:
    def __repr__(self) -> str:
        return "<pending>"


PENDING = _PendingValue()


@dataclass(frozen=True)
class Joined:
    """A joined variable: ``items`` are (branch state, value) pairs, a value may itself be :class:`Joined`."""

    state: object  # the state the branches were joined into
    items: tuple

    def flat(self) -> list[tuple[object, object]]:
        """(state, value) of every innermost value, in branch order."""
        out = []
        for st, v in self.items:
            out.extend(v.flat() if isinstance(v, Joined) else [(st, v)])
        return out

    def groups(self) -> list[tuple[object, list[tuple[object, object]]]]:
        """Innermost lists with the state they were joined into: [(parent state, [(state, value), ...])]."""
        if not any(isinstance(v, Joined) for _, v in self.items):
            return [(self.state, list(self.items))]
        out = []
        for st, v in self.items:
            out.extend(v.groups() if isinstance(v, Joined) else [(st, [(st, v)])])
        return out

    def shape(self) -> list[int]:
        first = self.items[0][1] if self.items else None
        return [len(self.items)] + (first.shape() if isinstance(first, Joined) else [])


def resolve(state, name: str):
    """The value of ``name`` on ``state`` as stored: a value, :data:`PENDING`, or a :class:`Joined`."""
    value = state.vars.get(name, PENDING)
    if isinstance(value, _Pending):
        return PENDING
    if isinstance(value, _Joined):
        return Joined(state, tuple((child, resolve(child, value.name)) for child in value.states))
    return value


def label(state) -> str:
    """``root``, or the fork indices from the root: ``#2`` or ``#0.3``."""
    return "root" if not state.path else "#" + ".".join(map(str, state.path))


def descendants(state) -> list:
    """``state`` and every state forked (directly or not) from it, in creation order."""
    depth = len(state.path)
    return [st for st in state._run.states if st.path[:depth] == state.path and (st is state or len(st.path) > depth)]


def parent_state(state):
    """The state ``state`` was forked from (None for a root): of the states one fork level up, the one
    sharing the longest path of tree nodes with it."""
    if not state.path:
        return None
    tree = state._run.tree
    mine = tree.path(state.node) if state.node is not None else []
    best, best_depth = None, -1
    for st in state._run.states:
        if st.path == state.path[:-1] and st.node is not None:
            theirs = set(tree.path(st.node))
            depth = sum(1 for _ in _takewhile_in(mine, theirs))
            if depth > best_depth:
                best, best_depth = st, depth
    return best


def _takewhile_in(seq, members):
    for x in seq:
        if x not in members:
            return
        yield x


@dataclass(frozen=True)
class BranchText:
    """A branch's own text (below the node it was forked at) as (text, generated?) spans."""

    spans: tuple[tuple[str, bool], ...]

    def plain(self) -> str:
        return "".join(t for t, _ in self.spans)


def own_text(state, max_chars: int = 10_000) -> BranchText:
    """The text ``state`` added after its fork point; ``gen`` output marked as generated.

    Each span is decoded on its own (span boundaries are token boundaries); a span longer than
    ``max_chars`` characters is decoded only around its head and tail.
    """
    if state.node is None:
        return BranchText(())
    tree, tok = state._run.tree, state._run.tokenizer
    nodes = tree.path(state.node)
    parent = parent_state(state)
    skip = 0
    if parent is not None and parent.node is not None:
        theirs = set(tree.path(parent.node))
        skip = sum(1 for _ in _takewhile_in(nodes, theirs))
    start = sum(len(tree.tokens(n)) for n in nodes[:skip])
    ids = [t for n in nodes[skip:] for t in tree.tokens(n)]
    end = start + len(ids)
    cuts = {start, end}
    generated = []
    for info in state.info.values():
        if "start" in info and "tokens" in info:
            a, b = max(info["start"], start), min(info["start"] + info["tokens"], end)
            if a < b:
                generated.append((a, b))
                cuts |= {a, b}
    edges = sorted(cuts)
    spans = []
    budget = max(max_chars, 16)
    for a, b in zip(edges, edges[1:]):
        is_gen = any(ga <= a and b <= gb for ga, gb in generated)
        piece = ids[a - start:b - start]
        if len(piece) > budget:  # decode only what can be shown
            keep = budget // 2
            text = decode(tok, piece[:keep]) + "…" + decode(tok, piece[-keep:])
        else:
            text = decode(tok, piece)
        spans.append((clip(text, budget * 4), is_gen))
    return BranchText(tuple(spans))


def summary(state) -> str:
    """One line: branches, gen calls by finish reason, selects, forward passes, and the run's status."""
    run = state._run
    states = descendants(state)
    finish = Counter(i["finish_reason"] for st in states for i in st.info.values() if "finish_reason" in i)
    selects = sum(1 for st in states for i in st.info.values() if "scores" in i)
    forks = len(states) - 1
    parts = [f"{forks:,} branch{'es' if forks != 1 else ''}"]
    if finish:
        parts.append(f"{sum(finish.values()):,} gen (" + ", ".join(f"{k} {v:,}" for k, v in sorted(finish.items())) + ")")
    if selects:
        parts.append(f"{selects:,} select")
    tree_run = getattr(run, "tree_run", None)
    if tree_run is not None:
        parts.append(f"{tree_run.forward_passes:,} forward passes")
    parts.append("finished" if run.finished else ("traced, not run" if run.tracing else "running"))
    return " · ".join(parts)


def short(value, limit: int = 80) -> str:
    """A value in one line for text views."""
    if value is PENDING:
        return "<pending>"
    text = value if isinstance(value, str) else repr(value)
    return repr(clip(text, limit)) if isinstance(value, str) else clip(text, limit)


__all__ = ["KNOWN_INFO", "PENDING", "BranchText", "Joined", "decode", "descendants", "label", "own_text",
           "parent_state", "resolve", "short", "summary"]
