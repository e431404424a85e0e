"""The Python DSL: write a prompt program as a function of a state.

    @treegen.program
    def solve(s, question, n=8):
        s += FEW_SHOT + f"Q: {question}\\nA:"
        branches = s.fork(n)
        branches += treegen.gen("reasoning", max_tokens=256, stop="\\n\\n", temperature=0.7)
        s.join(branches)            # s["reasoning"] is now a list of n strings

    result = solve.run(engine, question="...", seed=0)
    result["reasoning"]

Appending text is immediate (tokens go into the sharing tree); ``gen`` and ``select`` are queued and
run together, batched over every branch of the program, when the program ends or when a value they
produce is read. So when a program's structure does not depend on generated text its whole tree is
known before anything runs (:meth:`Program.compile` builds it without a model), and when it does the
tree grows as the program runs.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

from treegen.lang import views
from treegen.lang.arrivals import arriving
from treegen.lang.batch import DEFAULT_MAX_PROGRAM_TOKENS, ProgramError, FailingBody, check_callback, run_batch_here, seeds_of
from treegen.lang.program_run import ProgramRun
from treegen.lang.state import State, StopTrace, TokenStream
from treegen.lang.ir import Gen, Reduce, RoleBegin, RoleEnd, Select, Seq, as_ops
from treegen.runtime.collector import full_collections_paused
from treegen.runtime.constraint import Constraint
from treegen.runtime.distributed import launched
from treegen.runtime.sampler import SamplingParams
from treegen.tree.passes import DEFAULT_MIN_SHARED_SAVING
from treegen.tree.sharing_tree import KVShape, SharingTree, TreeStats



def gen(name: str, *, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        stop: str | list[str] | tuple[str, ...] = (), seed: int | None = None, ignore_eos: bool = False,
        regex: str | None = None, choices: list[str] | tuple[str, ...] | None = None,
        json_schema: dict | str | None = None, grammar: str | None = None, kv_keep: float | None = None,
        jump_forward: bool | None = None) -> Gen:
    """Generate text into variable ``name``. Greedy unless ``temperature > 0``; see :class:`SamplingParams`.

    A gen that ends on EOS leaves that EOS out of the branch's context (later text follows the gen's
    text); it is still the gen's last token: ``state.gen_tokens(name)``, ``state.info[name]["eos"]``.

    At most one constraint on the text, enforced token by token (:mod:`treegen.runtime.constraint`):
    ``regex`` (the whole text matches it), ``choices`` (the text is one of them), ``json_schema`` (a
    dict or JSON text: the text is JSON valid under it) or ``grammar`` (EBNF, rule ``root``). The gen
    ends where its constraint is complete; one that ``max_tokens`` cuts short ends with
    ``finish_reason="length"`` and ``state.info[name]["constraint_met"] = False``, and one whose constraint
    allows no next token (no text completes it, e.g. ``regex="a[^\\s\\S]"``) with ``"dead_end"`` and False. An invalid regex,
    schema or grammar raises ``ValueError`` here, when the program is written.

    ``kv_keep``: sparse window attention (lossy, opt-in; :mod:`treegen.runtime.swa`) — the branch keeps
    this fraction in (0, 1] of its own KV: its most recent tokens and the earlier ones it attended to
    most; None (the default) is exact attention, or the engine's ``kv_keep``. The result records it
    (``state.info[name]["kv_keep"]``).

    ``jump_forward`` (a constrained gen): the text its constraint forces from the start (``"The answer is "``
    of ``regex="The answer is [0-9]+"``) is written at once and prefilled with the prompt instead of decoded a
    token a step — faster, but tokenized as the tokenizer writes it, not as the model would draw it; those
    tokens' log-probabilities are 0. None (the default): the engine's ``jump_forward`` (off unless set)."""
    _check_name("gen", name)
    try:
        constraint = Constraint.of(regex=regex, choices=choices, json_schema=json_schema, grammar=grammar)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                stop=stop, seed=seed, ignore_eos=ignore_eos, constraint=constraint, kv_keep=kv_keep,
                                jump_forward=jump_forward)
    except ValueError as e:
        raise ValueError(f"gen({name!r}): {e}") from None
    return Gen(name, params)


def select(name: str, choices: list[str] | tuple[str, ...]) -> Select:
    """Append the choice with the highest mean token log-probability and store it in ``name``.

    Every choice becomes a branch of the sharing tree; all are scored in one batched prefill.
    """
    _check_name("select", name)
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select({name!r}): choices must be a non-empty list of non-empty strings, got {choices!r}")
    return Select(name, tuple(choices))


def collect(source: str) -> Reduce:
    """At a join: the branches' ``source`` values as a list, under a new name (what ``s.join``
    already gives ``source`` itself; the ``.tg`` language's ``collect``)."""
    _check_name("collect", source)
    return Reduce("collect", source)


