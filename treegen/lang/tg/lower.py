"""Lower a checked ``.tg`` AST onto the IR: walk it and drive the Python DSL's :class:`State` API.

This is the same path a Python program takes: text and chat roles are appended as ``Text`` /
``RoleBegin`` / ``RoleEnd`` ops, ``gen`` / ``select`` as ``Gen`` / ``Select`` ops (built by
:func:`treegen.gen` / :func:`treegen.select`, so they are validated the same way), forks and joins
through ``State.fork`` / ``State.join``. So both front ends build the same sharing tree.

Statements run on a *set* of branches at once (the root, or every branch of the enclosing forks),
one statement at a time across all of them, which is what ``ForkGroup += ...`` does in Python: every
branch queues its ``gen`` before anything runs, and they run batched. Join reductions become IR
:class:`~treegen.lang.ir.Reduce` nodes (built by :func:`treegen.vote` etc., positioned at the
reduction for errors) given to ``State.join``: recorded on the tree, computed when first read, so a
program whose shape does not depend on them compiles completely without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from treegen.lang.dsl import best as make_best
from treegen.lang.dsl import collect as make_collect
from treegen.lang.dsl import gen as make_gen
from treegen.lang.dsl import select as make_select
from treegen.lang.dsl import top_k as make_top_k
from treegen.lang.dsl import vote as make_vote
from treegen.lang.state import State, StopTrace
from treegen.lang.ir import Reduce, RoleBegin, RoleEnd
from treegen.lang.tg import ast
from treegen.lang.tg.check import MAX_BRANCHES, REDUCTIONS, literal_value
from treegen.lang.tg.errors import TgError


@dataclass
class Branch:
    """One state of a run and the forks made from it, for showing and saving results.

    ``start``: tokens of the state's text before the branch began (its own text follows);
    ``inherited``: the parent's variables when it forked (the branch's own are the others).
    """

    state: State
    index: int | None = None
    bindings: dict = field(default_factory=dict)
    start: int = 0
    inherited: dict = field(default_factory=dict)
    forks: list["ForkRun"] = field(default_factory=list)

    def own_variables(self) -> dict:
        return {k: v for k, v in self.state.vars.items() if k not in self.inherited or v is not self.inherited[k]}


@dataclass
class ForkRun:
    fork: ast.Fork
    branches: list[Branch] = field(default_factory=list)

    @property
    def label(self) -> str:
        f = self.fork
        src = f.source.name if isinstance(f.source, ast.Var) else "[...]" if isinstance(f.source, ast.ListLit) \
            else str(f.source.value)
        head = {"count": f"fork {src}", "range": f"fork {f.var} in range({src})",
                "each": f"fork {f.var} in {src}"}[f.kind]
        return f"{head} ({len(self.branches)} branches, line {f.pos.line})" + ("" if f.join else ", not joined")


class Lowering:
    """Callable on a root :class:`State`: appends the program to it. ``root`` records the branches."""

    def __init__(self, file: ast.TgFile, values: dict[str, Any], watch: Callable | None = None) -> None:
        self.file, self.values, self.watch = file, values, watch
        self.root: Branch | None = None

    def __getstate__(self) -> dict:
        """Sent to another process (a data-parallel replica, and back) without ``watch``, which stays
        here, and without the branches of a trace (:func:`~treegen.lang.data_parallel.partition` traces
        the program here before a replica runs it)."""
        traced = self.root is not None and self.root.state._run.tracing
        return dict(self.__dict__, watch=None, root=None if traced else self.root)

    def __call__(self, state: State) -> None:
        if self.watch is not None:
            self.watch(state.tree)
        state.vars.update(self.values)
        self.root = Branch(state)
        self._block([st for st in self.file.body if not isinstance(st, ast.Param)], [self.root])

    # statements -----------------------------------------------------------------------------------
    def _block(self, body, branches: list[Branch]) -> None:
        for st in body:
            try:
                self._statement(st, branches)
            except StopTrace as stop:  # say where the trace stopped (once, at the innermost statement)
                if getattr(stop, "located", False):
                    raise
                located = StopTrace(f"{st.pos}: {stop}")
                located.located = True
                raise located from None

    def _statement(self, st, branches: list[Branch]) -> None:
        if isinstance(st, ast.Text):
            for b in branches:
                b.state += "".join(p if isinstance(p, str) else _text(self._value(p, b)) for p in st.parts)
        elif isinstance(st, ast.Message):
            for b in branches:
                b.state += RoleBegin(st.role)
            self._block(st.body, branches)
            for b in branches:
                b.state += RoleEnd(st.role)
        elif isinstance(st, ast.Gen):
            for b in branches:
                b.state += self._gen_op(st, b)
        elif isinstance(st, ast.Select):
            for b in branches:
                try:
                    op = make_select(st.name, self._value(st.choices, b))
                except ValueError as e:
                    raise TgError(str(e), st.choices.pos) from None
                b.state += op
        elif isinstance(st, ast.Fork):
            self._fork(st, branches)
        elif isinstance(st, ast.Include):
            self._block(st.body or (), branches)

    def _value(self, v: ast.Value, b: Branch):
        if isinstance(v, ast.Var):
            return b.state[v.name]
        return literal_value(v, "a value")

    def _gen_op(self, st: ast.Gen, b: Branch):
        kwargs = {kw.name: self._value(kw.value, b) for kw in st.args}
        try:
            return make_gen(st.name, **kwargs)
        except (ValueError, TypeError) as e:
            where = next((kw.value.pos for kw in st.args if kw.name in str(e)), st.pos)
            raise TgError(str(e), where) from None

    def _fork(self, st: ast.Fork, branches: list[Branch]) -> None:
        groups, children = [], []
        for b in branches:
            items = self._items(st, b)
            inherited = dict(b.state.vars)
            group = b.state.fork(len(items))
            run = ForkRun(st)
            tree = b.state.tree
            for i, child in enumerate(group):
                bindings = {st.var: items[i]} if st.var else {}
                child.vars.update(bindings)
                start = tree.path_length(tree.parent(child.node))
                run.branches.append(Branch(child, i, bindings, start, inherited))
            b.forks.append(run)
            groups.append(group)
            children += run.branches
        self._block(st.body, children)
        if st.join is None:
            return
        for b, group in zip(branches, groups):
            b.state.join(group, **{red.target: self._reduction(red, b) for red in st.join.reductions})

    def _items(self, st: ast.Fork, b: Branch) -> list:
        """One item per branch: the loop variable's values (the index for counts)."""
        value = self._value(st.source, b)
        if st.kind == "each":
            if not isinstance(value, list) or not value or len(value) > MAX_BRANCHES:
                got = f"{len(value)} items" if isinstance(value, list) else repr(value)
                raise TgError(f"fork {st.var} in ... needs a list of 1 to {MAX_BRANCHES} items, got {got}",
                              st.source.pos)
            return value
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BRANCHES:
            raise TgError(f"the number of branches must be an integer from 1 to {MAX_BRANCHES}, got {value!r}",
                          st.source.pos)
        return list(range(value))

    # reductions -----------------------------------------------------------------------------------
    def _reduction(self, red: ast.Reduction, b: Branch) -> Reduce:
        """The IR node of a join reduction (arguments as :mod:`.check` validated them); ``k`` is read now,
        on the state joined into."""
        names = REDUCTIONS[red.fn][0]
        args = dict(zip(names, red.args)) | {kw.name: kw.value for kw in red.kwargs}
        source = args["values"].name
        if red.fn == "collect":
            spec = make_collect(source)
        elif red.fn == "vote":
            spec = make_vote(source, extract=literal_value(args["extract"], "extract") if "extract" in args else None)
        elif red.fn == "best":
            spec = make_best(source, by=args["by"].name)
        else:
            try:
                spec = make_top_k(source, by=args["by"].name, k=self._value(args["k"], b))
            except ValueError as e:
                raise TgError(str(e), args["k"].pos) from None
        return replace(spec, where=red.pos)


def _text(value) -> str:
    """How a value reads in prompt text (a vote with no answer reads as nothing)."""
    return "" if value is None else str(value)


__all__ = ["Branch", "ForkRun", "Lowering"]
