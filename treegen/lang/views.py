"""How programs, compiled trees and results look in notebooks and terminals, filled in from above.

Layering: :mod:`treegen.lang` never imports the display layer (display imports lang). So the classes'
hooks (``Program.__repr__``/``_repr_html_``, ``CompiledProgram``'s, ``State._repr_html_``/
``_repr_pretty_``) look their rendering up here by kind, and the display package calls
:func:`register_view` for each kind when it is imported (``import treegen`` imports it).

Kinds: ``"program"`` (a :class:`~treegen.lang.dsl.Program`), ``"compiled"`` (a
:class:`~treegen.lang.dsl.CompiledProgram`), ``"result"`` (a finished
:class:`~treegen.lang.state.State`). With no view registered, :func:`html` and :func:`text`
return None: notebooks then show the plain text, and the classes fall back to a short repr of their own.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

KINDS = ("program", "compiled", "result")


class View(NamedTuple):
    """One kind's renderings: ``html(obj) -> str`` and ``text(obj) -> str``."""

    html: Callable[[Any], str]
    text: Callable[[Any], str]


_views: dict[str, View] = {}


def register_view(kind: str, html_fn: Callable[[Any], str], text_fn: Callable[[Any], str]) -> None:
    """Render objects of ``kind`` (one of :data:`KINDS`) with ``html_fn`` and ``text_fn`` from now on
    (replacing what was registered for it)."""
    if kind not in KINDS:
        raise ValueError(f"register_view: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if not (callable(html_fn) and callable(text_fn)):
        raise TypeError("register_view: html_fn and text_fn must be callables taking the object")
    _views[kind] = View(html_fn, text_fn)


def unregister_view(kind: str) -> View | None:
    """Forget ``kind``'s view (the classes fall back to their plain reprs); returns what was registered."""
    return _views.pop(kind, None)


def lookup(kind: str) -> View | None:
    """The view registered for ``kind``, or None."""
    return _views.get(kind)


def html(kind: str, obj) -> str | None:
    """``obj`` as HTML by ``kind``'s view; None when no view is registered."""
    view = _views.get(kind)
    return None if view is None else view.html(obj)


def text(kind: str, obj) -> str | None:
    """``obj`` as plain text by ``kind``'s view; None when no view is registered."""
    view = _views.get(kind)
    return None if view is None else view.text(obj)
