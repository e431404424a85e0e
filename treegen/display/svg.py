"""Draw a sharing tree as a self-contained SVG string (no scripts, no fonts or files fetched).

Positions come from :func:`networkx.bfs_layout` (one column per tree depth, root at the left, children in
creation order, so edges never cross); this module only turns them into shapes. Every node is a disc
whose *area* is proportional to its tokens (a dashed ring around it: tokens still to be generated) and
a card with a text excerpt, its token count, the branches below it and its KV bytes. Hovering shows a
longer excerpt (an SVG ``<title>``).
"""

from __future__ import annotations

import math
from html import escape

import networkx as nx

from treegen.display._view import (
    Limits,
    NodeTotals,
    ViewNode,
    clip,
    decode,
    fmt_bytes,
    fmt_count,
    kv_bytes,
    one_line,
    subtree_totals,
    summarise,
)
from treegen.tree.sharing_tree import KVShape, SharingTree

# geometry (pixels)
COLUMN = 340  # distance between depths (room for the card and the edges fanning out)
ROW = 54  # distance between nodes of one depth
CARD_W, CARD_H = 236, 42
R_MIN, R_MAX = 4.0, 16.0
PAD = 12

# colours, also used by the HTML legend
COLOURS = {
    "shared": "#4c78a8",  # a node above more than one branch
    "branch": "#59a14f",  # a node of one branch
    "choice": "#f28e2b",  # a select alternative
    "pruned": "#bab0ac",  # freed: a losing choice
    "summary": "#9d9d9d",
}
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
SANS = "DejaVu Sans, Helvetica, Arial, sans-serif"


def colour(v: ViewNode) -> str:
    if v.kind == "summary":
        return COLOURS["summary"]
    if v.pruned:
        return COLOURS["pruned"]
    if v.kind == "choice":
        return COLOURS["choice"]
    return COLOURS["shared"] if v.branches > 1 else COLOURS["branch"]


def _positions(view: nx.DiGraph) -> tuple[dict[str, tuple[int, float]], int, int]:
    """{key: (depth, row)} from networkx's BFS layout, plus the number of depths and of rows."""
    roots = [k for k in view if view.in_degree(k) == 0]
    g = view
    if len(roots) > 1:  # a forest: lay it out under a virtual root, then drop it
        g = view.copy()
        g.add_edges_from(("", r) for r in roots)
        start = ""
    else:
        start = roots[0]
    pos = nx.bfs_layout(g, start, align="vertical")
    xs = sorted({round(float(p[0]), 9) for p in pos.values()})
    ys = sorted({round(float(p[1]), 9) for p in pos.values()})
    # bfs_layout spaces depths and rows by the same unit before scaling; recover it
    unit = xs[1] - xs[0] if len(xs) > 1 else (ys[1] - ys[0] if len(ys) > 1 else 1.0)
    ymin = ys[0]
    out = {k: (xs.index(round(float(p[0]), 9)), (float(p[1]) - ymin) / unit) for k, p in pos.items() if k != ""}
    if start == "":
        out = {k: (d - 1, r) for k, (d, r) in out.items()}
    depths = 1 + max(d for d, _ in out.values())
    rows = 1 + round(max(r for _, r in out.values()))
    return out, depths, rows


def node_text(tree: SharingTree, tokenizer, node: int) -> str:
    return decode(tokenizer, tree.tokens(node))


