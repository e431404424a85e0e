"""A batch over several model replicas (data parallel): split by whole prefix subtrees, results in input order.

Every rank of a data-parallel launch calls ``run_batch`` with the same inputs. Each program is first
traced (with the tokenizer only, as :meth:`~treegen.lang.dsl.Program.compile_batch` does) up to the
first generated value it reads, and the traced prompts are merged by common token prefix
(:func:`treegen.tree.passes.share_prefixes`). The units handed out are the merged tree's **root
subtrees**: programs sharing a prefix stay on one replica, so the prefix is prefilled and stored once.
Units are placed heaviest first on the least loaded replica (expected tokens: each program's traced
prompt plus the ``max_tokens`` of its traced gens); while the most loaded replica carries more than
``BALANCE`` times its share, the heaviest unit that still holds several programs is split into its
child subtrees (its prefix is then prefilled once per replica it lands on). Each replica runs its
programs as an ordinary batch (a program's seed does not depend on its batch, so its tokens are those
of a one-process run); then every rank receives every replica's finished root states (pickled without
the engine) and returns them in input order. A program that failed on any replica fails the batch with
:class:`~treegen.lang.batch.ProgramError`, as in one process; an engine failure on a replica is raised
on every rank.

From a plain Python process or a notebook (``Engine.load(..., data_parallel=N)`` outside torchrun),
:func:`run_batch_replicas` uses the same :func:`partition`, but the replicas are processes this one
started (:mod:`treegen.runtime.replicas`): each runs its share and sends every program back as soon
as it is done, so results stream here in finish order and return in input order.
"""

from __future__ import annotations

import heapq
import io
import pickle
from typing import Callable

from treegen.lang.batch import EngineFailed, ProgramError, run_batch_here
from treegen.lang.program_run import ProgramRun
from treegen.lang.state import StopTrace

BALANCE = 1.1  # the most loaded replica may carry this times its even share before a unit is split


def expected_tokens(run: ProgramRun, program: int) -> int:
    """The traced tokens of the nodes ``program`` made plus the ``max_tokens`` of its traced gens."""
    tree = run.tree
    return sum(len(tree.tokens(n)) + tree.graph.nodes[n].get("gen_budget", 0) for n in run._nodes_of.get(program, ()))


def partition(bodies: list[Callable], tokenizer, replicas: int) -> list[list[int]]:
    """The programs (indices into ``bodies``) each replica runs, each list in input order."""
    from treegen.tree.passes import share_prefixes

    run = ProgramRun(tokenizer=tokenizer, engine=None, seed=0)
    roots = []
    for body in bodies:
        root = run.root()
        try:
            body(root)
        except StopTrace:
            pass
        except Exception:  # noqa: BLE001 - it fails again, on its replica, when it really runs
            pass
        roots.append(root)
    cost = [expected_tokens(run, i) for i in range(len(bodies))]
    tree = run.tree
    tops = sorted({n for n in tree.graph.nodes if tree.parent(n) is None})
    if len(tops) > 1:
        share_prefixes(tree, tops)
    below: dict[int, list[int]] = {}  # node -> programs whose root state lies in its subtree
    alone: list[int] = []
    for i, root in enumerate(roots):
        if root.node is None:
            alone.append(i)
            continue
        for n in tree.path(root.node):
            below.setdefault(n, []).append(i)
    units: list[tuple[str, int]] = [("node", n) for n in sorted(below) if tree.parent(n) is None]
    units += [("program", i) for i in alone]

    def members(unit) -> list[int]:
        return below[unit[1]] if unit[0] == "node" else [unit[1]]

    def weight(unit) -> int:
        return sum(cost[i] for i in members(unit)) or 1

    share = max(1, sum(cost)) / replicas
    while True:
        bins = _place(units, weight, replicas)
        heaviest = max(sum(weight(u) for u in b) for b in bins)
        splittable = [u for u in units if u[0] == "node" and len(members(u)) > 1]
        if heaviest <= BALANCE * share or not splittable:
            break
        unit = max(splittable, key=lambda u: (weight(u), -u[1]))
        units.remove(unit)
        node = unit[1]
        units += [("node", c) for c in sorted(tree.children(node)) if c in below]
        units += [("program", i) for i in below[node] if roots[i].node == node]
    return [sorted(i for u in b for i in members(u)) for b in bins]


