"""Self-contained HTML for notebooks: a program, its sharing tree before running, a result after.

Every function returns one HTML string with inline styles only (no scripts, no external CSS, fonts or
images; the drawing is inline SVG), so it renders offline and survives being saved in a notebook. Its
size is bounded by :class:`~treegen.display.Limits`, not by the tree: past a limit, rows and nodes are
summarised ("… 4,960 more branches") and long texts keep their head and tail. Large sections sit in
``<details>`` elements that the reader opens.

Nothing here runs the model: values still pending are shown as pending, never computed.
"""

from __future__ import annotations

import inspect
import textwrap
from collections import Counter
from html import escape

from treegen.display import results
from treegen.display._view import Limits, clip, decode, fmt_bytes, fmt_count, one_line, subtree_totals
from treegen.display.svg import COLOURS, MONO, SANS, draw_tree
from treegen.tree.sharing_tree import KVShape, SharingTree

# inline styles (Jupyter's own table CSS right-aligns and stripes; every cell sets its own)
BOX = f"font-family:{SANS};font-size:13px;color:#222;line-height:1.4;max-width:100%"
TABLE = "border-collapse:collapse;font-size:12px;margin:4px 0 8px 0"
TH = "text-align:left;padding:3px 8px;border-bottom:1px solid #ccc;background:#f5f5f5;font-weight:600"
TD = "text-align:left;padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top"
TDN = "text-align:right;padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top;font-variant-numeric:tabular-nums"
TEXT = f"font-family:{MONO};font-size:12px;white-space:pre-wrap;word-break:break-word;max-width:720px"
SUMMARY = "cursor:pointer;font-weight:600;margin:6px 0"
MUTED = "color:#777"
GEN = "background:#e3f1df;border-radius:3px"  # generated text inside a branch's text
SCROLL = "max-height:560px;overflow:auto;border:1px solid #e5e5e5;border-radius:6px;padding:4px;background:#fff"


def _box(*parts: str) -> str:
    return f'<div style="{BOX}">' + "".join(parts) + "</div>"


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f'<th style="{TH}">{h}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="{TDN if i in numeric else TD}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
                   for r in rows)
    return f'<table style="{TABLE}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _details(summary: str, body: str, open_: bool) -> str:
    return f'<details{" open" if open_ else ""}><summary style="{SUMMARY}">{summary}</summary>{body}</details>'


def _more(n: int, what: str, extra: str = "") -> str:
    return f'<div style="{MUTED};font-size:12px;margin:2px 0 6px 0">… {fmt_count(n, what)} more not shown{extra}</div>'


def _badge(text: str, colour: str = "#666") -> str:
    return (f'<span style="display:inline-block;font-size:11px;padding:0 6px;border-radius:8px;'
            f'border:1px solid {colour};color:{colour};margin-left:4px">{escape(text)}</span>')


def _dot(colour: str, dashed: bool = False) -> str:
    border = f"border:1.5px dashed {colour};background:#fff" if dashed else f"background:{colour}"
    return f'<span style="display:inline-block;width:10px;height:10px;border-radius:50%;{border};vertical-align:-1px"></span>'


# the sharing tree ---------------------------------------------------------------------------------
def _legend() -> str:
    items = [(_dot(COLOURS["shared"]), "shared by several branches"), (_dot(COLOURS["branch"]), "one branch"),
             (_dot(COLOURS["choice"]), "select choice"), (_dot(COLOURS["pruned"]), "pruned (KV freed)"),
             (_dot("#888", dashed=True), "tokens still to generate")]
    return (f'<div style="font-size:11.5px;{MUTED};margin:2px 0 4px 0">disc area ∝ tokens · '
            + " · ".join(f"{d} {escape(t)}" for d, t in items) + "</div>")


