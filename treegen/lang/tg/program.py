"""A loaded ``.tg`` program: bind its parameters, compile its tree, run it, save the results.

    prog = treegen.lang.tg.load("examples/self_consistency.tg")
    prog.compile(tokenizer=tok, n=8).tree           # the sharing tree, no model
    result = prog.run(engine, seed=0, n=8)
    result["answer"], result.to_json()
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Iterable, Mapping

from treegen.lang.arrivals import arriving
from treegen.lang.batch import DEFAULT_MAX_PROGRAM_TOKENS
from treegen.lang.dsl import CompiledProgram, Program
from treegen.lang.tg import ast
from treegen.lang.tg.check import ParamSpec, check
from treegen.lang.tg.errors import Pos, TgError
from treegen.lang.tg.lower import Branch, Lowering
from treegen.lang.tg.parser import parse, parse_file


class TgProgram:
    """A parsed and checked ``.tg`` file."""

    def __init__(self, file: ast.TgFile) -> None:
        self.file = file
        # (structure and types; parameter values are checked where they are known: check_values, lowering)
        self.params: dict[str, ParamSpec] = check(file, defaults=False)

    @property
    def path(self) -> str:
        return self.file.source.path

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]

    # parameters -----------------------------------------------------------------------------------
    def _where(self) -> Pos:
        return self.file.params[0].pos if self.file.params else Pos(self.file.source, 1, 1)

    def _known_names(self, values: Mapping[str, Any]) -> None:
        unknown = sorted(set(values) - set(self.params))
        if unknown:
            takes = ", ".join(self.params) if self.params else "no parameters"
            raise TgError(f"unknown parameter {unknown[0]!r}; this program takes {takes}", self._where())

    def bind(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter's value: given, else its default. Checks names and types."""
        self._known_names(values)
        out = {}
        for name, spec in self.params.items():
            if name in values:
                out[name] = _checked(spec, values[name])
            elif spec.required:
                raise TgError(f"parameter {name!r} has no default: give it a value (--var {name}=...)", spec.pos)
            else:
                out[name] = spec.default
        return out

    def check_values(self, values: Mapping[str, Any], *, defaults: bool = True) -> None:
        """Check given parameter values (some or all) as the program uses them, without running it:
        names and types as :meth:`bind` checks them, then each value where the program reads it, as
        a literal written there would be (``fork n`` given ``n=0`` is an error at ``n``'s place).
        ``defaults``: the parameters not given are checked by their defaults (False: their values may
        still come, as a batch's lines give them)."""
        self._known_names(values)
        check(self.file, {name: _checked(self.params[name], v) for name, v in values.items()}, defaults=defaults)

    def parse_vars(self, assignments: list[str]) -> dict[str, Any]:
        """``["n=8", "question=..."]`` (command-line ``--var``) -> typed values."""
        out: dict[str, Any] = {}
        for a in assignments:
            name, eq, text = a.partition("=")
            name = name.strip()
            if not eq or not name:
                raise TgError(f"--var {a!r}: write NAME=VALUE", self._where())
            if name not in self.params:
                self.bind({name: None})  # raises the unknown-parameter error
            out[name] = _from_text(self.params[name], text)
        return out

    # running --------------------------------------------------------------------------------------
    def compile(self, *, tokenizer, **values) -> CompiledProgram:
        """The sharing tree built with ``tokenizer`` only (see :meth:`treegen.Program.compile`)."""
        lowering = Lowering(self.file, self.bind(values))
        return Program(_Body(lowering)).compile(tokenizer=tokenizer)

    def run(self, engine, *, seed: int = 0, watch: Callable | None = None,
            max_program_tokens: int | None = DEFAULT_MAX_PROGRAM_TOKENS, **values) -> "TgResult":
        """Run on ``engine``. ``watch(tree)`` is called with the run's sharing tree when it starts.
        ``max_program_tokens``: as in :meth:`treegen.Program.run` (None: no limit)."""
        bound = self.bind(values)
        lowering = Lowering(self.file, bound, watch)
        root = Program(_Body(lowering)).run(engine, seed=seed, max_program_tokens=max_program_tokens)
        assert lowering.root is not None and lowering.root.state is root
        return TgResult(self, lowering.root, lowering.values, seed, engine.tokenizer)


    def run_batch(self, engine, inputs: Iterable[Mapping[str, Any]], *, seed: int = 0, watch: Callable | None = None,
                  on_result: Callable[[int, "TgResult"], None] | None = None,
                  describe: Callable[[int], str] = str, **options) -> list["TgResult"]:
        """Run once per entry of ``inputs`` (parameter values) as one workload; returns the results in
        input order. A list of inputs has its parameters checked for every input before anything runs;
        an iterator is drawn as the run goes (:mod:`treegen.lang.arrivals`: a program starts when its
        input arrives and the engine has room), and an input whose values do not bind fails its
        program alone (so does an input that is an exception: what reading it raised).

        ``on_result(index, result)``: each program's :class:`TgResult` as soon as that program is done
        (in finish order; a failed one has ``result.error``). ``describe(i)``: how errors name input
        ``i`` (the command line: its index and ``inputs.jsonl:LINE``). ``options``: ``seeds``,
        ``share_prefixes``, ``min_shared_saving``, ``on_programs``, ``on_tokens``,
        ``max_program_tokens``, as in :meth:`treegen.Program.run_batch`. Faults as there: a failed
        program raises :class:`~treegen.lang.batch.ProgramError` once the others are done, Ctrl-C
        :class:`~treegen.lang.batch.BatchInterrupted`; their ``results`` are :class:`TgResult` here
        (None for the programs an interrupt left unfinished)."""
        from treegen.lang.batch import BatchInterrupted, ProgramError
        from treegen.lang.dsl import run_batch

        if on_result is not None and not callable(on_result):
            raise TypeError(f"run_batch: on_result must be a function (index, result), got {type(on_result).__name__}")
        lowerings: list = []  # per input, in input order (an arriving input's when the driver takes it)

        def arrived(values) -> "_Body":  # (drawn in input order: lowerings[i] is input i's)
            if isinstance(values, Exception):  # what reading this input raised (a line that is not JSON)
                lowering: Any = _Unbound({}, values)
            elif not isinstance(values, Mapping):
                lowering = _Unbound(values, TypeError(f"run_batch: each input must be a mapping of parameter "
                                                           f"values, got {type(values).__name__}"))
            else:
                try:
                    lowering = Lowering(self.file, self.bind(values), watch)
                except TgError as e:  # it fails alone; the others run
                    lowering = _Unbound(values, e)
            lowerings.append(lowering)
            return _Body(lowering)

        if arriving(inputs):
            bodies: Any = (arrived(values) for values in inputs)
        else:
            bound = [self.bind(values) for values in inputs]
            bodies = [_Body(lw) for lw in (Lowering(self.file, b, watch) for b in bound)]
            lowerings = [b.lowering for b in bodies]
        def result(i: int, root) -> "TgResult":
            lw = lowerings[i]
            branch = lw.root if lw.root is not None and lw.root.state is root else Branch(root)  # failed before it began
            return TgResult(self, branch, lw.values, root.seed, engine.tokenizer)

        hook = None if on_result is None else lambda i, root: on_result(i, result(i, root))
        try:
            roots = run_batch(engine, bodies, seed=seed, on_result=hook, describe=describe, **options)
        except (ProgramError, BatchInterrupted) as e:
            e.results = [None if root is None else result(i, root) for i, root in enumerate(e.results)]
            raise
        return [result(i, root) for i, root in enumerate(roots)]


