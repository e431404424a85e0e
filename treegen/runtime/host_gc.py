"""Python's cyclic garbage collector during a run: what exists when the run starts is not scanned again.

CPython collects reference cycles every few hundred new container objects, and each *full* collection
walks every tracked object alive — the model's modules, the tokenizer, the caller's inputs — while
the GPU waits for the host. A run makes many objects (programs' states and threads, tree nodes, jobs,
token lists) and so triggers full collections. Measured on a 2-core CPU with ``bench_dynamic.py``'s
``tot`` workload (192 programs): the programs' start-up, until the engine's first step, took 0.39-0.55 s,
and 0.18-0.24 s with this; the collector's time over the whole run fell from 0.30 s to 0.13 s.

:func:`frozen_heap` collects once, then moves every object alive at the start of a run to the
collector's permanent generation (``gc.freeze``), which collections skip; objects made during the run
are collected as usual, and at its end everything goes back (``gc.unfreeze``). The collection first
matters: garbage frozen with the rest (say an earlier run's cycle holding its KV pool) would stay
alive — and its GPU memory held — for the whole run. Nested runs, and runs in other threads while one
is open, freeze nothing more; a process that froze its heap itself is left as it is.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_open = 0  # frozen_heap contexts open, in any thread (the first to open freezes, the last to close unfreezes)
_ours = False  # the freeze in force is frozen_heap's


@contextlib.contextmanager
def frozen_heap():
    """Within: the objects alive at entry are skipped by garbage collections (see the module doc)."""
    global _open, _ours
    with _lock:
        if _open == 0 and gc.get_freeze_count() == 0:  # (else: already frozen, by an open run or the caller)
            gc.collect()
            gc.freeze()
            _ours = True
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0 and _ours:
                gc.unfreeze()
                _ours = False