def _totals(tree: SharingTree, kv_shape: KVShape | None) -> str:
    """Nodes, branches, stored vs unshared KV, and the saving, with two bars to compare."""
    st = tree.stats(kv_shape or KVShape(1, 1, 1, 1))
    if kv_shape is not None:
        stored, unshared, unit = fmt_bytes(st.stored_bytes), fmt_bytes(st.unshared_bytes), "KV"
    else:
        stored, unshared, unit = f"{st.stored_tokens:,} tokens", f"{st.unshared_tokens:,} tokens", "KV (model unknown: in tokens)"
    frac = st.stored_tokens / st.unshared_tokens if st.unshared_tokens else 1.0
    saving = 1.0 - frac if st.unshared_tokens else 0.0
    line = (f'<b>{fmt_count(st.nodes, "node")}</b> · <b>{fmt_count(st.branches, "branch")}</b> · {unit} stored once per node '
            f'<b>{stored}</b> vs <b>{unshared}</b> if every branch held its own copy · '
            f'<b style="color:#2e7d32">{saving:.0%} saved</b>')
    bar = ('<div style="width:360px;margin:4px 0 2px 0;font-size:11px;color:#555">'
           f'<div style="background:#d9d9d9;height:8px;border-radius:4px;width:100%"></div>'
           f'<div style="margin:1px 0 3px 0">unshared: {unshared}</div>'
           f'<div style="background:{COLOURS["shared"]};height:8px;border-radius:4px;width:{max(frac, 0.005) * 100:.1f}%"></div>'
           f'<div style="margin:1px 0">stored: {stored}</div></div>')
    return f"<div>{line}</div>{bar}"


def _node_table(tree: SharingTree, tokenizer, kv_shape: KVShape | None, limits: Limits, totals) -> str:
    nodes = sorted(tree.graph)
    rows = []
    for n in nodes[: limits.max_rows]:
        a = tree.graph.nodes[n]
        t = totals[n]
        kv = fmt_bytes((len(a["tokens"]) + a["gen_budget"]) * kv_shape.bytes_per_token) if kv_shape else "–"
        parent = tree.parent(n)
        rows.append([str(n), "–" if parent is None else str(parent), escape(a["kind"] + (" (pruned)" if a["pruned"] else "")),
                     f"{len(a['tokens']):,}", f"{a['gen_budget']:,}", f"{t.branches:,}", kv,
                     f'<span style="{TEXT}">{escape(one_line(clip(decode(tokenizer, a["tokens"]), limits.max_chars // 2)))}</span>'])
    table = _table(["node", "parent", "kind", "tokens", "to gen", "branches", "KV", "text"], rows, numeric={0, 1, 3, 4, 5, 6})
    if len(nodes) > limits.max_rows:
        table += _more(len(nodes) - limits.max_rows, "node")
    return table


def tree_html(tree: SharingTree, tokenizer=None, kv_shape: KVShape | None = None, *, limits: Limits = Limits(),
              title: str = "Sharing tree", note: str = "") -> str:
    """The drawing of ``tree`` with its totals, and a collapsed table of its nodes."""
    totals = subtree_totals(tree)
    n = tree.graph.number_of_nodes()
    drawn = min(n, limits.max_nodes)
    caption = "" if drawn >= n else f'<div style="{MUTED};font-size:11.5px">drawing {drawn:,} of {n:,} nodes; dashed cards summarise the rest</div>'
    svg = draw_tree(tree, tokenizer, kv_shape, limits=limits, totals=totals)
    return (f'<div style="font-size:15px;font-weight:600;margin:4px 0">{escape(title)}</div>'
            + (f'<div style="{MUTED}">{note}</div>' if note else "")
            + _totals(tree, kv_shape) + _legend() + caption
            + f'<div style="{SCROLL}">{svg}</div>'
            + _details(f"nodes ({n:,})", _node_table(tree, tokenizer, kv_shape, limits, totals), open_=False))


def compiled_html(compiled, tokenizer=None, kv_shape: KVShape | None = None, *, limits: Limits = Limits()) -> str:
    """A :class:`~treegen.CompiledProgram`: its tree before running, and whether it is complete.

    ``tokenizer`` and ``kv_shape`` default to the attributes of the same names on ``compiled`` when it
    has them; without a tokenizer excerpts show token ids, without a KV shape sizes are in tokens.
    """
    tokenizer = tokenizer if tokenizer is not None else getattr(compiled, "tokenizer", None)
    kv_shape = kv_shape if kv_shape is not None else getattr(compiled, "kv_shape", None)
    if compiled.complete:
        note = "Known before running: nothing has been generated; dashed rings are the tokens <code>gen</code> will add."
    else:
        note = (f"Partial: tracing stopped because {escape(str(compiled.stopped_at))}; "
                "the rest of the tree is built while the program runs.")
    return _box(tree_html(compiled.tree, tokenizer, kv_shape, limits=limits, title="Compiled sharing tree", note=note))


