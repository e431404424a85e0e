"""Inputs that arrive while a batch runs: ``run_batch`` over an iterator.

A list of inputs is known whole before anything runs: every program starts at once and the compiler
passes merge their prompts (:mod:`treegen.lang.batch`). An iterator — a generator, a queue's items,
lines read from a pipe, follow-up questions that finished programs ask — is drawn **as the run goes**:
the driver starts the next input's program whenever the engine has room for more work
(:meth:`~treegen.runtime.tree_run.TreeRun.wants_work`) and waits for one only when nothing else runs.
Its prompt then meets the live tree by radix lookup (:meth:`~treegen.lang.program_run.ProgramRun.attach`),
so a few-shot prefix that earlier programs computed is read, not computed again.

The iterator is drawn on a thread of its own, at most ``ahead`` inputs (the batch's rows) before the
driver takes them, so an input that is slow to come (a queue waiting for a producer) never stalls the GPU,
and inputs that are ready fill the batch at once. The thread
runs only the iterator (with the binding of each input to its program); program code runs on the
driver's thread as always. An iterator
that raises ends the inputs: the programs already started finish, then the batch raises
:class:`~treegen.lang.batch.InputsFailed` with their results. A thread still blocked in ``next`` when
the batch ends (Ctrl-C, an error) is a daemon and is left there; inputs it had drawn but the batch had not
started (at most ``ahead``) are dropped with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sized

# how long the driver blocks at a time while it waits for an input (Ctrl-C is seen between waits)
_WAIT_SECONDS = 0.25
# an iterator inside ``next`` for less than this is producing, not waiting: the driver waits that long for it
_PRODUCING_SECONDS = 0.002


def arriving(inputs: Iterable) -> bool:
    """Whether ``inputs`` are drawn as the run goes: an iterator (a generator, ``iter(...)``, a file) or an
    iterable without a length; a collection with one (a list, a tuple, a range, an array, a dataset, a
    dict's values) is known whole."""
    return isinstance(inputs, Iterator) or not isinstance(inputs, Sized)


class Arrivals:
    """An iterator of inputs drawn on a thread, ``ahead`` items at most before :meth:`take`."""

    def __init__(self, inputs: Iterable, ahead: int = 1) -> None:
        self.ahead = ahead
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self.taken = 0  # inputs handed to the driver
        self._pulling: float | None = None  # when the thread's current ``next`` began (None: not inside one)
        self.ended = False  # the iterator is exhausted (or failed) and every input was taken
        self.error: BaseException | None = None  # what the iterator raised
        self._thread = threading.Thread(target=self._pull, args=(iter(inputs),), daemon=True,
                                        name="treegen-inputs")
        self._thread.start()

    def _put(self, message: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=_WAIT_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _pull(self, inputs: Iterator) -> None:
        try:
            while True:
                self._pulling = time.perf_counter()
                try:
                    item = next(inputs)
                except StopIteration:
                    break
                finally:
                    self._pulling = None
                if not self._put(("input", item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the driver, raised when the batch ends
            self._put(("error", e))
        else:
            self._put(("end", None))

    def pending(self) -> bool:
        """An input (or the end of them) waits to be taken."""
        return not self.ended and not self._queue.empty()

    def take(self, wait: bool) -> list:
        """``[input]`` when one has arrived, else ``[]`` — at once, or with ``wait`` once an input comes
        or the inputs end (then :attr:`ended`, and :attr:`error` if the iterator raised)."""
        while not self.ended:
            try:
                if wait:
                    kind, item = self._queue.get(timeout=_WAIT_SECONDS)
                else:
                    # an iterator that is producing (inside ``next`` for less than _PRODUCING_SECONDS) is given that
                    # long: a generator of ready inputs then fills the batch at once instead of one input a step
                    # (measured on an H100: the first phases held 12, 20, 32... of 256 rows); one that waits for a
                    # producer is not waited for
                    pulling = self._pulling
                    producing = pulling is not None and time.perf_counter() - pulling < _PRODUCING_SECONDS
                    kind, item = self._queue.get(timeout=_PRODUCING_SECONDS) if producing else self._queue.get_nowait()
            except queue.Empty:
                if wait:
                    continue
                return []
            if kind == "input":
                self.taken += 1
                return [item]
            self.ended = True
            self.error = item
        return []

    def close(self) -> None:
        """Stop drawing (the batch ended): a thread waiting to hand over an input returns."""
        self._stop.set()