class _Unbound:
    """In place of the lowering of an input that arrived as the run goes and does not bind: running it
    raises why (its program fails alone); ``values``: what was given."""

    def __init__(self, values, error: Exception) -> None:
        self.values = dict(values) if isinstance(values, Mapping) else {}
        self.error, self.root = error, None

    def __call__(self, state) -> None:
        raise self.error


class _Body:
    """A lowering as a program body. It pickles (a data-parallel engine started from this process runs
    it in a replica process), and what it recorded there — its branches — comes back
    (:meth:`adopt_remote`, called with the copy that ran)."""

    def __init__(self, lowering: Lowering) -> None:
        self.lowering = lowering

    def __call__(self, s) -> None:
        self.lowering(s)

    def adopt_remote(self, shipped: "_Body") -> None:
        self.lowering.root, self.lowering.values = shipped.lowering.root, shipped.lowering.values




_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "list": "a list of strings or numbers"}


def _checked(spec: ParamSpec, value):
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "list": isinstance(value, (list, tuple)) and all(isinstance(x, (str, int, float)) and not isinstance(x, bool)
                                                         for x in value),
    }[spec.type]
    if not ok:
        raise TgError(f"wrong type: parameter {spec.name!r} is {_WORDS[spec.type]}, got {value!r:.80}", spec.pos)
    return float(value) if spec.type == "float" else list(value) if spec.type == "list" else value


