"""Plain-text views for terminals (``__repr__``), bounded by the same :class:`Limits` as the HTML.

The tree outline is drawn with :class:`rich.tree.Tree` (rendered without colour); like the HTML it is
summarised past ``limits.max_nodes``.
"""

from __future__ import annotations

import inspect
import io

from rich.console import Console
from rich.text import Text
from rich.tree import Tree

from treegen.display import results
from treegen.display._view import Limits, clip, decode, fmt_bytes, fmt_count, one_line, subtree_totals, summarise
from treegen.tree.sharing_tree import KVShape, SharingTree


def _render(renderable, width: int = 110) -> str:
    buf = io.StringIO()
    # force_jupyter=False: in a notebook rich would display the text itself instead of writing it to buf
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, force_jupyter=False,
                      highlight=False)
    console.print(renderable)
    return buf.getvalue().rstrip("\n")


def totals_line(tree: SharingTree, kv_shape: KVShape | None) -> str:
    st = tree.stats(kv_shape or KVShape(1, 1, 1, 1))
    saving = 1.0 - st.stored_tokens / st.unshared_tokens if st.unshared_tokens else 0.0
    if kv_shape is not None:
        kv = f"KV {fmt_bytes(st.stored_bytes)} stored vs {fmt_bytes(st.unshared_bytes)} unshared"
    else:
        kv = f"{st.stored_tokens:,} tokens stored vs {st.unshared_tokens:,} unshared"
    return f"{fmt_count(st.nodes, 'node')}, {fmt_count(st.branches, 'branch')}; {kv} ({saving:.0%} saved)"


def tree_text(tree: SharingTree, tokenizer=None, kv_shape: KVShape | None = None, *, limits: Limits = Limits()) -> str:
    """An indented outline: one line per drawn node with tokens, branches, KV and an excerpt."""
    if tree.graph.number_of_nodes() == 0:
        return "(empty tree)"
    view = summarise(tree, limits, subtree_totals(tree))
    top = Tree(Text(totals_line(tree, kv_shape)), guide_style="dim")
    handles = {}
    for key in _bfs(view):
        v = view.nodes[key]["view"]
        kb = None if kv_shape is None else (v.tokens + v.gen_budget) * kv_shape.bytes_per_token
        size = f"{v.tokens:,} tok" + (f" +{v.gen_budget:,} gen" if v.gen_budget else "")
        stats = ", ".join([size, fmt_count(v.branches, "branch")] + ([fmt_bytes(kb)] if kb is not None else []))
        if v.node is None:
            line = f"… {fmt_count(v.nodes, 'more node')} ({stats})"
        else:
            text = one_line(clip(decode(tokenizer, tree.tokens(v.node)), 48))
            tag = " choice" if v.kind == "choice" else ""
            tag += " pruned" if v.pruned else ""
            line = f"[{v.node}{tag}] {stats}  {text!r}"
            if v.hidden:
                line += f"  (+ {fmt_count(v.hidden, 'node')} below)"
        parents = list(view.predecessors(key))
        handles[key] = (handles[parents[0]] if parents else top).add(Text(line))
    return _render(top)


def _bfs(view):
    roots = [k for k in view if view.in_degree(k) == 0]
    order, queue = [], list(roots)
    while queue:
        k = queue.pop(0)
        order.append(k)
        queue.extend(view.successors(k))
    return order


def program_text(program) -> str:
    """``<program name(params)>`` and the first line of its docstring."""
    if hasattr(program, "file") and hasattr(program, "params") and not hasattr(program, "fn"):  # a .tg program
        params = ", ".join(p.name + ("" if p.required else f"={p.default!r}") for p in program.params.values())
        return clip(f"<treegen .tg program {program.name}({params})>", 400)
    name = getattr(program, "__name__", None) or getattr(program.fn, "__name__", "program")
    try:
        params = list(inspect.signature(program.fn).parameters.values())[1:]
        sig = "(" + ", ".join(str(p) for p in params) + ")"
    except (TypeError, ValueError):
        sig = "(…)"
    doc = (inspect.getdoc(program.fn) or "").strip().splitlines()
    return f"<treegen program {name}{sig}>" + (f"\n  {doc[0]}" if doc else "")