# a program ----------------------------------------------------------------------------------------
def _signature(fn) -> tuple[str, list[inspect.Parameter]]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(…)", []
    params = list(sig.parameters.values())[1:]  # the first is the state
    return "(" + ", ".join(str(p) for p in params) + ")", params


def _source(program) -> tuple[str | None, str]:
    """(source text, language) of a program: a ``source`` attribute (e.g. ``.tg``), else the function's."""
    src = getattr(program, "source", None)
    if isinstance(src, str):
        name = str(getattr(program, "filename", "") or "")
        return src, "python" if name.endswith(".py") else "text"
    try:
        return textwrap.dedent(inspect.getsource(program.fn)), "python"
    except (OSError, TypeError):
        return None, "python"


def _highlight(src: str, language: str) -> str:
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer, TextLexer
    except ImportError:  # pygments comes with rich; plain text all the same
        return f'<pre style="{TEXT}">{escape(src)}</pre>'
    lexer = PythonLexer() if language == "python" else TextLexer()
    return highlight(src, lexer, HtmlFormatter(noclasses=True, style="friendly"))


def program_html(program, *, limits: Limits = Limits()) -> str:
    """A :class:`~treegen.Program`: name, parameters with defaults, docstring and source."""
    name = getattr(program, "__name__", None) or getattr(program.fn, "__name__", "program")
    sig, params = _signature(program.fn)
    doc = inspect.getdoc(program.fn) or ""
    head = (f'<div style="font-size:15px"><span style="{MUTED}">program</span> '
            f'<b style="font-family:{MONO}">{escape(name)}</b><span style="font-family:{MONO}">{escape(sig)}</span></div>')
    parts = [head]
    if doc:
        parts.append(f'<div style="margin:2px 0 4px 0;white-space:pre-wrap">{escape(clip(doc, 4 * limits.max_chars))}</div>')
    if params:
        rows = [[f'<code>{escape(p.name)}</code>',
                 "required" if p.default is inspect.Parameter.empty else f"<code>{escape(clip(repr(p.default), 80))}</code>"]
                for p in params]
        parts.append(_table(["parameter", "default"], rows))
    src, language = _source(program)
    if src is not None:
        lines = src.count("\n") + 1
        body = _highlight(src if len(src) < 40_000 else src[:40_000] + "\n… (source cut)", language)
        parts.append(_details(f"source ({lines} lines)", body, open_=lines <= 40))
    else:
        parts.append(f'<div style="{MUTED}">source not available</div>')
    parts.append(f'<div style="{MUTED};font-size:11.5px">run with <code>{escape(name)}.run(engine, …)</code>; '
                 f'see its tree with <code>{escape(name)}.compile(…, tokenizer=engine.tokenizer)</code></div>')
    return _box(*parts)


