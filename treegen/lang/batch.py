"""Many programs as one workload, without a global barrier.

Each program body runs in its own thread, but **only one runs at a time** (the driver's, or one
program's), so a batch run is as deterministic as a single one. A program that needs a generated
value (it reads one, or forks a state with queued work) pauses; its queued ``gen`` / ``select`` ops
are already jobs of the engine (:class:`~treegen.runtime.engine.TreeRun`). The driver runs the
engine's loop (:meth:`~treegen.runtime.engine.TreeRun.advance`), which returns whenever some jobs
complete, and resumes — in program order — every paused program whose own work is done, while the
GPU keeps decoding the others' branches. Before anything runs, the roots of all programs are merged
by common token prefix (:func:`treegen.tree.passes.share_prefixes`) and the tree is simplified
(:func:`treegen.tree.passes.simplify`).

A program that raises fails alone: its jobs are cancelled, its KV freed, the error kept on its root
(``root.error``); the others finish. :class:`ProgramError` then names the failed programs and
carries every result. Ctrl-C stops the run; :class:`BatchInterrupted` carries the programs already
finished.

Seeds: a program's branches draw from ``branch_key(seed, path)`` where the path is the fork indices
from **that program's** root — the program's position in the batch is not part of it. So a program
samples the same tokens alone or inside any batch (given the same seed) and whatever runs beside it
or however the engine schedules it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


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


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a batch. ``results``: the root state of every program finished before it
    (None for the others), in input order."""

    def __init__(self, results: list) -> None:
        super().__init__(f"interrupted: {sum(r is not None for r in results)} of {len(results)} programs had finished")
        self.results = results


class _Stopped(BaseException):
    """Raised in a paused program thread when its program is stopped (failed, or the batch ended)."""


class _Worker:
    def __init__(self, index: int, body: Callable[[], None]) -> None:
        self.index, self.body = index, body
        self.go = threading.Event()
        self.yielded = threading.Event()
        self.waiting = False
        self.done = False
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._main, name=f"treegen-program-{index}", daemon=True)

    def _main(self) -> None:
        self.go.wait()
        self.go.clear()
        try:
            if not self.stopped:
                self.body()
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the driver, recorded on the program
            self.error = e
        self.done = True
        self.yielded.set()

    def resume(self) -> None:
        """Let this program run until it pauses or ends (called from the driver)."""
        self.waiting = False
        self.yielded.clear()
        self.go.set()
        self.yielded.wait()


class Cooperative:
    """Runs program bodies one at a time, each resumed as soon as its own work is done."""

    def __init__(self, bodies: list[Callable[[], None]]) -> None:
        self.workers = [_Worker(i, b) for i, b in enumerate(bodies)]
        self._by_thread = {w.thread: w for w in self.workers}

    def in_program(self) -> bool:
        return threading.current_thread() in self._by_thread

    def wait(self) -> None:
        """Called by a program (in its thread): pause until the driver resumes it."""
        w = self._by_thread[threading.current_thread()]
        w.waiting = True
        w.go.clear()
        w.yielded.set()
        w.go.wait()
        if w.stopped:
            raise _Stopped()

    def stop(self, program: int) -> None:
        """Mark a program stopped: a paused thread ends when next resumed (by :meth:`run`)."""
        self.workers[program].stopped = True

    def run(self, run) -> None:
        """Run every body to its end over the :class:`~treegen.lang.interpreter.ProgramRun` ``run``."""
        try:
            run.hold_submissions = True  # the passes see every program's prompt before anything runs
            for w in self.workers:
                w.thread.start()
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
                if not any(w.waiting and not w.done for w in self.workers) and not run.tree_run.busy():
                    return
                if not run.tree_run.advance() and not ready:
                    stuck = [w.index for w in self.workers if w.waiting and not w.done]
                    raise RuntimeError(f"programs {stuck} wait for work the engine does not have (an interpreter bug)")
        finally:
            for w in self.workers:
                if not w.done and w.thread.is_alive():
                    w.stopped = True
                    w.go.set()
                    w.thread.join(timeout=5)

    def _resume(self, run, w: _Worker) -> None:
        started = time.perf_counter()
        w.resume()
        if w.error is not None:
            run.program_failed(run.roots[w.index], w.error)
            w.error = None
        elif w.waiting and not w.stopped:
            run.submit(w.index)
            if not run.program_busy(w.index):  # nothing to wait for after all: look at it again
                run.touched.add(w.index)
        run.tree_run.host_seconds["programs"] += time.perf_counter() - started