def vote(source: str, *, extract=None) -> Reduce:
    """At a join: the majority answer among the branches' ``source`` values. ``extract``: a regex
    (last match, group 1 if any), a function ``text -> answer``, or None (the whole text)."""
    _check_name("vote", source)
    return Reduce("vote", source, extract=extract)  # (which refuses an extract that is not a valid regex)


def best(source: str, *, by) -> Reduce:
    """At a join: the ``source`` value of the branch with the highest score. ``by``: a variable the
    branches set (numbers or text with a number), ``"logprob"``, or a function of the value."""
    _check_name("best", source)
    _check_by("best", by)
    return Reduce("best", source, by=by)


def top_k(source: str, *, by, k: int) -> Reduce:
    """At a join: the ``k`` best ``source`` values, best first (``by`` as in :func:`best`)."""
    _check_name("top_k", source)
    _check_by("top_k", by)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"top_k({source!r}): k must be an integer >= 1, got {k!r}")
    return Reduce("top_k", source, by=by, k=k)


def concat(source: str, *, sep: str = "\n") -> Reduce:
    """At a join: the branches' ``source`` values joined by ``sep`` (append it to build a new prompt)."""
    _check_name("concat", source)
    if not isinstance(sep, str):
        raise ValueError(f"concat({source!r}): sep must be a string, got {sep!r}")
    return Reduce("concat", source, sep=sep)


def _check_by(what: str, by) -> None:
    if not (callable(by) or (isinstance(by, str) and by.isidentifier())):
        raise ValueError(f"{what}: by must be a variable name, 'logprob' or a function, got {by!r}")


def _check_name(what: str, name) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{what}: the variable name must be an identifier string, got {name!r}")


def _message(role: str, content) -> Seq:
    return Seq((RoleBegin(role), *as_ops(content), RoleEnd(role)))


def system(content) -> Seq:
    """A system message, rendered with the tokenizer's chat template."""
    return _message("system", content)


def user(content) -> Seq:
    """A user message, rendered with the tokenizer's chat template."""
    return _message("user", content)


def assistant(content) -> Seq:
    """An assistant message; ``content`` may be text, ``gen(...)``, or both (``"x" + gen("y")``)."""
    return _message("assistant", content)


class CompiledProgram:
    """A program's sharing tree built without running the model.

    ``complete`` is False when the program reads a generated value (or continues after a ``select``),
    in which case the tree shows the part known before running and grows at run time.
    """

    def __init__(self, tree: SharingTree, complete: bool, stopped_at: str | None, *, tokenizer=None,
                 kv_shape: KVShape | None = None) -> None:
        self.tree, self.complete, self.stopped_at = tree, complete, stopped_at
        self.tokenizer, self.kv_shape = tokenizer, kv_shape

    def stats(self, kv: KVShape | None = None) -> TreeStats:
        """KV totals for ``kv`` (default: the shape given to ``compile``)."""
        kv = kv or self.kv_shape
        if kv is None:
            raise ValueError("stats needs a KVShape: pass one, or compile(..., kv_shape=engine.kv_shape)")
        return self.tree.stats(kv)

    # notebook and terminal views: rendered by the "compiled" view registered in treegen.lang.views
    def _repr_html_(self) -> str | None:
        return views.html("compiled", self)

    def __repr__(self) -> str:
        shown = views.text("compiled", self)
        if shown is not None:
            return shown
        how = "complete" if self.complete else f"partial: {self.stopped_at}"
        return (f"<CompiledProgram ({how}): {self.tree.graph.number_of_nodes():,} nodes, "
                f"{len(self.tree.leaves()):,} branches>")


