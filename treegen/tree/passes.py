"""Compiler passes over a :class:`~treegen.tree.sharing_tree.SharingTree` before its KV is computed.

:func:`share_prefixes` — global prefix identification (BatchLLM, Sec. 4.2): the token sequences of
several root nodes (one per program of a batch) are put in a token radix tree; every common prefix
becomes one shared node. A few-shot prefix shared by all problems, each problem shared by its N
samples: a two-level tree, found without the user saying so.

:func:`simplify` — drop shared nodes that are too small or too thinly shared to be worth their own
attention step, by copying their tokens into each child (BatchLLM's "fork the child and merge it with
the grandchild", Algorithm 1).

Both passes keep the tree's invariant (a node's ids are a prefix of every descendant's ids; every
branch's full token sequence is unchanged), keep every existing node id (so states pointing at nodes
stay valid) and create new nodes in a deterministic order. They only touch nodes without KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from treegen.tree.sharing_tree import SharingTree

DEFAULT_MIN_SHARED_SAVING = 384
"""Default of :func:`simplify`'s ``min_saving``: a shared node is kept as its own attention step only
when sharing it saves at least this many KV tokens of reads per decode step,
``(branches below - 1) * tokens``. Measured on an H100 (``benchmarks/bench_min_shared_saving.py``,
``min_shared_saving_h100.json``; see :func:`simplify`): of the thresholds this rule can use, 384 made the
choices that cost least over the sweep — 1.3% above the faster layout of each case on average (64, the
earlier guess: 1.8%; always sharing: 4.3%), and every threshold from 128 to 448 within 0.4% of it."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def share_prefixes(tree: SharingTree, nodes: list[int]) -> list[int]:
    """Merge the sibling (or root) ``nodes`` by longest common token prefix; returns the new nodes.

    ``nodes`` must all have the same parent (or all be roots) and no KV yet. Each group of nodes that
    share a first token is split at their longest common prefix ``L``: if one of them holds exactly
    ``L`` tokens (the lowest id of those) it becomes the shared node and the others move below it,
    else a new node holding the ``L`` tokens is created and the group moves below it; the nodes keep
    their ids and their tokens after the prefix. Repeats inside each group until no two nodes below
    the same shared node start with the same token. Node ids of new nodes are assigned in order of the
    lowest member id of each group, so the same inputs always give the same tree.

    Example (token ids): roots ``[1,2,3,4]``, ``[1,2,3,5]``, ``[1,2,6]`` → new node ``[1,2]`` with
    children: new node ``[3]`` (children ``[4]``, ``[5]``) and ``[6]``.
    """
    created: list[int] = []
    parents = {tree.parent(n) for n in nodes}
    if len(parents) > 1:
        raise ValueError("share_prefixes: the nodes must be siblings (or all roots)")
    stack: list[tuple[int | None, list[int]]] = [(parents.pop() if parents else None, sorted(nodes))]
    while stack:
        parent, group_nodes = stack.pop()
        groups: dict[int, list[int]] = {}
        for n in group_nodes:
            toks = tree.tokens(n)
            if toks:
                groups.setdefault(toks[0], []).append(n)
        todo = sorted((g for g in groups.values() if len(g) > 1), key=min)
        for members in reversed(todo):  # the stack pops the lowest group first
            first = tree.tokens(members[0])
            length = min(_common_prefix(first, tree.tokens(m)) for m in members[1:])
            exact = [m for m in members if len(tree.tokens(m)) == length]
            if exact:
                shared = exact[0]
                rest = [m for m in members if m != shared]
            else:
                shared = tree.add_node(parent, first[:length])
                created.append(shared)
                rest = members
            for m in rest:
                toks = tree.graph.nodes[m]["tokens"]
                tree.graph.nodes[m]["tokens"] = toks[length:]
                tree.set_parent(m, shared)
            stack.append((shared, rest))
    return created


@dataclass(frozen=True)
class PrefixMatch:
    """Where a sequence of tokens meets a tree (:func:`match_prefix`): the path from a root down to
    ``parent`` (None: no node) holds its first ``matched`` tokens; ``partial`` (None: none), a child of
    ``parent`` (a root when ``parent`` is None), starts with the next ``partial_length`` tokens, fewer
    than it holds (splitting it there would share them too)."""

    parent: int | None
    matched: int
    partial: int | None = None
    partial_length: int = 0


