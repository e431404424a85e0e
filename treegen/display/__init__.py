"""Notebook and terminal views of programs, sharing trees and results.

In a notebook::

    %load_ext treegen.display          # the %%treegen cell magic (and HTML views where the classes lack them)
    from treegen.display import show, votes, progress

    prog                                # a Program: its parameters and source
    show(prog.compile(q, tokenizer=engine.tokenizer), engine)   # the sharing tree before running, with KV bytes
    with progress(engine):              # live bars while generating
        result = prog.run(engine, q)
    with progress(engine) as bars:      # a batch: also a bar of programs done
        results = prog.run_batch(engine, inputs, on_programs=bars.programs)
    result                              # every branch's text and variables, select scores, the executed tree
    votes(result, "reasoning", extract=r"answer is (\\d+)")     # which answer won, and which branches gave it

Each view is an HTML string from :mod:`treegen.display.html` and a plain-text one from
:mod:`treegen.display.text`; both are bounded by :class:`Limits` however large the tree (summarising
past the limits), self-contained (inline styles and SVG, nothing fetched), and never run the model.
The classes' ``_repr_html_``/``__repr__`` hooks (``_repr_pretty_`` for a State) render through
:mod:`treegen.lang.views`, where importing this package registers :func:`program_html`,
:func:`compiled_html`, :func:`result_html` and their ``*_text`` twins (lang never imports display;
``import treegen`` imports display, so the views are always there).
"""

from __future__ import annotations

from treegen.display._view import Limits
from treegen.display.html import compiled_html, program_html, result_html, tally_html, tree_html, votes_html
from treegen.display.progress import TreeProgress, progress
from treegen.display.show import Rendered, page, show, votes
from treegen.display.text import compiled_text, program_text, result_text, tally_text, tree_text
from treegen.lang import views as lang_views


def register_views() -> None:
    """Make these the views of lang's classes (their notebook and terminal reprs); done on import."""
    lang_views.register_view("program", program_html, program_text)
    lang_views.register_view("compiled", compiled_html, compiled_text)
    lang_views.register_view("result", result_html, result_text)


register_views()


def load_ipython_extension(ipython) -> None:
    """``%load_ext treegen.display``: the ``%%treegen`` cell magic and HTML views in this kernel."""
    from treegen.display.magic import register

    register(ipython)


__all__ = ["Limits", "Rendered", "TreeProgress", "compiled_html", "compiled_text", "load_ipython_extension", "page",
           "program_html", "program_text", "progress", "register_views", "result_html", "result_text", "show",
           "tally_html", "tally_text", "tree_html", "tree_text", "votes", "votes_html"]