def compiled_text(compiled, tokenizer=None, kv_shape: KVShape | None = None, *, limits: Limits = Limits()) -> str:
    tokenizer = tokenizer if tokenizer is not None else getattr(compiled, "tokenizer", None)
    kv_shape = kv_shape if kv_shape is not None else getattr(compiled, "kv_shape", None)
    head = "CompiledProgram (complete)" if compiled.complete else f"CompiledProgram (partial: {compiled.stopped_at})"
    return head + "\n" + tree_text(compiled.tree, tokenizer, kv_shape, limits=limits)


def result_text(state, *, limits: Limits = Limits()) -> str:
    """The state's label and run summary, then each variable (joined lists one value per line).
    ``state`` may be a ``.tg`` result (its root state is shown, after its parameters)."""
    lines, hide = [], set()
    if not hasattr(state, "_run") and hasattr(state, "state"):
        values = getattr(state, "values", {}) or {}
        state = state.state
        hide = {k for k, v in values.items() if state.vars.get(k) is v}
        lines.append("parameters: " + ", ".join(f"{k}={clip(repr(v), 40)}" for k, v in values.items()))
    lines.insert(0, f"treegen result {results.label(state)}: {results.summary(state)}")
    for name in [n for n in state.vars if n not in hide][: limits.max_rows]:
        value = results.resolve(state, name)
        if isinstance(value, results.Joined):
            items = value.flat()
            lines.append(f"  {name}: list of {' x '.join(map(str, value.shape()))}")
            for st, v in items[: limits.max_rows]:
                info = st.info.get(name, {})
                extra = f"  [{info['finish_reason']}, {info.get('tokens', '?')} tok]" if "finish_reason" in info else ""
                lines.append(f"    {results.label(st):>8}  {results.short(v, limits.max_chars // 3)}{extra}")
            if len(items) > limits.max_rows:
                lines.append(f"    … {len(items) - limits.max_rows:,} more")
        else:
            info = state.info.get(name, {})
            extra = ""
            if info.get("reduction") == "vote" and isinstance(info.get("votes"), dict):
                extra = "  vote: " + (", ".join(f"{a!r}×{c}" for a, c in info["votes"].items()) or "no answers")
            elif info.get("reduction") == "best" and info.get("winners"):
                extra = f"  best: branch #{info['winners'][0]}"
            elif info.get("reduction") == "top_k" and "winners" in info:
                extra = "  top_k: branches " + ", ".join(f"#{i}" for i in info["winners"])
            elif isinstance(info.get("scores"), dict):
                extra = "  scores: " + ", ".join(f"{c!r}: {s:.3f}" for c, s in info["scores"].items())
            elif "finish_reason" in info:
                extra = f"  [{info['finish_reason']}, {info.get('tokens', '?')} tok]"
            lines.append(f"  {name} = {results.short(value, limits.max_chars // 2)}{extra}")
    if len(state.vars) > limits.max_rows:
        lines.append(f"  … {len(state.vars) - limits.max_rows:,} more variables")
    return "\n".join(lines)


def tally_text(values, labels=None, *, limits: Limits = Limits(), title: str = "votes") -> str:
    values = list(values)
    labels = list(labels) if labels is not None else [f"#{i}" for i in range(len(values))]
    groups: dict = {}
    for v, lab in zip(values, labels):
        groups.setdefault(v, []).append(lab)
    ranked = sorted(groups.items(), key=lambda kv: (kv[0] is None, -len(kv[1])))
    lines = [f"{title}: {len(values):,} values, {len(ranked):,} distinct"]
    for v, labs in ranked[: limits.max_rows]:
        lines.append(f"  {len(labs):>5}  {'no answer' if v is None else results.short(v, 60)}")
    if len(ranked) > limits.max_rows:
        lines.append(f"  … {len(ranked) - limits.max_rows:,} more")
    return "\n".join(lines)
