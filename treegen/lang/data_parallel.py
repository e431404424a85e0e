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
"""

from __future__ import annotations

import heapq
from typing import Callable

from treegen.lang.batch import ProgramError
from treegen.lang.interpreter import ProgramRun, StopTrace

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
    from treegen.lang.dsl import run_batch_here

    par = engine.parallel
    mine = partition(bodies, engine.tokenizer, par.dp)[par.dp_rank]
    local_seeds = [seeds[i] if seeds is not None else seed for i in mine]
    reported: set[int] = set()

    def local_result(j: int, root) -> None:
        reported.add(mine[j])
        if on_result is not None:
            on_result(mine[j], root)

    payload: tuple
    try:
        roots = run_batch_here(engine, [bodies[i] for i in mine], seed=seed, seeds=local_seeds, on_result=local_result,
                          on_programs=on_programs, describe=lambda j: describe(mine[j]), **options)
        payload = ("ok", mine, roots)
    except ProgramError as e:
        payload = ("ok", mine, e.results)
    except Exception as e:  # noqa: BLE001 - every rank must take part in the exchange, then raise it
        payload = ("failed", mine, e)
    answers = par.gather(payload)
    failed = [(d, a[2]) for d, a in enumerate(answers) if a[0] == "failed"]
    if failed:
        d, error = failed[0]
        if d == par.dp_rank:
            raise error
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


__all__ = ["BALANCE", "expected_tokens", "partition", "run_batch_data_parallel"]
