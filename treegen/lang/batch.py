"""Many programs as one workload, without a global barrier.

Each program body runs as its own coroutine (a greenlet: a stack of its own on the driver's thread),
so **only one runs at a time** (the driver, or one program) and a batch run is as deterministic as a
single one; handing control to a program and back is a stack switch (well under a microsecond, where
OS threads took 25-55 us a round trip: thousands of hand-offs a second at 1,024 branches). A program
that needs a generated value (it reads one, or forks a state with queued work) pauses; its queued
``gen`` / ``select`` ops are already jobs of the engine (:class:`~treegen.runtime.tree_run.TreeRun`).
The driver runs the engine's loop (:meth:`~treegen.runtime.tree_run.TreeRun.advance`), which returns whenever some jobs
complete, and resumes — in program order — every paused program whose own work is done, while the
GPU keeps decoding the others' branches. Before anything runs, the roots of all programs are merged
by common token prefix (:func:`treegen.tree.passes.share_prefixes`) and the tree is simplified
(:func:`treegen.tree.passes.simplify`).

A program that raises fails alone: its jobs are cancelled, its KV freed, the error kept on its root
(``root.error``); the others finish. :class:`ProgramError` then names the failed programs and
carries every result. Ctrl-C stops the run; :class:`BatchInterrupted` carries the programs already
finished. An error of the engine itself stops the batch too: :class:`EngineFailed` (a ProgramError) carries
every result, the programs not finished failed with it.

Seeds: a program's branches draw from ``branch_key(seed, path)`` where the path is the fork indices
from **that program's** root — the program's position in the batch is not part of it. So a program
samples the same tokens alone or inside any batch (given the same seed) and whatever runs beside it
or however the engine schedules it.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable

import greenlet

from treegen.lang.arrivals import Arrivals, arriving
from treegen.lang.program_run import ProgramRun
from treegen.lang.state import State, TokenStream
from treegen.runtime.collector import full_collections_paused
from treegen.tree.passes import DEFAULT_MIN_SHARED_SAVING

# a program that keeps generating without end is stopped here (its own error; the others go on)
DEFAULT_MAX_PROGRAM_TOKENS = 1_000_000


class ProgramError(RuntimeError):
    """Programs of a batch failed; the others finished. ``errors``: ``{index: exception}``;
    ``results``: every program's root state, in input order (a failed one has ``.error``)."""

    def __init__(self, errors: dict, results: list, describe: Callable[[int], str] = str) -> None:
        self.errors, self.results = errors, results
        first = min(errors)
        e = errors[first]
        more = f" (and {len(errors) - 1} more: programs {', '.join(map(str, sorted(errors)[1:6]))}" \
               f"{', ...' if len(errors) > 6 else ''})" if len(errors) > 1 else ""
        super().__init__(f"program {describe(first)} failed: {type(e).__name__}: {e}{more}; "
                         f"the other {len(results) - len(errors)} programs finished")


class EngineFailed(ProgramError):
    """The engine raised while running a batch (not a program's own error: a fault of the runtime, the
    device or the host). The batch stops there; ``results`` still carries every program, in input order —
    those finished before it complete, the others with this error as ``.error``; ``errors``: theirs."""

    def __init__(self, error: BaseException, results: list) -> None:
        self.errors, self.results = {r.program: r.error for r in results if r.error is not None}, results
        finished = len(results) - len(self.errors)
        RuntimeError.__init__(self, f"the engine failed while running the batch: {type(error).__name__}: {error}; "
                                    f"{finished} of {len(results)} programs had finished (in .results; the "
                                    f"others' .error is this error)")


