"""SharingTree's structure reads (parent, path, position) stay right through every way edges change."""

import pickle
import re
from pathlib import Path

import treegen
from treegen.tree.passes import share_prefixes
from treegen.tree.sharing_tree import SharingTree


def networkx_path(tree: SharingTree, node: int) -> list[int]:
    out, cur = [], node
    while cur is not None:
        out.append(cur)
        cur = next(iter(tree.graph.pred[cur]), None)
    return out[::-1]


def check(tree: SharingTree) -> None:
    for n in tree.graph:
        assert tree.path(n) == networkx_path(tree, n)
        assert tree.position(n) == sum(len(tree.tokens(p)) for p in networkx_path(tree, n)[:-1])
        assert tree.path_length(n) == len(tree.path_tokens(n))
    for nodes in (list(tree.graph), list(tree.graph)[::-1], list(tree.graph)[-1:]):  # any order, any subset
        positions = tree.positions(nodes)
        assert positions == {n: tree.position(n) for n in positions}
        assert set(nodes) <= set(positions) and all(set(tree.path(n)) <= set(positions) for n in nodes)


def test_parent_path_and_position_follow_every_edge_change():
    tree = SharingTree()
    a = tree.add_node(None, [1, 2, 3])
    b = tree.add_node(a, [4])
    c = tree.add_node(a, [4, 5])
    d = tree.add_node(c, [6])
    check(tree)
    assert tree.path(d) == [a, c, d] and tree.position(d) == 5
    tree.set_parent(d, b)
    assert tree.path(d) == [a, b, d] and tree.position(d) == 4
    tree.set_parent(b, None)
    assert tree.parent(b) is None and tree.path(d) == [b, d]
    check(tree)
    # prefix sharing moves nodes below a new shared one
    t2 = SharingTree()
    root = t2.add_node(None, [9])
    kids = [t2.add_node(root, [1, 2, 3, k]) for k in range(3)]
    share_prefixes(t2, kids)
    check(t2)
    assert all(len(t2.path(k)) == 3 for k in kids)
    # a graph replaced whole (what a mirrored worker receives) and a pickled tree
    t3 = SharingTree()
    t3.graph = pickle.loads(pickle.dumps(t2.graph))
    check(t3)
    assert [t3.path(k) for k in kids] == [t2.path(k) for k in kids]
    check(pickle.loads(pickle.dumps(t2)))


def test_edges_change_only_through_the_sharing_tree():
    """A direct ``graph.add_edge``/``remove_edge`` elsewhere would leave SharingTree's parent table stale."""
    root = Path(treegen.__file__).resolve().parent
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "sharing_tree.py"
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if re.search(r"tree\.graph\.(add_edge|remove_edge|add_edges_from|remove_node)|graph\.remove_edge", line)]
    assert not offenders, offenders


def test_branches_below_counts_the_live_leaves_of_a_subtree_and_subtree_lists_them():
    import networkx as nx

    tree = SharingTree()
    root = tree.add_node(None, [1])
    a, b = tree.add_node(root, [2]), tree.add_node(root, [3])
    a1, a2 = tree.add_node(a, [4]), tree.add_node(a, [5])
    b1 = tree.add_node(b, [6])
    tree.add_node(b1, [7]), tree.add_node(b1, [8])
    tree.prune(a2)
    other = tree.add_node(None, [9])  # another root
    leaves = set(tree.leaves())
    for n in tree.graph:  # the definition: the tree's leaves among the node and its descendants
        assert tree.branches_below(n) == sum(1 for d in nx.descendants(tree.graph, n) | {n} if d in leaves), n
        below = tree.subtree(n)  # the node first, then its descendants, each once
        assert below[0] == n and len(below) == len(set(below)) and set(below) == nx.descendants(tree.graph, n) | {n}
    assert [tree.branches_below(n) for n in (root, a, a1, a2, b, other)] == [3, 1, 1, 0, 2, 1]
    tree.prune(b1)  # b's children all pruned: b is a leaf now
    assert tree.branches_below(b) == 1 and tree.branches_below(root) == 2


def test_extend_leaves_appends_each_run_and_refuses_a_node_with_children():
    tree = SharingTree()
    root = tree.add_node(None, [1, 2])
    a, b = tree.add_node(root, [3]), tree.add_node(root, [])
    tree.extend_leaves([a, b], [[4, 5], [6]])
    assert tree.path_tokens(a) == [1, 2, 3, 4, 5] and tree.path_tokens(b) == [1, 2, 6]
    try:
        tree.extend_leaves([b, root], [[7], [8]])
    except ValueError as e:
        assert f"node {root} has children" in str(e)
    else:
        raise AssertionError("a node with children grew")
    assert tree.tokens(root) == [1, 2]