def match_prefix(tree: SharingTree, tokens: list[int], usable) -> PrefixMatch:
    """The radix lookup of a new program's prompt in a live tree: descend from the roots through
    ``usable(node)`` nodes whose tokens all continue ``tokens``, taking at each level the child that
    shares the most; stop where a child shares only part of its tokens (``partial``). At least the last
    of ``tokens`` is left unmatched (what the new node keeps: a node of its own to generate from).
    Children sharing no first token with ``tokens`` are not compared."""
    parent, matched = None, 0
    while matched < len(tokens) - 1:
        rest = tokens[matched:]
        best, best_length = None, 0
        # (the roots unsorted: a run of many programs that share nothing has as many; ties go to the lowest id)
        for c in (tree.root_set() if parent is None else tree.children(parent)):
            ct = tree.tokens(c)
            if not ct or ct[0] != rest[0] or not usable(c):
                continue
            length = _common_prefix(ct, rest)
            if length > best_length or length == best_length and best is not None and c < best:
                best, best_length = c, length
        if best is None:
            break
        if best_length == len(tree.tokens(best)) and best_length < len(rest):
            parent, matched = best, matched + best_length
            continue
        return PrefixMatch(parent, matched, best, min(best_length, len(rest) - 1))
    return PrefixMatch(parent, matched)


@dataclass(frozen=True)
class Simplified:
    """What :func:`simplify` did: the nodes dissolved into their children and the KV tokens it copies."""

    dissolved: tuple[int, ...]
    copied_tokens: int


def simplify(tree: SharingTree, *, min_saving: int = DEFAULT_MIN_SHARED_SAVING, keep=frozenset(),
             computed=lambda n: 0) -> Simplified:
    """Dissolve shared nodes not worth a separate attention step into their children.

    A node with ``c >= 2`` children, ``t`` tokens and ``b`` branches below saves ``(b - 1) * t`` KV
    token reads per decode step by being shared, and costs one more segment (a partial attention and a
    log-sum-exp merge per query). When the saving is below ``min_saving`` its tokens are copied to the
    front of each child and the node is removed from the path (it keeps its id, empty, and left
    detached as a pruned root so ids never move). A node with one child is always merged into it.
    Processed bottom-up, so a dissolved node's tokens may move further down.

    ``keep``: nodes never dissolved (states still pointing at them, nodes being generated into).
    ``computed(node)``: tokens of the node that already have KV; only nodes where it is 0 (and whose
    children have none) are touched.

    ``min_saving`` — how it was measured (``benchmarks/bench_min_shared_saving.py``, on the GPU, one
    decode step's tree attention): a root of 512 tokens, 8 middle nodes of ``t`` tokens with ``b``
    branches each, the middle level shared vs dissolved, over ``t`` in 1..256 and ``b`` in 2..64, Llama-3-8B
    and TinyLlama heads; the default is the threshold whose choices cost least over all of it. The time
    does not follow ``(b - 1) * t`` alone — with 2 branches sharing never won (1.04-1.2x), with 64 it
    lost up to ``t = 16`` (Llama-3-8B heads) or 32 (TinyLlama; 1.02-1.21x), from 8 to 32 branches it won
    or tied (within 1.5%) from ``t = 1`` — so one threshold is a compromise: 1.17x the faster layout at worst.
    """
    graph = tree.graph
    order = [n for n in reversed(list(_topological(tree)))]
    dissolved, copied = [], 0
    for n in order:
        children = tree.children(n)
        if not children or n in keep or computed(n) or any(computed(c) for c in children):
            continue
        if graph.nodes[n]["pruned"] or graph.nodes[n]["gen_budget"]:
            continue
        t = len(tree.tokens(n))
        if len(children) > 1:
            b = tree.branches_below(n)
            if (b - 1) * t >= min_saving:
                continue
        parent = tree.parent(n)  # None: a root, whose children become roots
        toks = list(tree.tokens(n))
        for c in children:
            graph.nodes[c]["tokens"] = toks + graph.nodes[c]["tokens"]
            tree.set_parent(c, parent)
        copied += t * (len(children) - 1)
        graph.nodes[n]["tokens"] = []
        tree.set_parent(n, None)
        graph.nodes[n]["pruned"] = True
        dissolved.append(n)
    return Simplified(tuple(dissolved), copied)


def _topological(tree: SharingTree):
    """Nodes parents-first, children in id order."""
    roots = [n for n in sorted(tree.graph) if tree.parent(n) is None]
    stack = list(reversed(roots))
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(tree.children(n)))