def _place(units, weight, replicas: int) -> list[list]:
    """Longest-processing-time placement: heaviest unit first, onto the least loaded replica."""
    heap = [(0, d) for d in range(replicas)]
    bins: list[list] = [[] for _ in range(replicas)]
    for unit in sorted(units, key=lambda u: (-weight(u), u)):
        load, d = heapq.heappop(heap)
        bins[d].append(unit)
        heapq.heappush(heap, (load + weight(unit), d))
    return bins


def run_batch_data_parallel(engine, bodies: list[Callable], *, seed: int, seeds: list[int] | None,
                            on_result=None, on_programs=None, describe: Callable[[int], str] = str, **options) -> list:
    """:func:`treegen.lang.dsl.run_batch` over the replicas of ``engine.parallel`` (see the module doc).
    ``on_result(index, root)`` is called with input indices: for this replica's programs as they finish,
    for the others' when they arrive; ``on_programs(done, total)`` counts this replica's programs."""
    par = engine.parallel
    mine = partition(bodies, engine.tokenizer, par.dp)[par.dp_rank]
    local_seeds = [seeds[i] if seeds is not None else seed for i in mine]
    reported: set[int] = set()

    def local_result(j: int, root) -> None:
        reported.add(mine[j])
        if on_result is not None:
            on_result(mine[j], root)

    payload: tuple
    local_error = None  # an EngineFailed of this rank: raised here whole, its cause shipped to the others
    try:
        roots = run_batch_here(engine, [bodies[i] for i in mine], seed=seed, seeds=local_seeds, on_result=local_result,
                          on_programs=on_programs, describe=lambda j: describe(mine[j]), **options)
        payload = ("ok", mine, roots)
    except EngineFailed as e:  # (a fault of this replica's engine, not of its programs: as any other error)
        local_error = e  # (its results hold live states, which do not pickle: the others get its cause)
        payload = ("failed", mine, e.__cause__ or RuntimeError(str(e)))
    except ProgramError as e:
        payload = ("ok", mine, e.results)
    except Exception as e:  # noqa: BLE001 - every rank must take part in the exchange, then raise it
        payload = ("failed", mine, e)
    answers = par.gather(payload)
    failed = [(d, a[2]) for d, a in enumerate(answers) if a[0] == "failed"]
    if failed:
        d, error = failed[0]
        if d == par.dp_rank:
            raise local_error or error
        raise RuntimeError(f"data-parallel replica {d} failed: {type(error).__name__}: {error}") from error
    results: list = [None] * len(bodies)
    for _, indices, roots in answers:
        for i, root in zip(indices, roots):
            root._run.tokenizer = engine.tokenizer  # (shipped without it)
            results[i] = root
    if on_result is not None:
        for i, root in enumerate(results):
            if i not in reported:
                on_result(i, root)
    errors = {i: r.error for i, r in enumerate(results) if r.error is not None}
    if errors:
        raise ProgramError(errors, results, describe) from errors[min(errors)]
    return results


