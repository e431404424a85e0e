"""Python's cyclic garbage collector during a long engine run: its full collections paused.

A full (oldest-generation) collection traverses every container object the process holds — the
imported libraries' few hundred thousand and, during a batch of programs, their states, jobs, results
and token lists. CPython starts one whenever that generation has grown by a quarter since the last, so
a run that builds up a large heap pays for several, each a pause of the whole host: replayed on a
2-core CPU (``benchmarks/dynamic_schedule_cpu.py --workload tot --branches 1024``), six full
collections took 1.39 s, up to 0.30 s each; a pause longer than the decode steps the host has queued
leaves the GPU idle. Freezing the heap at the start does not help: the collections then come more
often (relative to the smaller unfrozen heap; 15 taking 1.26 s in the same replay).

:func:`full_collections_paused` raises the oldest generation's threshold for the duration: the young
generations are still collected (cycles that die young are freed as before); garbage that reached the
oldest generation waits until the pause ends, when the thresholds are restored (and CPython's next full
collection frees it; after the replay's tot run of 192 programs a full collection freed nothing, so the
engine's own objects make no such garbage). Cyclic garbage that reaches the oldest generation during a
long batch (say the tracebacks of failed programs) is held until the batch ends. Pauses nest and may
overlap across threads: the first to enter saves the thresholds, the last to leave restores them (a
``gc.set_threshold`` made meanwhile is undone then). Where the third threshold does not govern full
collections (``APPLIES`` false: CPython 3.14's incremental collector, free-threaded builds) the pause
does nothing. The engine's loop (``TreeRun.advance``) runs paused, and a batch of programs
(``run_batch``) for its whole duration, program code included.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading

# the oldest generation's threshold while paused: young collections between full ones (never reached)
_PAUSED_THRESHOLD = 1 << 30
# False: the collector runs as CPython sets it, pauses or not (an A/B: bench_dynamic's gc-full-collections)
enabled = True
# where the third threshold governs full collections: CPython's three-generation collector up to 3.13
# (3.14's incremental collector ignores it; a free-threaded build has one generation)
APPLIES = sys.implementation.name == "cpython" and sys.version_info < (3, 14) and \
    getattr(sys, "_is_gil_enabled", lambda: True)()

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def full_collections_paused():
    """Within this block CPython's collector makes no full collections (see the module doc)."""
    global _depth, _saved
    if not (enabled and APPLIES):
        yield
        return
    entered = False
    try:
        with _lock:
            if _depth == 0:
                _saved = gc.get_threshold()
                gc.set_threshold(_saved[0], _saved[1], _PAUSED_THRESHOLD)
            _depth += 1
            entered = True
        yield
    finally:
        if entered:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    gc.set_threshold(*_saved)
                    _saved = None
