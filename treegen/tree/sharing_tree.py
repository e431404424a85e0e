"""The explicit sharing tree: every node is a run of token ids shared by all branches below it.

A branch's token sequence is the concatenation of the node runs on its root-to-leaf path, so a
node's ids are an exact prefix of every descendant's ids. Text is tokenised segment by segment and
the ids are concatenated (``ids("ab") + ids("c")``, not ``ids("abc")``); this is what keeps the
prefix property exact, and it is the token sequence every comparison with Hugging Face uses.

The tree is a ``networkx.DiGraph`` whose node ids are integers in creation order, so the same program
always builds the same ids. Node attributes:

* ``tokens: list[int]`` — the node's run (grows while a branch in it generates);
* ``kind: str`` — ``"text"`` (prompt or generated run), ``"choice"`` (a ``select`` alternative);
* ``pruned: bool`` — True once a node's work is done and its KV was freed (a losing choice);
* ``gen_budget: int`` — tokens still to be generated into the node (``max_tokens`` of its pending
  ``gen`` calls), so a tree compiled before running reports the KV it will need.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx


@dataclass(frozen=True)
class KVShape:
    """What one token of KV cache costs for a model: ``2 * layers * kv_heads * (head_dim * dtype bytes
    + scale bytes)`` — keys and values; an 8-bit KV format adds a 4-byte scale per token and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * self.dtype_bytes + self.scale_bytes)

    @classmethod
    def from_config(cls, config, dtype_bytes: int = 2, scale_bytes: int = 0) -> "KVShape":
        """From a Hugging Face config (``head_dim`` read from it when present)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype_bytes, scale_bytes)


@dataclass(frozen=True)
class TreeStats:
    """Totals of a tree for one model: KV bytes stored once per node vs one full copy per branch."""

    nodes: int
    branches: int
    stored_tokens: int
    unshared_tokens: int
    stored_bytes: int
    unshared_bytes: int

    @property
    def saving(self) -> float:
        """Fraction of KV bytes saved by sharing (0 when nothing is shared)."""
        return 1.0 - self.stored_bytes / self.unshared_bytes if self.unshared_bytes else 0.0


class SharingTree:
    """A growing forest of token runs. See the module docstring for the node attributes."""

    def __init__(self) -> None:
        self.graph = nx.DiGraph()

    # Every node's parent, kept beside the graph: the engine asks for paths and positions on every
    # step (scheduling, planning) and a networkx predecessor lookup costs ~3 us against ~0.1 here.
    # Edges change only through add_node / set_parent, or by replacing ``graph`` whole.
    @property
    def graph(self) -> nx.DiGraph:
        return self._graph

    @graph.setter
    def graph(self, graph: nx.DiGraph) -> None:
        self._graph = graph
        self._parent = {n: next(iter(graph.pred[n]), None) for n in graph}
        # networkx's own node-attribute and successor dicts (``graph.nodes[n]`` and ``graph.out_degree``
        # go through view objects, ~1 us a lookup): read by the per-token and per-plan paths below
        self._data, self._succ = graph._node, graph._succ
        self._roots = {n for n, p in self._parent.items() if p is None}

    # building ---------------------------------------------------------------------------------
    def add_node(self, parent: int | None, tokens=(), kind: str = "text") -> int:
        """Create a node (a root when ``parent`` is None) and return its id."""
        node = self.graph.number_of_nodes()
        self.graph.add_node(node, tokens=list(tokens), kind=kind, pruned=False, gen_budget=0)
        self._parent[node] = None
        self._roots.add(node)
        if parent is not None:
            self.set_parent(node, parent)
        return node

    def set_parent(self, node: int, parent: int | None) -> None:
        """Move ``node`` (and its subtree) below ``parent`` (None: make it a root)."""
        old = self._parent[node]
        if old is not None:
            self.graph.remove_edge(old, node)
        if parent is not None:
            self.graph.add_edge(parent, node)
            self._roots.discard(node)
        else:
            self._roots.add(node)
        self._parent[node] = parent

    def extend(self, node: int, tokens) -> None:
        """Append ids to a node's run; only a node without children may grow."""
        self.extend_leaves((node,), (tokens,))

    def extend_leaves(self, nodes, runs) -> None:
        """:meth:`extend` of each of ``nodes`` by its run of ``runs``, in order (a decode block's tokens: one call;
        a node with children is refused there, the nodes before it having grown)."""
        succ, data = self._succ, self._data
        for node, tokens in zip(nodes, runs):
            if succ[node]:
                raise ValueError(f"node {node} has children; its tokens are shared and cannot grow")
            data[node]["tokens"].extend(tokens)

    def split(self, node: int, length: int) -> int:
        """Put a new node holding ``node``'s first ``length`` tokens between it and its parent; ``node``
        keeps the rest (and its id, children and attributes). Returns the new node. Every branch's token
        sequence is unchanged."""
        tokens = self._data[node]["tokens"]
        if not 0 < length < len(tokens):
            raise ValueError(f"split of node {node}: length must be in 1..{len(tokens) - 1} (it holds {len(tokens)} "
                             f"tokens), got {length}")
        head = self.add_node(self._parent[node], tokens[:length])
        self._data[node]["tokens"] = tokens[length:]
        self.set_parent(node, head)
        return head

    def prune(self, node: int) -> None:
        """Mark a node and its subtree as finished with (their KV has been freed)."""
        data = self._data
        for n in self.subtree(node):
            data[n]["pruned"] = True

    # reading ----------------------------------------------------------------------------------
    def subtree(self, node: int) -> list[int]:
        """``node`` and every node below it, ``node`` first (the others in no promised order)."""
        succ, out = self._succ, [node]
        for n in out:  # (the successor dicts directly: networkx's descendants() costs ~10x more a node)
            out.extend(succ[n])
        return out

    def tokens(self, node: int) -> list[int]:
        return self._data[node]["tokens"]

    def size(self, node: int) -> int:
        """Tokens the node holds now plus those it is still to generate."""
        data = self._data[node]
        return len(data["tokens"]) + data["gen_budget"]

    def parent(self, node: int) -> int | None:
        return self._parent[node]

    def roots(self) -> list[int]:
        """Nodes without a parent (pruned ones included), in id order."""
        return sorted(self._roots)

    def root_set(self) -> frozenset[int]:
        """:meth:`roots` unordered (no sort: a radix lookup over thousands of roots)."""
        return frozenset(self._roots)

    def children(self, node: int) -> list[int]:
        return sorted(self.graph.successors(node))

    def path(self, node: int) -> list[int]:
        """Root-to-node list of node ids."""
        parent = self._parent
        out = []
        cur: int | None = node
        while cur is not None:
            out.append(cur)
            cur = parent[cur]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """The full token sequence of a branch ending at ``node``."""
        return [t for n in self.path(node) for t in self.tokens(n)]

    def position(self, node: int) -> int:
        """Absolute position of the node's first token (tokens on the path above it)."""
        nodes, parent = self._data, self._parent
        total, cur = 0, parent[node]
        while cur is not None:
            total += len(nodes[cur]["tokens"])
            cur = parent[cur]
        return total

    def path_length(self, node: int) -> int:
        """Tokens of the branch ending at ``node`` (``len(path_tokens(node))``, without building it)."""
        return self.position(node) + len(self.tokens(node))

    def positions(self, nodes) -> dict[int, int]:
        """:meth:`position` of each of ``nodes`` and of their ancestors, every node's tokens counted once
        (a plan of many branches below shared nodes asks for thousands)."""
        out: dict[int, int] = {}
        nodes_data, parent = self._data, self._parent
        for node in nodes:
            chain, cur = [], node
            while cur is not None and cur not in out:
                chain.append(cur)
                cur = parent[cur]
            base = 0 if cur is None else out[cur] + len(nodes_data[cur]["tokens"])
            for n in reversed(chain):
                out[n] = base
                base += len(nodes_data[n]["tokens"])
        return out

    def live_nodes(self) -> list[int]:
        return [n for n in sorted(self.graph) if not self.graph.nodes[n]["pruned"]]

    def leaves(self) -> list[int]:
        """Branches: live nodes without live children."""
        return [n for n in self.live_nodes() if self._is_branch(n)]

    def _is_branch(self, node: int) -> bool:
        data = self.graph.nodes
        return not data[node]["pruned"] and all(data[c]["pruned"] for c in self.graph.succ[node])

    def branches_below(self, node: int, at_most: int | None = None) -> int:
        """Branches (:meth:`leaves`) in ``node``'s subtree, itself included: one walk of the subtree,
        which stops once ``at_most`` are found (None: counts them all)."""
        count, stack = 0, [node]
        while stack and (at_most is None or count < at_most):
            n = stack.pop()
            count += self._is_branch(n)
            stack += self.graph.succ[n]
        return count

    def stats(self, kv: KVShape) -> TreeStats:
        """KV bytes of the live tree stored once per node, vs each branch holding its own copy.

        Counts :meth:`size` (tokens plus the generation budget still to come).
        """
        live = self.live_nodes()
        leaves = self.leaves()
        stored = sum(self.size(n) for n in live)
        unshared = sum(self.size(p) for n in leaves for p in self.path(n))
        return TreeStats(
            nodes=len(live),
            branches=len(leaves),
            stored_tokens=stored,
            unshared_tokens=unshared,
            stored_bytes=stored * kv.bytes_per_token,
            unshared_bytes=unshared * kv.bytes_per_token,
        )

    def node_table(self, kv: KVShape) -> list[dict]:
        """Per live node: id, parent, tokens, branches below, KV bytes."""
        return [
            {
                "node": n,
                "parent": self.parent(n),
                "kind": self.graph.nodes[n]["kind"],
                "tokens": len(self.tokens(n)),
                "gen_budget": self.graph.nodes[n]["gen_budget"],
                "branches": self.branches_below(n),
                "kv_bytes": self.size(n) * kv.bytes_per_token,
            }
            for n in self.live_nodes()
        ]