def draw_tree(tree: SharingTree, tokenizer=None, kv_shape: KVShape | None = None, *, limits: Limits = Limits(),
              totals: dict[int, NodeTotals] | None = None, view: nx.DiGraph | None = None) -> str:
    """The SVG of ``tree`` summarised to ``limits`` (an empty tree gives a one-line SVG saying so).

    ``totals`` and ``view`` (from :func:`subtree_totals` and :func:`summarise`) are computed when not given.
    """
    if tree.graph.number_of_nodes() == 0:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="240" height="30"><text x="8" y="20" '
                f'font-family="{SANS}" font-size="12" fill="#666">empty tree</text></svg>')
    totals = totals if totals is not None else subtree_totals(tree)
    view = view if view is not None else summarise(tree, limits, totals)
    pos, depths, rows = _positions(view)
    nodes = {k: view.nodes[k]["view"] for k in view}
    biggest = max((v.tokens + v.gen_budget for v in nodes.values() if v.node is not None), default=1) or 1
    most_branches = max((v.branches for v in nodes.values()), default=1) or 1

    def radius(v: ViewNode) -> tuple[float, float]:
        """(outer, inner): outer area ∝ tokens + budget, inner area ∝ tokens held."""
        size = v.tokens + v.gen_budget
        outer = R_MIN + (R_MAX - R_MIN) * math.sqrt(size / biggest)
        inner = outer * math.sqrt(v.tokens / size) if size else 0.0
        return outer, inner

    def centre(k: str) -> tuple[float, float]:
        d, r = pos[k]
        return PAD + R_MAX + d * COLUMN, PAD + CARD_H / 2 + r * ROW

    width = PAD * 2 + (depths - 1) * COLUMN + 2 * R_MAX + 6 + CARD_W
    height = PAD * 2 + (rows - 1) * ROW + CARD_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{SANS}" role="img">']

    # edges first, under the nodes: from the parent's card to the child's disc
    for a, b in sorted(view.edges, key=lambda e: (pos[e[1]][0], pos[e[1]][1])):
        (xa, ya), (xb, yb) = centre(a), centre(b)
        x0 = xa + R_MAX + 6 + CARD_W
        x1 = xb - (radius(nodes[b])[0] if nodes[b].node is not None else 8)
        mid = (x0 + x1) / 2
        w = 1.0 + 2.5 * math.sqrt(nodes[b].branches / most_branches)
        dash = ' stroke-dasharray="4 3"' if nodes[b].kind == "summary" or nodes[b].pruned else ""
        out.append(f'<path d="M{x0:.1f},{ya:.1f} C{mid:.1f},{ya:.1f} {mid:.1f},{yb:.1f} {x1:.1f},{yb:.1f}" '
                   f'fill="none" stroke="#b8c2cc" stroke-width="{w:.2f}"{dash}/>')

    for k in sorted(nodes, key=lambda k: pos[k]):
        v = nodes[k]
        x, y = centre(k)
        cx0 = x + R_MAX + 6  # card left
        col = colour(v)
        kb = kv_bytes(kv_shape, v.tokens + v.gen_budget)
        out.append("<g>")
        if v.node is None:
            line1 = f"+ {fmt_count(v.nodes, 'more node')}"
            line2 = (fmt_count(v.branches, "branch") + f" · {v.tokens:,} tok"
                     + (f" + {v.gen_budget:,} to gen" if v.gen_budget else "")
                     + (f" · {fmt_bytes(kb)}" if kb is not None else ""))
            title = f"{v.nodes} nodes not drawn (display limit): {v.branches} branches, {v.tokens} tokens"
            out.append(f'<title>{escape(title)}</title>')
            for dx in (-5, 0, 5):
                out.append(f'<circle cx="{x + dx:.1f}" cy="{y:.1f}" r="3" fill="{col}"/>')
            out.append(f'<rect x="{cx0:.1f}" y="{y - CARD_H / 2:.1f}" width="{CARD_W}" height="{CARD_H}" rx="6" '
                       f'fill="#fafafa" stroke="{col}" stroke-dasharray="4 3"/>')
            out.append(f'<text x="{cx0 + 8:.1f}" y="{y - 4:.1f}" font-size="12" fill="#555">{escape(line1)}</text>')
            out.append(f'<text x="{cx0 + 8:.1f}" y="{y + 12:.1f}" font-size="10.5" fill="#777">{escape(line2)}</text>')
            out.append("</g>")
            continue
        text = node_text(tree, tokenizer, v.node)
        excerpt = one_line(text)
        if v.kind == "choice":
            excerpt = "choice: " + excerpt
        if not text and v.gen_budget:
            excerpt = f"⟨gen up to {v.gen_budget} tokens⟩"
        elif not text:
            excerpt = "(empty)"
        size = f"{v.tokens:,} tok" + (f" + {v.gen_budget:,} to gen" if v.gen_budget else "")
        stats = [size, fmt_count(v.branches, "branch")]
        if kb is not None:
            stats.append(fmt_bytes(kb))
        if v.pruned:
            stats = ["pruned"] + stats[:1]
        tip = [f"node {v.node} ({v.kind}{', pruned' if v.pruned else ''})", " · ".join(stats)]
        if v.hidden:
            tip.append(f"{fmt_count(v.hidden, 'node')} below it not drawn (display limits)")
        tip += ["", clip(text, 600)]
        out.append(f"<title>{escape(chr(10).join(tip))}</title>")
        outer, inner = radius(v)
        if v.gen_budget:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{outer:.1f}" fill="#fff" stroke="{col}" '
                       f'stroke-width="1.5" stroke-dasharray="3 2"/>')
        if inner > 0:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{max(inner, 1.5):.1f}" fill="{col}"/>')
        card_fill = "#f4f4f4" if v.pruned else "#ffffff"
        out.append(f'<rect x="{cx0:.1f}" y="{y - CARD_H / 2:.1f}" width="{CARD_W}" height="{CARD_H}" rx="6" '
                   f'fill="{card_fill}" stroke="{col}" stroke-width="1.2"/>')
        out.append(f'<rect x="{cx0:.1f}" y="{y - CARD_H / 2:.1f}" width="4" height="{CARD_H}" rx="2" fill="{col}"/>')
        fill = "#999" if v.pruned else "#222"
        deco = ' text-decoration="line-through"' if v.pruned else ""
        out.append(f'<text x="{cx0 + 10:.1f}" y="{y - 4:.1f}" font-family="{MONO}" font-size="11" fill="{fill}"{deco}>'
                   f'{escape(clip(excerpt, 31 - (len(f"{v.hidden:,}") + 3 if v.hidden else 0)))}</text>')
        out.append(f'<text x="{cx0 + 10:.1f}" y="{y + 13:.1f}" font-size="10.5" fill="#666">'
                   f'{escape(" · ".join(stats))}</text>')
        if v.hidden:  # children left out by the limits: a dashed stub, and the count in the card's corner
            x_end = cx0 + CARD_W
            out.append(f'<path d="M{x_end:.1f},{y:.1f} h14" stroke="#b8c2cc" stroke-width="1.5" '
                       'stroke-dasharray="3 2"/>')
            out.append(f'<text x="{x_end - 6:.1f}" y="{y - 4:.1f}" font-size="10.5" fill="#777" text-anchor="end">'
                       f'+{v.hidden:,} ▸</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)