def _from_text(spec: ParamSpec, text: str):
    try:
        if spec.type == "int":
            return int(text.strip())
        if spec.type == "float":
            return float(text.strip())
        if spec.type == "list":
            value = json.loads(text)
            if not isinstance(value, list):
                raise ValueError(text)  # (valid JSON, not a list: named as written, below)
            return _checked(spec, value)
    except (ValueError, json.JSONDecodeError):
        hint = f' as JSON, e.g. --var {spec.name}=\'["a", "b"]\'' if spec.type == "list" else ""
        raise TgError(f"wrong type: parameter {spec.name!r} is {_WORDS[spec.type]}{hint}, got {text!r:.80}",
                      spec.pos) from None
    return text


class TgResult:
    """A finished run: the root branch (with every fork and branch below), values and texts."""

    def __init__(self, program: TgProgram, root: Branch, values: dict, seed: int, tokenizer) -> None:
        self.program, self.root, self.values, self.seed, self.tokenizer = program, root, values, seed, tokenizer

    @property
    def state(self):
        return self.root.state

    @property
    def error(self) -> BaseException | None:
        """Why the program failed (a batch run; see :meth:`TgProgram.run_batch`), else None."""
        return getattr(self.root.state, "error", None)

    def __getitem__(self, name: str):
        return self.root.state[name]

    def variables(self, branch: Branch) -> dict:
        """The branch's own variables (not the parameters or what it inherited), resolved."""
        own = branch.own_variables()
        if branch is self.root:
            own = {k: v for k, v in own.items() if k not in self.values or v is not self.values[k]}
        return {k: branch.state[k] for k in own}

    def text(self, branch: Branch) -> str:
        """The text the branch added after it was forked (the whole text for the root)."""
        return self.tokenizer.decode(branch.state.tokens()[branch.start:])

    def to_json(self) -> dict:
        """The executed tree: parameters, then per branch its text, variables and details, forks below."""
        return _clean({"program": self.program.path, "seed": self.seed, "parameters": self.values,
                       **self._branch_json(self.root)})

    def _branch_json(self, b: Branch) -> dict:
        out = {} if b is self.root else {"index": b.index, "bindings": b.bindings}
        out |= {"text": self.text(b), "variables": self.variables(b),
                "info": {k: v for k, v in b.state.info.items() if k in b.own_variables()}}
        if b is not self.root:
            out["full_text"] = b.state.text()
        out["forks"] = [{"fork": run.label, "file": run.fork.pos.source.path, "line": run.fork.pos.line,
                         "joined": run.fork.join is not None, "branches": [self._branch_json(c) for c in run.branches]}
                        for run in b.forks]
        return out


def _clean(x):
    """JSON-safe: tuples as lists, non-finite floats as null."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def load(path: str | os.PathLike) -> TgProgram:
    """Parse, resolve includes and check a ``.tg`` file. Raises :class:`TgError`."""
    return TgProgram(parse_file(path))


def loads(text: str, path: str = "<string>") -> TgProgram:
    """Like :func:`load`, from text (``include`` paths relative to ``path``'s folder, or the cwd)."""
    return TgProgram(parse(text, path))
