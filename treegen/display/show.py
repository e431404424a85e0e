"""Showing treegen's objects: :class:`Rendered` views (notebook HTML and terminal text) of programs, compiled
programs, results and sharing trees (:func:`show`), and majority votes (:func:`votes`)."""

from __future__ import annotations

from html import escape

from treegen.display._view import Limits
from treegen.display.html import compiled_html, program_html, result_html, tree_html, votes_html
from treegen.display.text import compiled_text, program_text, result_text, tally_text, tree_text


class Rendered:
    """A finished view: ``_repr_html_`` for notebooks, ``__repr__`` for terminals, :meth:`save` for a file."""

    def __init__(self, html: str, text: str) -> None:
        self.html, self.text = html, text

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.text

    def page(self, title: str = "treegen") -> str:
        """A standalone HTML page holding the view."""
        return page(self.html, title)

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.page())


def page(html: str, title: str = "treegen") -> str:
    """Wrap a view in a complete HTML document (UTF-8, no external resources)."""
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title></head>'
            f'<body style="margin:16px;background:#fff">{html}</body></html>')


def show(obj, engine=None, *, tokenizer=None, kv_shape=None, limits: Limits = Limits()) -> Rendered:
    """A view of a Program, CompiledProgram, State (a result), SharingTree, or ``.tg`` program or result.

    ``engine`` (or ``tokenizer`` and ``kv_shape``) lets a compiled program or a bare tree show text
    excerpts and KV bytes.
    """
    from treegen.lang.dsl import CompiledProgram, Program
    from treegen.lang.state import State
    from treegen.tree.sharing_tree import SharingTree

    if engine is not None:
        tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        kv_shape = kv_shape if kv_shape is not None else engine.kv_shape
    if isinstance(obj, Program) or _is_tg_program(obj):
        return Rendered(program_html(obj, limits=limits), program_text(obj))
    if hasattr(obj, "state") and isinstance(getattr(obj, "state"), State):  # a .tg result
        return Rendered(result_html(obj, limits=limits), result_text(obj, limits=limits))
    if isinstance(obj, CompiledProgram):
        return Rendered(compiled_html(obj, tokenizer, kv_shape, limits=limits),
                        compiled_text(obj, tokenizer, kv_shape, limits=limits))
    if isinstance(obj, State):
        return Rendered(result_html(obj, limits=limits), result_text(obj, limits=limits))
    if isinstance(obj, SharingTree):
        return Rendered(tree_html(obj, tokenizer, kv_shape, limits=limits),
                        tree_text(obj, tokenizer, kv_shape, limits=limits))
    raise TypeError(f"show: expected a Program, CompiledProgram, State, SharingTree, or a .tg program or result; "
                    f"got {type(obj).__name__}")


def _is_tg_program(obj) -> bool:
    return hasattr(obj, "file") and hasattr(obj, "params") and hasattr(obj, "run") and not hasattr(obj, "fn")


def _values_and_labels(source, name):
    """(groups of (labels, values), title) from a State + variable name, or from a plain list."""
    from treegen.display import results

    if name is None:
        values = list(source)
        return [([f"#{i}" for i in range(len(values))], values, None)]
    value = results.resolve(source, name)
    if not isinstance(value, results.Joined):
        raise ValueError(f"votes: {name!r} is not a joined list on this state")
    out = []
    for parent, members in value.groups():
        out.append(([results.label(st) for st, _ in members], [None if v is results.PENDING else v for _, v in members],
                     parent))
    return out


def votes(source, name: str | None = None, *, extract=None, limits: Limits = Limits()) -> Rendered:
    """Majority vote, shown: each distinct answer, how many branches gave it, which ones, and the winner.

    ``source``: a result State with ``name`` a joined variable (nested joins: one vote per inner
    list), or a plain list of values. ``extract``: as in :func:`treegen.lang.reduce.extract` (a regular
    expression, a function, or None for the whole stripped text); values without an answer do not vote.
    The winner is :func:`treegen.lang.reduce.vote`'s: most votes, ties to the answer seen first.
    """
    from treegen.display import results
    from treegen.lang import reduce

    groups, text = [], []
    for labels, values, parent in _values_and_labels(source, name):
        answers = [reduce.extract(v, extract) if isinstance(v, str) else v for v in values]
        title = "votes" if parent is None or not parent.path else f"votes in {results.label(parent)}"
        groups.append((title, labels, answers))
    shown = max(1, limits.max_rows // 4)
    text = [tally_text(answers, labels, limits=limits, title=title) for title, labels, answers in groups[:shown]]
    if len(groups) > shown:
        text.append(f"… {len(groups) - shown:,} more lists")
    return Rendered(votes_html(groups, limits=limits), "\n".join(text))
