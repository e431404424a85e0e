"""Many programs as one workload: every program's states live in one :class:`ProgramRun`.

Each program body runs in its own thread, but **only one runs at a time**, in a fixed order, so a
batch run is as deterministic as a single one. When a program needs generated values (it reads one,
or forks a state with queued work) it waits; once every program is waiting or finished, the run
flushes once — every queued ``gen`` / ``select`` of every program in one
:meth:`~treegen.runtime.engine.TreeRun.execute` per phase — and the waiting programs resume, in
order. Before the first flush the roots of all programs are merged by common token prefix
(:func:`treegen.tree.passes.share_prefixes`) and the tree is simplified
(:func:`treegen.tree.passes.simplify`).

Seeds: a program's branches draw from ``branch_key(seed, path)`` where the path is the fork indices
from **that program's** root — the program's position in the batch is not part of it. So a program
samples the same tokens alone or inside any batch (given the same seed); two identical inputs in one
batch with the same seed sample the same tokens (give them different seeds to get different draws).
"""

from __future__ import annotations

import threading
from typing import Callable


class _Aborted(BaseException):
    """Raised in a waiting program thread when another program failed."""


class _Worker:
    def __init__(self, index: int, body: Callable[[], None]) -> None:
        self.index, self.body = index, body
        self.go = threading.Event()
        self.yielded = threading.Event()
        self.waiting = False
        self.done = False
        self.error: BaseException | None = None
        self.abort = False
        self.thread = threading.Thread(target=self._main, name=f"treegen-program-{index}", daemon=True)

    def _main(self) -> None:
        self.go.wait()
        self.go.clear()
        try:
            if not self.abort:
                self.body()
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler, re-raised there
            self.error = e
        self.done = True
        self.yielded.set()

    def resume(self) -> None:
        """Let this program run until it waits for a flush or ends (called from the scheduler)."""
        self.waiting = False
        self.yielded.clear()
        self.go.set()
        self.yielded.wait()


class Cooperative:
    """Runs program bodies one at a time; a flush inside one waits for the others (see module doc)."""

    def __init__(self, bodies: list[Callable[[], None]]) -> None:
        self.workers = [_Worker(i, b) for i, b in enumerate(bodies)]
        self._by_thread = {w.thread: w for w in self.workers}

    def in_program(self) -> bool:
        return threading.current_thread() in self._by_thread

    def wait_for_flush(self) -> None:
        """Called by a program (in its thread): pause until the scheduler has flushed."""
        w = self._by_thread[threading.current_thread()]
        w.waiting = True
        w.go.clear()
        w.yielded.set()
        w.go.wait()
        if w.abort:
            raise _Aborted()

    def run(self, flush: Callable[[], None]) -> None:
        """Run every body to its end, calling ``flush()`` whenever all are waiting or done."""
        try:
            for w in self.workers:
                w.thread.start()
                w.resume()
                self._raise(w)
            while True:
                waiting = [w for w in self.workers if w.waiting and not w.done]
                if not waiting:
                    return
                flush()
                for w in waiting:
                    w.resume()
                    self._raise(w)
        finally:
            for w in self.workers:
                if not w.done and w.thread.is_alive():
                    w.abort = True
                    w.go.set()
                    w.thread.join(timeout=5)

    @staticmethod
    def _raise(w: _Worker) -> None:
        if w.error is not None:
            raise w.error