class InputsFailed(ProgramError):
    """The iterator of a batch's inputs raised (:mod:`treegen.lang.arrivals`): no more inputs were drawn,
    the programs already started finished. ``error``: what it raised; ``results``: the started programs'
    root states, in input order; ``errors``: the programs' own failures, if any."""

    def __init__(self, error: BaseException, results: list) -> None:
        self.error, self.results = error, results
        self.errors = {r.program: r.error for r in results if r.error is not None}
        failed = f" ({len(self.errors)} failed)" if self.errors else ""
        RuntimeError.__init__(self, f"reading input {len(results)} raised {type(error).__name__}: {error}; the "
                                    f"{len(results)} programs started before it finished{failed} (in .results)")


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a batch. ``results``: the root state of every program finished before it
    (None for the others), in input order."""

    def __init__(self, results: list) -> None:
        super().__init__(f"interrupted: {sum(r is not None for r in results)} of {len(results)} programs had finished")
        self.results = results


class _Stopped(BaseException):
    """Raised in a paused program when its program is stopped (failed, or the batch ended)."""


class _Worker:
    """One program body as a coroutine. Its first :meth:`resume` starts it; it pauses in
    :meth:`Cooperative.wait` and ends when its body returns or raises (recorded in ``error``).
    Ctrl-C while it runs is not its error: it stops the batch (raised in the driver)."""

    def __init__(self, index: int, body: Callable[[], None]) -> None:
        self.index, self.body = index, body
        self.waiting = False
        self.done = False
        self.error: BaseException | None = None
        self.stopped = False
        self.coroutine: greenlet.greenlet | None = None  # made at the first resume: its parent is the driver

    def _main(self) -> None:
        try:
            if not self.stopped:
                self.body()
        except _Stopped:
            pass
        except KeyboardInterrupt:
            self.done = True
            raise  # into the driver's resume: the batch stops
        except BaseException as e:  # noqa: BLE001 - handed to the driver, recorded on the program
            self.error = e
        self.done = True

    def resume(self) -> None:
        """Let this program run until it pauses or ends (called from the driver)."""
        self.waiting = False
        if self.coroutine is None:
            self.coroutine = greenlet.greenlet(self._main)
        self.coroutine.switch()


class Cooperative:
    """Runs program bodies one at a time, each resumed as soon as its own work is done.

    ``arrivals``: inputs still to come (:mod:`treegen.lang.arrivals`), each turned into a body by
    ``start(input)`` when the engine has room for it (``rows``: see :meth:`TreeRun.wants_work
    <treegen.runtime.tree_run.TreeRun.wants_work>`)."""

    def __init__(self, bodies: list[Callable[[], None]], arrivals: Arrivals | None = None,
                 start: Callable[[Any], Callable[[], None]] | None = None, rows: int = 0) -> None:
        self.workers = [_Worker(i, b) for i, b in enumerate(bodies)]
        self._running: _Worker | None = None  # the program whose body runs now (None: the driver)
        self.arrivals, self._start, self.rows = arrivals, start, rows
        self._tree_run = None  # the run's engine loop (set by run)

    def in_program(self) -> bool:
        return self._running is not None and greenlet.getcurrent() is self._running.coroutine

    def wait(self) -> None:
        """Called by a program (in its body): pause until the driver resumes it."""
        w = self._running
        if w is None or greenlet.getcurrent() is not w.coroutine:
            raise RuntimeError("Cooperative.wait called outside a running program")
        w.waiting = True
        w.coroutine.parent.switch()
        if w.stopped:
            raise _Stopped()

    def stop(self, program: int) -> None:
        """Mark a program stopped: a paused program ends when next resumed (by :meth:`run`)."""
        self.workers[program].stopped = True

    def run(self, run) -> None:
        """Run every body to its end over the :class:`~treegen.lang.program_run.ProgramRun` ``run``."""
        self._tree_run = run.tree_run
        try:
            run.hold_submissions = True  # the passes see every program's prompt before anything runs
            for w in self.workers:
                self._resume(run, w)
            run.hold_submissions = False
            run.submit()
            run.touched |= {w.index for w in self.workers if w.waiting and not run.program_busy(w.index)}
            while True:
                if run.callback_error is not None:  # on_result / on_programs raised: stop with it
                    raise run.callback_error
                touched, run.touched = sorted(run.touched), set()  # only these can have become ready
                ready = [w for w in (self.workers[i] for i in touched) if w.waiting and not w.done
                         and (w.stopped or not run.program_busy(w.index))]
                if ready:
                    for w in ready:
                        self._resume(run, w)
                    continue
                if self._draw(run, wait=False):
                    continue
                if not any(w.waiting and not w.done for w in self.workers) and not run.tree_run.busy():
                    if self._draw(run, wait=True):  # nothing runs: wait for the next input, if any is to come
                        continue
                    return
                if not run.tree_run.advance(self._arrived if self.arrivals is not None else None) and not self._arrived():
                    # the engine ran out of work (a phase may end after its last job)
                    stuck = [w.index for w in self.workers if w.waiting and not w.done]
                    if stuck:
                        raise RuntimeError(f"programs {stuck} wait for work the engine does not have (an interpreter bug)")
        finally:
            if self.arrivals is not None:
                self.arrivals.close()
            for w in self.workers:  # a paused program ends now (its wait raises _Stopped), not at collection
                if not w.done and w.coroutine is not None and not w.coroutine.dead:
                    w.stopped = True
                    self._switch(w)

    def _arrived(self) -> bool:
        """An input has arrived and the engine has room for it (the engine's loop then returns early)."""
        return self.arrivals is not None and self.arrivals.pending() and self._tree_run.wants_work(self.rows)

    def _draw(self, run, wait: bool) -> bool:
        """Start the programs of inputs that have arrived while the engine has room for more work (``wait``:
        block for the first one); True when one started."""
        started = False
        while self.arrivals is not None and (wait or run.tree_run.wants_work(self.rows)):
            got = self.arrivals.take(wait)
            if not got:
                break
            wait = False
            w = _Worker(len(self.workers), self._start(got[0]))
            self.workers.append(w)
            run.arrived(w.index)
            self._resume(run, w)
            started = True
        return started

    def _switch(self, w: _Worker) -> None:
        self._running = w
        try:
            w.resume()
        finally:
            self._running = None

    def _resume(self, run, w: _Worker) -> None:
        started = time.perf_counter()
        self._switch(w)
        if w.error is not None:
            run.program_failed(run.roots[w.index], w.error)
            w.error = None
        elif w.waiting and not w.stopped:
            run.submit(w.index)
            if not run.program_busy(w.index):  # nothing to wait for after all: look at it again
                run.touched.add(w.index)
        run.tree_run.host_seconds["programs"] += time.perf_counter() - started


# with inputs that arrive as the run goes and no max_batch: a program starts while fewer branches than this
# decode or wait (see TreeRun.wants_work; memory is the other limit)
DEFAULT_ARRIVAL_ROWS = 1024
# ... and with max_batch: while fewer than this many batches' worth of branches decode or wait. Work waiting
# for admission lets the scheduler put programs further along first, as it does with a list of inputs: with
# one batch's worth the last programs drawn were a tail of their own (the CPU replay of bench_dynamic's rounds
# at 256 branches, `dynamic_schedule_cpu.py --arriving N`: 2,451 forward passes, 683 in phases under 90% of
# the batch; with two 1,963 and 27 — a list of the same inputs: 1,961 and 50)
ARRIVAL_BATCHES = 2


@full_collections_paused()  # the whole batch, its roots and results too (pauses of the host otherwise: see the collector)
def run_batch_here(engine, bodies: Iterable[Callable[[State], Any]], *, seed: int = 0,
                   seeds: list[int] | Callable[[int], int] | None = None,
                   share_prefixes: bool = True, min_shared_saving: int | None = DEFAULT_MIN_SHARED_SAVING,
                   on_programs: Callable[[int, int], None] | None = None,
                   on_result: Callable[[int, State], None] | None = None,
                   on_tokens: Callable[[TokenStream], None] | None = None,
                   max_program_tokens: int | None = DEFAULT_MAX_PROGRAM_TOKENS,
                   describe: Callable[[int], str] = str) -> list[State]:
    """:func:`run_batch` on this process's engine alone (one replica; data parallel runs this on each).
    ``bodies``: a list, or an iterator drawn as the run goes (:mod:`treegen.lang.arrivals`)."""
    incoming = None  # inputs that arrive as the run goes (drawn from the time the batch starts)
    if arriving(bodies):
        if seeds is not None and not callable(seeds):
            raise ValueError("run_batch: these inputs arrive as the run goes (an iterator), so seeds cannot be a list "
                             "per input: give a function of the input's index, seeds=lambda i: ...")
        incoming, bodies = bodies, []
    bodies = list(bodies)
    if incoming is None:
        seeds = seeds_of(seeds, len(bodies))
    run = ProgramRun(tokenizer=engine.tokenizer, engine=engine, seed=seed, max_program_tokens=max_program_tokens)
    run.share_prefixes, run.min_shared_saving = share_prefixes, min_shared_saving
    run.on_programs = check_callback("run_batch", "on_programs", on_programs, "(done, total)")
    run.on_result = check_callback("run_batch", "on_result", on_result, "(index, root)")
    run.on_tokens = check_callback("run_batch", "on_tokens", on_tokens, "(stream)")
    roots = [run.root(seeds[i] if seeds is not None else None) for i in range(len(bodies))]
    if on_programs is not None:
        on_programs(0, len(roots))

    def program(body, root):
        run.program_returned(root, body(root))

    def start(body):  # an input that arrived: its program, a new root
        try:
            program_seed = None if seeds is None else checked_seed(seeds(len(roots)), len(roots))
        except Exception as e:  # noqa: BLE001 - the caller's seeds function: this program fails with it, alone
            body, program_seed = FailingBody(e), None
        root = run.root(program_seed)
        roots.append(root)
        if on_programs is not None:
            try:
                on_programs(run.programs_done, len(roots))
            except Exception as e:  # the caller's own code: the batch stops with its error (as in _finish_program)
                run.callback_error = run.callback_error or e
        return functools.partial(program, body, root)

    arrivals = None
    if incoming is not None:  # (made last: nothing is drawn from the caller's iterator before the batch can start)
        rows = getattr(engine, "max_batch", None)
        arrivals = Arrivals(incoming, ahead=rows * ARRIVAL_BATCHES if rows else DEFAULT_ARRIVAL_ROWS)
    scheduler = Cooperative([functools.partial(program, body, root) for body, root in zip(bodies, roots)],
                            arrivals, start, arrivals.ahead if arrivals is not None else 0)
    run.scheduler = scheduler
    try:
        scheduler.run(run)
    except KeyboardInterrupt:
        raise BatchInterrupted([r if run.is_done(r.program) and r.error is None else None for r in roots]) from None
    except Exception as e:
        if e is run.callback_error:  # the caller's on_result / on_programs raised: the batch stops with its error
            raise
        for r in roots:  # a fault of the engine: the programs not finished fail with it, the finished keep theirs
            if not run.is_done(r.program):
                r.error = e
        run.abandon()
        raise EngineFailed(e, roots) from e
    finally:
        run.scheduler = None
    run.finish()
    if arrivals is not None and arrivals.error is not None:
        raise InputsFailed(arrivals.error, roots) from arrivals.error
    errors = {r.program: r.error for r in roots if r.error is not None}
    if errors:
        raise ProgramError(errors, roots, describe) from errors[min(errors)]
    return roots


def checked_seed(value, index: int) -> int:
    """``value`` as program ``index``'s seed: an int (a bool or anything else is a TypeError naming it)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"run_batch: the seed of input {index} must be an integer, got {value!r}")
    return value


def seeds_of(seeds, count: int) -> list[int] | None:
    """``run_batch``'s ``seeds`` for ``count`` inputs known whole: None, a list of one per input, or a
    function of the input's index; a list of ints, checked."""
    if seeds is None:
        return None
    if callable(seeds):
        return [checked_seed(seeds(i), i) for i in range(count)]
    seeds = list(seeds)
    if len(seeds) != count:
        raise ValueError(f"run_batch: {len(seeds)} seeds for {count} inputs")
    return [checked_seed(s, i) for i, s in enumerate(seeds)]


class FailingBody:
    """The body of an input that cannot be run (it does not bind, its seed is bad): it raises why, failing
    its program alone."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, state) -> None:
        raise self.error


def check_callback(where: str, name: str, fn, signature: str = "(stream)"):
    """``fn`` if it is None or callable; else a TypeError naming ``where``'s parameter ``name``."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{where}: {name} must be a function {signature}, got {type(fn).__name__}")
    return fn