# from a plain process: replicas in worker processes ----------------------------------------------
def run_batch_replicas(engine, bodies: list[Callable], *, seed: int, seeds: list[int] | None, on_result=None,
                       on_programs=None, on_tokens=None, describe: Callable[[int], str] = str, **options) -> list:
    """:func:`treegen.lang.dsl.run_batch` on a :class:`~treegen.runtime.replicas.ReplicatedEngine`:
    ``Engine.load(..., data_parallel=N)`` from a plain Python process or a notebook.

    The inputs are split by :func:`partition` (traced here, with the tokenizer only); each replica
    process runs its share as an ordinary batch (:func:`_replica_batch`) and sends each program back
    as soon as it is done — its root state with the part of the sharing tree it reads (see
    :func:`_pack`) — so ``on_result(index, root)`` and ``on_programs(done, total)`` are called here,
    in the calling thread, as programs finish on any replica; the results are returned in input
    order. A program's tokens do not depend on its replica (its seed and its branches' paths do not
    depend on its batch), so they are those of one process.

    **Where the program code runs.** Each replica runs its programs' bodies itself, in its own
    process, so the bodies travel there pickled: ``.tg`` programs, and ``@treegen.program`` functions
    (and any body) defined in a module or a script file, pickle; a lambda, a closure, or a function
    defined in a notebook cell does not, and is refused here, before anything runs, with a
    ``TypeError`` naming it and the fix. The other design — bodies all running here, each engine call
    mirrored to its replica as :mod:`treegen.runtime.mirror` does for tensor parallel — would take any
    callable, but every job completion and token callback of every replica would wait for a round trip
    to this one process, and all replicas' program code (the host work between forward passes) would
    share this one interpreter: the replicas would be as fast as one process's host loop, which is
    what data parallel is meant to multiply. (Bodies do run here too, but only to trace each program up
    to its first generated value for :func:`partition`.)

    ``on_tokens(stream)`` is called here too, in the calling thread, with a
    :class:`ReplicaTokenStream` (the program's index in the batch, the branch's path, the variable,
    the tokens so far, their text) each time a replica's branch has new tokens. Faults: a program that
    fails raises :class:`~treegen.lang.batch.ProgramError` once the others are done, as in one
    process; Ctrl-C stops every replica and raises :class:`~treegen.lang.batch.BatchInterrupted`
    with the programs finished so far; a replica that fails (its engine raised, its process died)
    stops the others and raises :class:`~treegen.runtime.workers.WorkerError` with its error, its
    ``results`` holding the programs finished before (None for the others), and the engine refuses
    further work (see :mod:`treegen.runtime.replicas`).
    """
    from treegen.lang.batch import BatchInterrupted
    from treegen.runtime.replicas import NotShippable
    from treegen.runtime.workers import WorkerError

    replicas = engine.replicas
    replicas.check()
    total = len(bodies)
    shares = partition(bodies, engine.tokenizer, replicas.count) if bodies else [[] for _ in range(replicas.count)]
    results: list = [None] * total
    work = [(mine, [bodies[i] for i in mine], [seeds[i] if seeds is not None else seed for i in mine], seed, options,
             on_tokens is not None) for mine in shares]
    if on_programs is not None:
        on_programs(0, total)

    def on_event(d: int, payload: bytes) -> None:
        if payload[:1] == _TOKENS:
            on_tokens(ReplicaTokenStream(*pickle.loads(payload[1:]), engine.tokenizer))
            return
        i, root, shipped = _unpack(payload[1:], engine.tokenizer)
        adopt = getattr(bodies[i], "adopt_remote", None)
        if adopt is not None and shipped is not None:
            adopt(shipped)
        results[i] = root
        if on_result is not None:
            on_result(i, root)
        if on_programs is not None:
            on_programs(sum(r is not None for r in results), total)

    try:
        replicas.run(_replica_batch, work, on_event)
    except NotShippable as e:
        raise TypeError(f"run_batch on a data-parallel engine runs each replica's programs in its own process, so "
                        f"the programs must pickle, and this one does not: {e}. Define the program in a module or "
                        f"a .py file and import it (`from my_programs import solve`), or write it as a .tg "
                        f"program; lambdas, closures and functions defined in a notebook cell cannot be sent to "
                        f"another process (or load the engine with data_parallel=1)") from None
    except KeyboardInterrupt:
        raise BatchInterrupted([r if r is not None and r.error is None else None for r in results]) from None
    except WorkerError as e:
        e.results = list(results)
        raise
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"data-parallel replicas returned no result for programs {missing[:5]} (a bug)")
    errors = {i: r.error for i, r in enumerate(results) if r.error is not None}
    if errors:
        raise ProgramError(errors, results, describe) from errors[min(errors)]
    return results


_RESULT, _TOKENS = b"R", b"T"  # the first byte of what a replica emits: a finished program, new tokens


class ReplicaTokenStream:
    """What ``on_tokens`` hears from a data-parallel replica: as a
    :class:`~treegen.lang.state.TokenStream`, but the branch's state stays in its replica process,
    so it carries the state's ``program`` (index in the batch) and ``path`` instead."""

    def __init__(self, program: int, path: tuple, name: str, tokens: tuple[int, ...], tokenizer) -> None:
        self.program, self.path, self.name, self.tokens = program, path, name, tokens
        self._tokenizer = tokenizer

    @property
    def state(self):
        raise AttributeError("a data-parallel replica's token stream has no state: the branch runs in its replica "
                             "process (use .program, .path, .name, .tokens, .text)")

    @property
    def text(self) -> str:
        return self._tokenizer.decode(list(self.tokens), skip_special_tokens=True)

    def __repr__(self) -> str:
        return (f"ReplicaTokenStream(program={self.program}, path={self.path}, name={self.name!r}, "
                f"tokens={len(self.tokens)})")