class Program:
    """A prompt program: a function ``fn(s, *args, **kwargs)`` that appends to the state ``s``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"treegen.program expects a function, got {type(fn).__name__}")
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, engine, /, *args, seed: int = 0, on_tokens: Callable[[TokenStream], None] | None = None,
            max_program_tokens: int | None = DEFAULT_MAX_PROGRAM_TOKENS, **kwargs) -> State:
        """Run on ``engine`` (a :class:`treegen.Engine`) and return the finished root state; what the
        function returned is its ``ret_value``. ``on_tokens`` and ``max_program_tokens``: as in
        :meth:`run_batch`.

        On a data-parallel engine started from this process (``Engine.load(..., data_parallel=N)``) the
        program runs on one replica, as a batch of one (same tokens); it must pickle (see
        :func:`treegen.lang.data_parallel.run_batch_replicas`) and ``on_tokens`` hears a
        :class:`~treegen.lang.data_parallel.ReplicaTokenStream`."""
        if getattr(engine, "replicas", None) is not None:
            try:
                return run_batch(engine, [_Bound(self, args, kwargs)], seed=seed, on_tokens=on_tokens,
                                 max_program_tokens=max_program_tokens, share_prefixes=False,
                                 min_shared_saving=None)[0]  # (the tree of a run: no passes)
            except ProgramError as e:  # one program: its own error, as a run in this process raises it
                raise e.errors[0] from None
        run = ProgramRun(tokenizer=engine.tokenizer, engine=engine, seed=seed, max_program_tokens=max_program_tokens)
        run.on_tokens = check_callback("run", "on_tokens", on_tokens)
        state = run.root()
        value = self.fn(state, *args, **kwargs)
        run.program_returned(state, value)
        run.finish()
        return state

    def compile(self, /, *args, tokenizer, kv_shape: KVShape | None = None, **kwargs) -> CompiledProgram:
        """Build the sharing tree with ``tokenizer`` only (no model, nothing generated).

        ``kv_shape`` (e.g. ``engine.kv_shape``) lets the result report KV bytes without being told."""
        run = ProgramRun(tokenizer=tokenizer, engine=None, seed=0)
        try:
            self.fn(run.root(), *args, **kwargs)
        except StopTrace as stop:
            return CompiledProgram(run.tree, False, str(stop), tokenizer=tokenizer, kv_shape=kv_shape)
        return CompiledProgram(run.tree, True, None, tokenizer=tokenizer, kv_shape=kv_shape)

    def run_batch(self, engine, inputs, /, *, seed: int = 0, seeds: list[int] | Callable[[int], int] | None = None,
                  share_prefixes: bool = True, min_shared_saving: int | None = DEFAULT_MIN_SHARED_SAVING,
                  on_programs: Callable[[int, int], None] | None = None,
                  on_result: Callable[[int, State], None] | None = None,
                  on_tokens: Callable[[TokenStream], None] | None = None,
                  max_program_tokens: int | None = DEFAULT_MAX_PROGRAM_TOKENS) -> list[State]:
        """Run the program once per input as **one** workload; returns the root states, in input order
        (each with ``ret_value``, what the function returned).

        ``inputs``: one entry per program — a dict of keyword arguments, or a tuple/list of positional
        ones — as a list (every program starts at once), or an iterator drawn as the run goes: a program
        starts when its input has come and the engine has room, its prompt attached to the live tree's
        shared prefix (:mod:`treegen.lang.arrivals`; a bad input fails its program alone, an iterator that
        raises ends the inputs: :class:`~treegen.lang.batch.InputsFailed`). All programs' states live in
        one sharing tree and run continuously: each program resumes
        as soon as the ``gen`` / ``select`` it waits for is done, while the others keep decoding (see
        :mod:`treegen.lang.batch`). Before anything runs, common token prefixes of the programs'
        prompts become shared nodes (``share_prefixes``) and shared nodes saving fewer than
        ``min_shared_saving`` KV token reads per decode step are dissolved (None: keep all; see
        :func:`treegen.tree.passes.simplify`).

        Seeds: program ``i`` uses ``seeds[i]`` (or ``seeds(i)``, a function of the index: for inputs that
        arrive, or one seed per program without a list) if given, else ``seed``; its branches' random keys come
        from that seed and their path from the program's own root, never from ``i``, so a program
        samples the same tokens alone (``run(..., seed=s)``) as inside any batch.

        Callbacks, all called from the thread running the batch:
        ``on_programs(done, total)``: progress, with ``done = 0`` at the start and whenever more
        programs are done — a program is done when its function has returned and every ``gen`` /
        ``select`` it queued has run (e.g. the ``programs`` bar of the display package's ``progress(engine)``);
        ``on_result(index, root)``: each program's result as soon as it is done (failed: ``root.error``);
        ``on_tokens(stream)``: a :class:`~treegen.lang.state.TokenStream` each time a branch's
        new tokens are seen (its ``tokens`` so far, ``text``, ``state``, ``name``).

        Faults: a program that raises, or generates more than ``max_program_tokens`` tokens in all
        (None: no limit), fails alone; the others finish, then :class:`~treegen.lang.batch.ProgramError`
        names it and carries every result (``.results``). Ctrl-C raises
        :class:`~treegen.lang.batch.BatchInterrupted` with the programs finished so far.
        """
        with full_collections_paused():  # from the inputs' binding on (run_batch_here pauses the rest)
            bodies = (_bind_or_fail(self, x) for x in inputs) if arriving(inputs) else [_bind(self, x) for x in inputs]
            return run_batch(engine, bodies, seed=seed, seeds=seeds,
                             share_prefixes=share_prefixes, min_shared_saving=min_shared_saving,
                             on_programs=on_programs, on_result=on_result, on_tokens=on_tokens,
                             max_program_tokens=max_program_tokens)

    def compile_batch(self, inputs, /, *, tokenizer, kv_shape: KVShape | None = None, share_prefixes: bool = True,
                      min_shared_saving: int | None = DEFAULT_MIN_SHARED_SAVING) -> CompiledProgram:
        """The sharing tree of :meth:`run_batch` over ``inputs``, built with ``tokenizer`` only."""
        run = ProgramRun(tokenizer=tokenizer, engine=None, seed=0)
        run.share_prefixes, run.min_shared_saving = share_prefixes, min_shared_saving
        stopped = None
        for body in [_bind(self, x) for x in inputs]:
            try:
                body(run.root())
            except StopTrace as stop:
                stopped = stopped or str(stop)
        run.run_passes()
        return CompiledProgram(run.tree, stopped is None, stopped, tokenizer=tokenizer, kv_shape=kv_shape)

    # notebook and terminal views: rendered by the "program" view registered in treegen.lang.views
    def _repr_html_(self) -> str | None:
        return views.html("program", self)

    def __repr__(self) -> str:
        shown = views.text("program", self)
        if shown is not None:
            return shown
        try:  # the program's own parameters, after the state
            sig = "(" + ", ".join(map(str, list(inspect.signature(self.fn).parameters.values())[1:])) + ")"
        except (TypeError, ValueError):
            sig = "(…)"
        return f"<treegen program {getattr(self.fn, '__name__', 'program')}{sig}>"

    def __call__(self, *args, **kwargs):
        raise TypeError(f"call {self.fn.__name__}.run(engine, ...) to run a program, or .compile(tokenizer=...) to see its tree")

    def __reduce__(self):
        """By reference when the program is reachable by its name (a decorated module-level function,
        whose name holds this Program, not the function), else by value (its function pickles or not)."""
        module, qualname = getattr(self.fn, "__module__", None), getattr(self.fn, "__qualname__", None)
        if _find(module, qualname) is self:
            if module == "__main__":
                from treegen.runtime.replicas import main_is_importable

                if not main_is_importable():
                    import pickle

                    raise pickle.PicklingError(f"program {qualname} is defined in this notebook or interactive "
                                               f"session (__main__), which another process cannot import")
            return _named_program, (module, qualname)
        return Program, (self.fn,)


def _bind(program: "Program", x) -> "_Bound":
    if isinstance(x, dict):
        return _Bound(program, (), x)
    if isinstance(x, (list, tuple)):
        return _Bound(program, tuple(x), {})
    raise TypeError(f"run_batch: each input must be a dict of keyword arguments or a tuple of positional ones, "
                    f"got {type(x).__name__}")


def _bind_or_fail(program: "Program", x):
    """:func:`_bind` for an input that arrived while the run goes on: a bad one fails its program alone."""
    try:
        return _bind(program, x)
    except TypeError as e:
        return FailingBody(e)


class _Bound:
    """A program applied to one input: one body of a batch. It pickles when its program and input do
    (a data-parallel engine started from this process sends it to a replica process)."""

    def __init__(self, program: "Program", args: tuple, kwargs: dict) -> None:
        self.program, self.args, self.kwargs = program, args, kwargs

    def __call__(self, s: State):
        return self.program.fn(s, *self.args, **self.kwargs)

    @property
    def adopt_remote(self):
        """What the program's function recorded while it ran in a replica process comes back (a
        ``.tg`` program's branches), when the function asks for it."""
        adopt = getattr(self.program.fn, "adopt_remote", None)
        return None if adopt is None else lambda shipped: adopt(shipped.program.fn)


def _named_program(module: str, qualname: str) -> "Program":
    """The :class:`Program` at ``module.qualname`` (how a decorated module-level program pickles)."""
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _find(module: str | None, qualname: str | None):
    import sys

    obj = sys.modules.get(module) if module else None
    for part in (qualname or "<locals>").split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def run_batch(engine, bodies: Iterable[Callable[[State], Any]], *, seed: int = 0,
              seeds: list[int] | Callable[[int], int] | None = None,
              share_prefixes: bool = True, min_shared_saving: int | None = DEFAULT_MIN_SHARED_SAVING,
              on_programs: Callable[[int, int], None] | None = None,
              on_result: Callable[[int, State], None] | None = None,
              on_tokens: Callable[[TokenStream], None] | None = None,
              max_program_tokens: int | None = DEFAULT_MAX_PROGRAM_TOKENS,
              describe: Callable[[int], str] = str) -> list[State]:
    """Run each ``body(state)`` as one program of one batch workload; see :meth:`Program.run_batch`.
    ``describe(i)``: how errors name program ``i`` (the command line adds its input line). ``bodies``: a
    list, or an iterator drawn as the run goes (:mod:`treegen.lang.arrivals`; one replica only)."""
    options = dict(seed=seed, share_prefixes=share_prefixes, min_shared_saving=min_shared_saving,
                   on_programs=on_programs, on_result=on_result, on_tokens=on_tokens,
                   max_program_tokens=max_program_tokens, describe=describe)
    parallel = getattr(engine, "parallel", None)
    if arriving(bodies):
        if getattr(engine, "replicas", None) is not None or parallel is not None and parallel.dp > 1:
            raise ValueError("run_batch: inputs that arrive as the run goes (an iterator) need an engine of one replica; "
                             "data parallel splits a batch known whole by shared prefixes — pass a list")
        if parallel is not None and parallel.world > 1 and launched():
            raise ValueError("run_batch: inputs that arrive as the run goes (an iterator) cannot be drawn alike on every "
                             "rank of a torchrun launch — pass a list (or drive tensor parallel from one process: "
                             "Engine.load(..., tensor_parallel=N))")
        return run_batch_here(engine, bodies, seeds=seeds, **options)
    bodies = list(bodies)
    seeds = seeds_of(seeds, len(bodies))
    if getattr(engine, "replicas", None) is not None:  # data parallel from this process: replica processes
        from treegen.lang.data_parallel import run_batch_replicas

        return run_batch_replicas(engine, bodies, seeds=seeds, **options)
    if parallel is not None and parallel.dp > 1:  # several replicas: each runs whole prefix subtrees
        from treegen.lang.data_parallel import run_batch_data_parallel

        return run_batch_data_parallel(engine, bodies, seeds=seeds, **options)
    return run_batch_here(engine, bodies, seeds=seeds, **options)


def program(fn: Callable[..., Any]) -> Program:
    """Decorator turning ``fn(s, ...)`` into a :class:`Program`."""
    return Program(fn)
