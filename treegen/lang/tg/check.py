"""Static checks of a ``.tg`` program: scopes, types and ranges, before any model is involved.

Every variable has a type: a base (``str``, ``int``, ``float``) and a list depth. ``gen`` and
``select`` set ``str`` values in the current branch; a fork's ``join`` brings every variable its
branches set back as a list (depth + 1); reductions turn lists back into values. Text may only read
single values (depth 0). Where a parameter is read, its known value (the default, or the value given:
``check(file, values)``, as ``treegen check --var``) is checked like a literal there; values only
known at run time are checked again when they are bound or used (:mod:`treegen.lang.tg.lower`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from treegen.lang.ir import REDUCTIONS as IR_REDUCTIONS
from treegen.lang.ir import check_extract
from treegen.lang.tg import ast
from treegen.lang.tg.errors import Pos, TgError
from treegen.runtime.constraint import Constraint
from treegen.runtime.sampler import SamplingParams

MAX_BRANCHES = 4096
PARAM_TYPES = ("str", "int", "float", "list")
GEN_ARGS = {"max_tokens": "int", "temperature": "number", "top_p": "number", "top_k": "int", "stop": "text",
            "seed": "int", "regex": "str", "choices": "list", "json_schema": "str", "grammar": "str",
            "kv_keep": "number"}
CONSTRAINTS = ("regex", "choices", "json_schema", "grammar")  # at most one per gen
# reduction -> (argument names in order, required ones)
REDUCTIONS = {"collect": (("values",), ("values",)), "vote": (("values", "extract"), ("values",)),
              "best": (("values", "by"), ("values", "by")), "top_k": (("values", "by", "k"), ("values", "by", "k"))}


@dataclass(frozen=True)
class Type:
    base: str  # "str" | "int" | "float"
    depth: int = 0

    def __str__(self) -> str:
        return "list of " * self.depth + ("string" if self.base == "str" else self.base)


@dataclass(frozen=True)
class ParamSpec:
    """A declared parameter: its type name (one of PARAM_TYPES), default (None = required)."""

    name: str
    type: str
    default: object
    pos: Pos

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass
class _Scope:
    vars: dict[str, Type]
    assigned: set[str] = field(default_factory=set)  # set in this branch since its fork
    unjoined: dict[str, Pos] = field(default_factory=dict)  # set in a fork that has no join
    defaults: dict[str, object] = field(default_factory=dict)  # parameters not set since: their known values
    given: frozenset = frozenset()  # those of them given (not defaults)

    def set(self, name: str, t: Type) -> None:
        self.vars[name] = t
        self.assigned.add(name)
        self.unjoined.pop(name, None)
        self.defaults.pop(name, None)

    def child(self) -> "_Scope":
        return _Scope(dict(self.vars), set(), dict(self.unjoined), dict(self.defaults), self.given)

    def known(self, v: ast.Value):
        """``(value, how it reads in a message)`` of a parameter read by ``v`` whose value is known
        before running (its default, or the value given), else None."""
        if not isinstance(v, ast.Var) or v.name not in self.defaults:
            return None
        value = self.defaults[v.name]
        how = "is given as" if v.name in self.given else "defaults to"
        return value, f"parameter {v.name!r} {how} {value!r:.80}"


def literal_value(v: ast.Value, what: str):
    """The Python value of a literal (a list literal holds strings and numbers)."""
    if isinstance(v, ast.Lit):
        return v.value
    if isinstance(v, ast.ListLit):
        for item in v.items:
            if not isinstance(item, ast.Lit):
                raise TgError(f"{what}: list items must be written as strings or numbers", item.pos)
        return [item.value for item in v.items]
    raise TgError(f"{what} must be written literally, not read from a variable", v.pos)


def _lit_type(value) -> Type:
    if isinstance(value, list):
        bases = {_lit_type(x).base for x in value}
        return Type(bases.pop() if len(bases) == 1 else "str", 1)
    return Type("str" if isinstance(value, str) else "int" if isinstance(value, int) else "float")


def param_specs(file: ast.TgFile) -> dict[str, ParamSpec]:
    """Check the parameter declarations; their types and defaults by name."""
    specs: dict[str, ParamSpec] = {}
    started = False
    for st in file.body:
        if not isinstance(st, ast.Param):
            started = True
        elif started:
            raise TgError("parameters are declared at the top of the file, before other statements", st.pos)
    for p in file.params:
        if p.name in specs:
            raise TgError(f"parameter {p.name!r} is declared twice (first at line {specs[p.name].pos.line})", p.pos)
        if p.type is not None and p.type not in PARAM_TYPES:
            raise TgError(f"unknown type {p.type!r}; a parameter is one of {', '.join(PARAM_TYPES)}",
                          p.type_pos or p.pos)
        default = literal_value(p.default, f"the default of {p.name!r}") if p.default is not None else None
        have = None if default is None else "list" if isinstance(default, list) else _lit_type(default).base
        declared = p.type or have or "str"
        if have is not None and have != declared and not (declared == "float" and have == "int"):
            raise TgError(f"wrong type: the default of {p.name!r} is a {_TYPE_WORDS[have]}, "
                          f"but it is declared {declared}", p.default.pos)
        if declared == "float" and isinstance(default, int):
            default = float(default)
        specs[p.name] = ParamSpec(p.name, declared, default, p.pos)
    return specs


_TYPE_WORDS = {"str": "string", "int": "integer", "float": "number", "list": "list"}


def param_type(spec: ParamSpec) -> Type:
    if spec.type == "list":
        return _lit_type(spec.default) if spec.default else Type("str", 1)
    return Type(spec.type)


def check(file: ast.TgFile, values: dict | None = None, *, defaults: bool = True) -> dict[str, ParamSpec]:
    """Raise :class:`TgError` for the first mistake; return the parameter specs. ``values``: parameter
    values given (bound: names and types already checked, see ``TgProgram.bind``), checked where they
    are used in their defaults' place (a count of 0 given for ``fork n`` is an error at ``n``).
    ``defaults``: check the defaults of parameters not given too, as they would be used; False where
    values may still come (loading a file; a batch whose lines give values): a default is checked only
    where it is the value used."""
    specs = param_specs(file)
    values = values or {}
    known = {name: s.default for name, s in specs.items() if not s.required and defaults} | \
        {name: v for name, v in values.items() if name in specs}
    scope = _Scope({name: param_type(s) for name, s in specs.items()}, defaults=known,
                   given=frozenset(values))
    _block([st for st in file.body if not isinstance(st, ast.Param)], scope)
    return specs


def _block(body, scope: _Scope) -> None:
    for st in body:
        _statement(st, scope)


def _statement(st, scope: _Scope) -> None:
    if isinstance(st, ast.Param):
        raise TgError("param is only allowed at the top of the main file", st.pos)
    if isinstance(st, ast.Text):
        for part in st.parts:
            if isinstance(part, ast.Var):
                t = _read(part, scope)
                if t.depth:
                    raise TgError(f"wrong type: {{{part.name}}} is a {t} (one value per branch) and text needs one "
                                  "value; reduce it in the join (vote, best, ...) or fork over it", part.pos)
    elif isinstance(st, ast.Message):
        for inner in st.body:
            if not isinstance(inner, (ast.Text, ast.Gen, ast.Select)):
                raise TgError(f"only text, gen and select can appear inside a {st.role} message", inner.pos)
            _statement(inner, scope)
    elif isinstance(st, ast.Gen):
        _gen(st, scope)
        scope.set(st.name, Type("str"))
    elif isinstance(st, ast.Select):
        _select(st, scope)
        scope.set(st.name, Type("str"))
    elif isinstance(st, ast.Fork):
        _fork(st, scope)
    elif isinstance(st, ast.Include):
        _block(st.body or (), scope)
    else:  # a join the parser could not attach cannot reach here
        raise TgError(f"unexpected {type(st).__name__.lower()}", st.pos)


def _read(var: ast.Var, scope: _Scope) -> Type:
    if var.name in scope.vars:
        return scope.vars[var.name]
    if var.name in scope.unjoined:
        raise TgError(f"undefined variable {var.name!r}: it is set inside the fork at line "
                      f"{scope.unjoined[var.name].line}, which has no join (add 'join' after that fork's closing '}}')",
                      var.pos)
    close = difflib.get_close_matches(var.name, sorted(scope.vars), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TgError(f"undefined variable {var.name!r}{hint}", var.pos)


def _value_type(v: ast.Value, scope: _Scope, what: str) -> Type:
    if isinstance(v, ast.Var):
        return _read(v, scope)
    return _lit_type(literal_value(v, what))


def _expect_int(v: ast.Value, scope: _Scope, what: str, low: int, high: int | None = None) -> None:
    t = _value_type(v, scope, what)
    if t != Type("int"):
        shown = f"got {v.value!r}" if isinstance(v, ast.Lit) else f"but {v.name!r} is a {t}" \
            if isinstance(v, ast.Var) else "got a list"
        raise TgError(f"wrong type: {what} must be an integer, {shown}", v.pos)
    known = scope.known(v)
    value = v.value if isinstance(v, ast.Lit) else known[0] if known else None
    if isinstance(value, int) and not (low <= value and (high is None or value <= high)):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        got = f"got {value}" if isinstance(v, ast.Lit) else f"but {known[1]}"
        raise TgError(f"{what} must be an integer {bound}, {got}", v.pos)


def _gen(st: ast.Gen, scope: _Scope) -> None:
    seen: set[str] = set()
    for kw in st.args:
        if kw.name not in GEN_ARGS:
            close = difflib.get_close_matches(kw.name, list(GEN_ARGS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TgError(f"unknown parameter {kw.name!r} for gen ({hint}gen takes {', '.join(GEN_ARGS)})", kw.pos)
        if kw.name in seen:
            raise TgError(f"gen {st.name}: {kw.name} is given twice", kw.pos)
        if kw.name in CONSTRAINTS and seen & set(CONSTRAINTS):
            other = next(c for c in CONSTRAINTS if c in seen)
            raise TgError(f"gen {st.name}: a gen takes at most one constraint, got {other} and {kw.name}", kw.pos)
        if kw.name in CONSTRAINTS and seen & {"stop"} or kw.name == "stop" and seen & set(CONSTRAINTS):
            raise TgError(f"gen {st.name}: a constrained gen ends where its constraint is complete, "
                          "it takes no stop strings", kw.pos)
        seen.add(kw.name)
        want = GEN_ARGS[kw.name]
        if isinstance(kw.value, ast.Var):
            t = _read(kw.value, scope)
            ok = {"int": t == Type("int"), "number": t in (Type("int"), Type("float")), "str": t == Type("str"),
                  "list": t == Type("str", 1), "text": t == Type("str") or (t.depth == 1 and t.base == "str")}[want]
            if not ok:
                needs = {"text": "text", "str": "a string", "list": "a list of strings"}.get(want, "a " + want)
                raise TgError(f"wrong type: {kw.name} needs {needs}, but {kw.value.name!r} is a {t}", kw.value.pos)
            known = scope.known(kw.value)  # a parameter's default or given value: checked as if written here
            if known is None:
                continue
            value, why = known[0], f" ({known[1]})"
        else:
            value, why = literal_value(kw.value, f"gen {kw.name}"), ""
        try:
            if kw.name in CONSTRAINTS:  # parsed now: a bad regex, schema or grammar is an error at its place
                Constraint.of(**{kw.name: value})
            else:
                SamplingParams(**{kw.name: value})
        except (ValueError, TypeError) as e:
            raise TgError(f"gen {st.name}: {e}{why}", kw.value.pos) from None


def _select(st: ast.Select, scope: _Scope) -> None:
    if isinstance(st.choices, ast.Var):
        t = _read(st.choices, scope)
        if t.depth != 1:
            raise TgError(f"wrong type: select needs a list of choices, but {st.choices.name!r} is a {t}",
                          st.choices.pos)
        known = scope.known(st.choices)
        if known is not None:
            choices, why = known
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise TgError(f"select needs a non-empty list of non-empty strings, but {why}", st.choices.pos)
        return
    choices = literal_value(st.choices, "select choices")
    if not isinstance(choices, list) or not choices:
        raise TgError('select needs a non-empty list of choices, e.g. from ["yes", "no"]', st.choices.pos)
    for item, value in zip(st.choices.items, choices):
        if not isinstance(value, str) or not value:
            raise TgError(f"each choice must be a non-empty string, got {value!r}", item.pos)


def _fork(st: ast.Fork, scope: _Scope) -> None:
    child = scope.child()
    if st.kind in ("count", "range"):
        _expect_int(st.source, scope, "the number of branches", 1, MAX_BRANCHES)
        if st.var:
            child.set(st.var, Type("int"))
    else:
        if isinstance(st.source, ast.Var):
            t = _read(st.source, scope)
            if not t.depth:
                raise TgError(f"wrong type: fork {st.var} in ... needs a list, but {st.source.name!r} is a {t}",
                              st.source.pos)
            elem = Type(t.base, t.depth - 1)
            known = scope.known(st.source)
            if known is not None and not 1 <= len(known[0]) <= MAX_BRANCHES:
                raise TgError(f"fork {st.var} in ... needs a list of 1 to {MAX_BRANCHES} items, but {known[1]}",
                              st.source.pos)
        else:
            items = literal_value(st.source, "fork over a list")
            if not isinstance(items, list) or not items:
                raise TgError("fork NAME in [...] needs a non-empty list", st.source.pos)
            if len(items) > MAX_BRANCHES:
                raise TgError(f"a fork has at most {MAX_BRANCHES} branches, this list has {len(items)}", st.source.pos)
            elem = Type(_lit_type(items).base)
        child.set(st.var, elem)
    _block(st.body, child)
    if st.join is None:
        for name in sorted(child.assigned):
            if name not in scope.vars:
                scope.unjoined.setdefault(name, st.pos)
        return
    for name in sorted(child.assigned):
        t = child.vars[name]
        scope.set(name, Type(t.base, t.depth + 1))
    targets: set[str] = set()
    for red in st.join.reductions:
        if red.target in child.assigned:
            raise TgError(f"{red.target!r} is set by the fork's branches (its joined list has that name); "
                          "give the reduction a new name", red.pos)
        if red.target in targets:
            raise TgError(f"{red.target!r} is set twice in this join", red.pos)
        targets.add(red.target)
        scope.set(red.target, _reduction(red, scope, child.assigned))


def _reduction(red: ast.Reduction, scope: _Scope, joined: set[str]) -> Type:
    """The type of ``red``; ``joined``: the variables the fork's branches set (what it may reduce)."""
    if red.fn in IR_REDUCTIONS and red.fn not in REDUCTIONS:  # (concat)
        raise TgError(f"{red.fn} is a reduction of the Python DSL only (treegen.{red.fn}); a join in .tg can use "
                      f"{', '.join(REDUCTIONS)}", red.pos)
    if red.fn not in REDUCTIONS:
        close = difflib.get_close_matches(red.fn, list(REDUCTIONS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TgError(f"unknown reduction {red.fn!r}{hint}; a join can use {', '.join(REDUCTIONS)}", red.pos)
    names, required = REDUCTIONS[red.fn]
    sig = f"{red.fn}({', '.join(names)})"
    if len(red.args) > len(names):
        raise TgError(f"too many arguments: {sig}", red.args[len(names)].pos)
    args: dict[str, ast.Value] = dict(zip(names, red.args))
    for kw in red.kwargs:
        if kw.name not in names:
            raise TgError(f"unknown argument {kw.name!r} for {sig}", kw.pos)
        if kw.name in args:
            raise TgError(f"{kw.name} is given twice", kw.pos)
        args[kw.name] = kw.value
    for name in required:
        if name not in args:
            raise TgError(f"{red.fn} needs {name}: {sig}", red.pos)
    lists = {}
    for name in ("values", "by"):
        if name in args:
            v = args[name]
            if not isinstance(v, ast.Var):
                raise TgError(f"{red.fn}: {name} must be a variable with one value per branch", v.pos)
            lists[name] = _read(v, scope)
            if not lists[name].depth:
                raise TgError(f"wrong type: {red.fn} needs a list (one value per branch), but {v.name!r} is a "
                              f"{lists[name]}", v.pos)
            if v.name not in joined:
                raise TgError(f"{red.fn}: {name} must be a variable the fork's branches set (one value per branch); "
                              f"{v.name!r} is not set inside this fork", v.pos)
            if name == "by" and v.name == "logprob":
                raise TgError(f"{red.fn}: by cannot read a variable named 'logprob' (in a reduction that name means "
                              "a gen's mean token log-probability); rename the variable", v.pos)
    values = lists["values"]
    if red.fn == "vote":
        if values.depth != 1:
            raise TgError(f"wrong type: vote needs a list of single values, but {args['values'].name!r} is a {values}",
                          args["values"].pos)
        if "extract" in args:
            pattern = literal_value(args["extract"], "vote: extract")
            if not isinstance(pattern, str):
                raise TgError('vote: extract must be a regular expression in a string, e.g. extract="answer is (\\d+)"',
                              args["extract"].pos)
            try:
                check_extract(pattern)
            except ValueError as e:
                raise TgError(str(e), args["extract"].pos) from None
        return Type("str")
    if red.fn == "top_k":
        _expect_int(args["k"], scope, "top_k: k", 1)
        return values
    if red.fn == "best":
        return Type(values.base, values.depth - 1)
    return values  # collect