def _replica_batch(engine, emit, indices: list[int], bodies: list[Callable], seeds: list[int], seed: int,
                   options: dict, stream_tokens: bool) -> str:
    """In a replica process: run this replica's programs as one batch, emitting each as it finishes
    (and, with ``stream_tokens``, each branch's new tokens)."""
    from treegen.lang.batch import BatchInterrupted
    if not bodies:
        return "ok"

    def on_result(j: int, root) -> None:
        emit(_RESULT + _pack(indices[j], root, bodies[j]))

    def on_tokens(stream) -> None:
        st = stream.state
        emit(_TOKENS + pickle.dumps((indices[st.program], st.path, stream.name, tuple(stream.tokens)),
                                    protocol=pickle.HIGHEST_PROTOCOL))

    if stream_tokens:
        options = dict(options, on_tokens=on_tokens)
    try:
        run_batch_here(engine, bodies, seed=seed, seeds=seeds, on_result=on_result, **options)
    except EngineFailed:
        raise  # (this replica's engine failed: the programs it cut short never went out; the leader says so)
    except ProgramError:
        pass  # (each failed program went out through on_result, with its error)
    except (BatchInterrupted, KeyboardInterrupt):
        return "interrupted"
    return "ok"


class _Detaching(pickle.Pickler):
    """Pickles a finished program of a live batch run: the run itself is replaced by ``shell``."""

    def __init__(self, file, run, shell) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.run, self.shell = run, shell

    def reducer_override(self, obj):
        if obj is self.run:
            return _same, (self.shell,)
        return NotImplemented


def _same(obj):
    return obj


def _detached(run: ProgramRun, root):
    """A finished copy of ``run`` holding only ``root``'s program: its states, and the nodes of the
    sharing tree on their paths (shared prefixes included, other programs' branches not)."""
    from treegen.tree.sharing_tree import SharingTree

    program = root.program
    states = list(run.states_of.get(program, [root]))
    nodes: set[int] = set()
    for st in states:
        for n in (st.node, st.origin):
            if n is not None and n in run.tree.graph:
                nodes.update(run.tree.path(n))
    tree = SharingTree()
    tree.graph = run.tree.graph.subgraph(nodes).copy()
    shell = ProgramRun.__new__(ProgramRun)
    shell.__dict__.update(run.__dict__)
    shell.__dict__.update(tree=tree, states=states, roots=[root], states_of={program: states}, _nodes_of={},
                          _users={}, _returned={program}, _done={program}, _tokens={program: run._tokens.get(program, 0)},
                          programs_done=1, touched=set(), finished=True, scheduler=None, callback_error=None,
                          _error=None)
    return shell


def _pack(index: int, root, body) -> bytes:
    """Program ``index``'s finished root (and its body, when the body wants what it recorded back:
    ``adopt_remote``) for the leader. A result that does not pickle is sent as that program's failure."""
    shipped = body if getattr(body, "adopt_remote", None) is not None else None
    buffer = io.BytesIO()
    try:
        _Detaching(buffer, root._run, _detached(root._run, root)).dump((index, root, shipped))
        return buffer.getvalue()
    except Exception as e:  # noqa: BLE001 - its values (ret_value, a variable, its error) do not pickle
        why = f"its result could not be sent back from its replica process: {type(e).__name__}: {e}"
        return pickle.dumps((index, None, why), protocol=pickle.HIGHEST_PROTOCOL)


def _unpack(payload: bytes, tokenizer):
    """``(index, root, shipped body or None)`` from :func:`_pack`, the root reading with ``tokenizer``."""
    index, root, shipped = pickle.loads(payload)
    if root is None:  # (a result that could not be sent: a failed, empty root in its place)
        run = ProgramRun(tokenizer=tokenizer, engine=None, seed=0)
        root = run.root()
        root.error, run.finished, shipped = RuntimeError(shipped), True, None
    root._run.tokenizer = tokenizer
    return index, root, shipped


__all__ = ["BALANCE", "ReplicaTokenStream", "expected_tokens", "partition", "run_batch_data_parallel",
           "run_batch_replicas"]
