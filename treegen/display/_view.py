"""What every view shares: display limits, per-node subtree totals, and the summarised tree.

A tree of thousands of branches is never drawn or listed whole: :func:`summarise` keeps a breadth-first
budget of nodes and folds the rest into *summary* nodes ("+ 996 more: 996 branches, 47 MiB"), so the
size of every rendering is bounded by :class:`Limits`, not by the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from treegen.tree.sharing_tree import KVShape, SharingTree


@dataclass(frozen=True)
class Limits:
    """How much a rendering shows before it summarises.

    max_nodes: tree nodes drawn in all (breadth first); the rest are folded away.
    max_width: nodes drawn at one depth (the drawing's height in rows).
    max_children: children drawn under one node; past it, the first ``max_children - 1`` and a summary.
    max_rows: rows of any table (branches, list values, nodes).
    max_chars: characters of one text cell (long texts keep their head and tail).
    """

    max_nodes: int = 64
    max_width: int = 16
    max_children: int = 8
    max_rows: int = 40
    max_chars: int = 240

    def __post_init__(self) -> None:
        for name in ("max_nodes", "max_width", "max_children", "max_rows", "max_chars"):
            value, least = getattr(self, name), 1 if name in ("max_rows", "max_chars") else 2
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Limits.{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class NodeTotals:
    """One node's subtree: nodes, branches (live leaves), tokens held and still to generate."""

    nodes: int
    branches: int
    tokens: int
    gen_budget: int


def subtree_totals(tree: SharingTree) -> dict[int, NodeTotals]:
    """:class:`NodeTotals` of every node's subtree in one pass (pruned nodes count no tokens, no branches)."""
    g = tree.graph
    out: dict[int, NodeTotals] = {}
    for n in reversed(list(nx.topological_sort(g))):
        attrs = g.nodes[n]
        kids = [out[c] for c in g.successors(n)]
        live = not attrs["pruned"]
        live_kids = any(not g.nodes[c]["pruned"] for c in g.successors(n))
        out[n] = NodeTotals(
            nodes=1 + sum(k.nodes for k in kids),
            branches=sum(k.branches for k in kids) + (1 if live and not live_kids else 0),
            tokens=(len(attrs["tokens"]) if live else 0) + sum(k.tokens for k in kids),
            gen_budget=(attrs["gen_budget"] if live else 0) + sum(k.gen_budget for k in kids),
        )
    return out


@dataclass(frozen=True)
class ViewNode:
    """A node of the summarised tree: a tree node (``node`` set) or a summary of folded sibling subtrees.

    ``hidden``/``hidden_branches``: nodes and branches below a drawn node that the limits left out
    (its children were not drawn); 0 when its children are drawn or it has none.
    """

    key: str
    node: int | None  # the SharingTree node, None for a summary
    folded: tuple[int, ...]  # a summary's folded subtree roots
    kind: str  # "text" | "choice" | "summary"
    pruned: bool
    tokens: int  # the node's own tokens (a summary: all folded tokens)
    gen_budget: int
    branches: int
    nodes: int  # tree nodes it stands for (1, or a summary's count)
    hidden: int = 0
    hidden_branches: int = 0


def summarise(tree: SharingTree, limits: Limits, totals: dict[int, NodeTotals] | None = None) -> nx.DiGraph:
    """A DiGraph of :class:`ViewNode` (attribute ``view``): at most ``limits.max_width`` nodes per depth,
    about ``limits.max_nodes`` in all.

    Depth by depth, in branch order: each node's children are drawn while the depth's width and the
    node budget last, at most ``max_children`` of them (else ``max_children - 1`` and one summary node
    of the rest); a node whose children do not fit keeps them folded (``hidden``). So the first
    subtrees are shown in full and the others summarised, whatever the tree's size.
    """
    g = tree.graph
    totals = totals if totals is not None else subtree_totals(tree)
    view = nx.DiGraph()
    budget = limits.max_nodes

    def node_view(n: int, hidden: bool) -> ViewNode:
        attrs, t = g.nodes[n], totals[n]
        below = [totals[c] for c in g.successors(n)] if hidden else []
        return ViewNode(f"n{n}", n, (), attrs["kind"], attrs["pruned"], len(attrs["tokens"]), attrs["gen_budget"],
                        t.branches, 1, sum(b.nodes for b in below), sum(b.branches for b in below))

    def place(parent_key: str | None, nodes: list[int], width: int) -> tuple[list[int], int]:
        """Draw up to ``width`` rows of ``nodes`` under ``parent_key``; returns (drawn nodes, rows used)."""
        nonlocal budget
        k = len(nodes) if len(nodes) <= limits.max_children else limits.max_children - 1
        k = min(k, width, budget)
        if k < len(nodes) and k == width:  # keep a row for the summary
            k -= 1
        drawn, rest = nodes[:k], nodes[k:]
        for n in drawn:
            view.add_node(f"n{n}", view=node_view(n, hidden=False))
            if parent_key is not None:
                view.add_edge(parent_key, f"n{n}")
        if rest:
            key = f"more{parent_key or ''}"
            ts = [totals[n] for n in rest]
            view.add_node(key, view=ViewNode(key, None, tuple(rest), "summary", all(g.nodes[n]["pruned"] for n in rest),
                                             sum(t.tokens for t in ts), sum(t.gen_budget for t in ts),
                                             sum(t.branches for t in ts), sum(t.nodes for t in ts)))
            if parent_key is not None:
                view.add_edge(parent_key, key)
        used = len(drawn) + bool(rest)
        budget -= used
        return drawn, used

    layer, _ = place(None, sorted(n for n in g if g.in_degree(n) == 0), limits.max_width)
    while layer:
        width, below = limits.max_width, []
        for n in layer:
            kids = sorted(g.successors(n))
            if not kids:
                continue
            if width < 1 or budget < 1 or (width < 2 and len(kids) > 1):  # no room: fold them into the parent
                view.nodes[f"n{n}"]["view"] = node_view(n, hidden=True)
                continue
            drawn, used = place(f"n{n}", kids, width)
            width -= used
            below += drawn
        layer = below
    return view


# formatting ---------------------------------------------------------------------------------------
def fmt_bytes(n: int | float) -> str:
    """``1536`` → ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def fmt_count(n: int, word: str) -> str:
    """``fmt_count(1, 'branch')`` → ``'1 branch'``; plural adds ``es`` after ch/s/x, else ``s``."""
    if n == 1:
        return f"1 {word}"
    return f"{n:,} {word}{'es' if word.endswith(('ch', 's', 'x')) else 's'}"


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, keeping head and tail around an ellipsis."""
    if len(text) <= limit:
        return text
    head = (limit - 1) * 2 // 3
    tail = limit - 1 - head
    return text[:head] + "…" + (text[-tail:] if tail else "")


def one_line(text: str) -> str:
    """Newlines shown as ⏎ so an excerpt stays on one line."""
    return text.replace("\r\n", "\n").replace("\n", "⏎").replace("\t", " ")


def decode(tokenizer, ids) -> str:
    """Text of ``ids``; without a tokenizer, the ids themselves."""
    ids = list(ids)
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids)


def kv_bytes(kv_shape: KVShape | None, tokens: int) -> int | None:
    return None if kv_shape is None else tokens * kv_shape.bytes_per_token