# a result -----------------------------------------------------------------------------------------
def _text_spans(view: results.BranchText, limits: Limits) -> str:
    """A branch's own text, generated spans shaded, each span clipped."""
    out = []
    for text, generated in view.spans:
        t = clip(text, limits.max_chars if generated else max(limits.max_chars // 2, 8))
        out.append(f'<span style="{GEN}">{escape(t)}</span>' if generated else escape(t))
    return f'<div style="{TEXT}">{"".join(out)}</div>'


def _info_line(info: dict) -> str:
    """Badges for one variable's info: finish reason and tokens, a join's size, anything else compact."""
    bits = []
    if "finish_reason" in info:
        colour = {"eos": "#2e7d32", "stop": "#1565c0", "length": "#b26a00"}.get(info["finish_reason"], "#666")
        bits.append(_badge(info["finish_reason"], colour))
    if "tokens" in info:
        bits.append(_badge(f"{info['tokens']} tok"))
    for k, v in info.items():
        if k not in results.KNOWN_INFO:
            bits.append(_badge(f"{k}={clip(repr(v), 60)}"))
    return "".join(bits)


def _scores_table(info: dict) -> str:
    scores = info["scores"]
    best = info.get("choice_index")
    choices = list(scores)
    lo, hi = min(scores.values()), max(scores.values())
    rows = []
    for i, c in sorted(enumerate(choices), key=lambda ic: -scores[ic[1]]):
        s = scores[c]
        width = 8 + 112 * ((s - lo) / (hi - lo) if hi > lo else 1.0)
        won = i == best
        bar = f'<span style="display:inline-block;height:8px;width:{width:.0f}px;background:{COLOURS["choice"] if won else "#ccc"};border-radius:3px"></span>'
        rows.append([("✓ " if won else "") + f'<span style="{TEXT}{";font-weight:700" if won else ""}">{escape(repr(c))}</span>',
                     f"{s:.3f}", bar])
    return _table(["choice", "mean log-prob", ""], rows, numeric={1})


def _tally(values: list, limits: Limits) -> str:
    """Counts of identical values (stripped), most common first, when some value repeats."""
    keys = [v.strip() if isinstance(v, str) else repr(v) for v in values if v is not None]
    counts = Counter(keys)
    if not counts or max(counts.values()) < 2:
        return ""
    return tally_html(keys, limits=limits, title="identical values")


def _value_cell(value, info: dict, limits: Limits) -> str:
    if value is results.PENDING:
        return f'<span style="{MUTED}">pending (not run yet)</span>'
    text = value if isinstance(value, str) else repr(value)
    return f'<span style="{TEXT}">{escape(clip(text, limits.max_chars))}</span>' + _info_line(info)


def _variable_html(state, name: str, limits: Limits) -> str:
    value = results.resolve(state, name)
    info = state.info.get(name, {})
    head = f'<div style="margin-top:6px"><b style="font-family:{MONO}">{escape(name)}</b> '
    if isinstance(value, results.Joined):
        items = value.flat()
        groups = value.groups()
        shape = " × ".join(str(d) for d in value.shape())
        head += f'<span style="{MUTED}">list of {shape} (joined from {fmt_count(len(items), "branch")})</span></div>'
        rows, shown = [], 0
        for parent, members in groups:
            if shown >= limits.max_rows:
                break
            if len(groups) > 1:
                label = results.label(parent)
                rows.append([f"<b>{escape(label)}</b>", f'<span style="{TEXT};{MUTED}">'
                             f'{escape(one_line(clip(results.own_text(parent, limits.max_chars).plain(), limits.max_chars)))}</span>'])
            for child, v in members[: limits.max_rows - shown]:
                rows.append([escape(results.label(child)), _value_cell(v, child.info.get(name, {}), limits)])
                shown += 1
            tally = _tally([v for _, v in members if isinstance(v, str)], limits) if len(members) > 1 else ""
            if tally:
                rows.append(["", tally])
        out = head + _table(["branch", "value"], rows)
        if len(items) > shown:
            out += _more(len(items) - shown, "value")
        return out
    body = _value_cell(value, info, limits)
    if "scores" in info:
        body += _scores_table(info)
    return head + "</div>" + f'<div style="margin-left:12px">{body}</div>'


def _branch_rows(state, limits: Limits) -> tuple[str, int]:
    states = results.descendants(state)
    rows = []
    for st in states[: limits.max_rows]:
        own = [f'<div><b style="font-family:{MONO}">{escape(k)}</b> = {_value_cell(results.resolve(st, k), st.info.get(k, {}), limits)}</div>'
               for k in st.info if not isinstance(results.resolve(st, k), results.Joined)]
        joined = [f'<div style="{MUTED}">{escape(k)}: joined {fmt_count(st.info[k].get("branches", 0), "branch")}</div>'
                  for k in st.info if isinstance(results.resolve(st, k), results.Joined)]
        rows.append([escape(results.label(st)), _text_spans(results.own_text(st, limits.max_chars), limits), "".join(own + joined)])
    table = _table(["branch", "its text (generated text shaded)", "variables"], rows)
    if len(states) > limits.max_rows:
        rest = Counter(i["finish_reason"] for st in states[limits.max_rows:] for i in st.info.values() if "finish_reason" in i)
        extra = (" (finish: " + ", ".join(f"{k} {v:,}" for k, v in sorted(rest.items())) + ")") if rest else ""
        table += _more(len(states) - limits.max_rows, "branch", extra)
    return table, len(states)


def result_html(state, *, limits: Limits = Limits()) -> str:
    """A state after (or while) running: its variables, the executed tree, and every branch below it.

    For a joined list each value is shown beside the branch that made it; values that several branches
    agree on are counted; a ``select`` shows every choice's score and the winner.
    """
    run = state._run
    tokenizer = run.tokenizer
    engine = getattr(run, "engine", None)
    kv_shape = getattr(engine, "kv_shape", None)
    summary = results.summary(state)
    head = (f'<div style="font-size:15px"><span style="{MUTED}">result</span> <b>{escape(results.label(state))}</b> '
            f'<span style="{MUTED};font-size:12.5px">· {escape(summary)}</span></div>')
    names = list(state.vars)
    variables = "".join(_variable_html(state, n, limits) for n in names[: limits.max_rows])
    if len(names) > limits.max_rows:
        variables += _more(len(names) - limits.max_rows, "variable")
    if not names:
        variables = f'<div style="{MUTED}">no variables</div>'
    branches, count = _branch_rows(state, limits)
    tree = tree_html(state.tree, tokenizer, kv_shape, limits=limits, title="Executed sharing tree")
    return _box(head, _details("variables", variables, open_=True),
                _details("executed tree", tree, open_=True),
                _details(f"branches ({count:,})", branches, open_=count <= 8))


# votes --------------------------------------------------------------------------------------------
def tally_html(values, labels=None, *, limits: Limits = Limits(), title: str = "votes") -> str:
    """Counts of each distinct value, most common first (ties: first seen), with bars and the branches
    that gave it. ``None`` values are counted apart as "no answer"."""
    values = list(values)
    labels = list(labels) if labels is not None else [f"#{i}" for i in range(len(values))]
    if len(labels) != len(values):
        raise ValueError(f"tally: {len(labels)} labels for {len(values)} values")
    order: dict = {}
    for v, lab in zip(values, labels):
        order.setdefault(v, []).append(lab)
    ranked = sorted(order.items(), key=lambda kv: -len(kv[1]))  # stable: first seen wins ties
    answered = [kv for kv in ranked if kv[0] is not None]
    total = len(values)
    rows = []
    for i, (v, labs) in enumerate(ranked[: limits.max_rows]):
        won = answered and v == answered[0][0]
        width = 4 + 156 * len(labs) / max(total, 1)
        bar = (f'<span style="display:inline-block;height:10px;width:{width:.0f}px;border-radius:3px;'
               f'background:{"#2e7d32" if won else "#bbb"}"></span>')
        shown = ", ".join(labs[:12]) + (f", … ({len(labs) - 12} more)" if len(labs) > 12 else "")
        text = "no answer" if v is None else clip(v if isinstance(v, str) else repr(v), limits.max_chars)
        rows.append([("🏆 " if won else "") + f'<span style="{TEXT}{";font-weight:700" if won else ""}">{escape(text)}</span>',
                     f"{len(labs):,}", bar, f'<span style="{MUTED}">{escape(shown)}</span>'])
    table = _table(["value", "count", "", "branches"], rows, numeric={1})
    if len(ranked) > limits.max_rows:
        table += _more(len(ranked) - limits.max_rows, "distinct value")
    winner = ""
    if answered:
        v, labs = answered[0]
        tie = len(answered) > 1 and len(answered[1][1]) == len(labs)
        winner = (f'<div>{escape(title)}: <b>{escape(clip(str(v), 80))}</b> with {len(labs):,} of {total:,}'
                  + (' <span style="color:#b26a00">(tie, first seen wins)</span>' if tie else "") + "</div>")
    return f"<div>{winner}{table}</div>"


def tally_box(values, labels=None, *, limits: Limits = Limits(), title: str = "votes") -> str:
    return _box(tally_html(values, labels, limits=limits, title=title))
