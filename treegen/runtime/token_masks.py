"""The grammar state of every branch that xgrammar constrains in a tree run, and the token bitmasks it gives
(a branch that a token automaton serves has its state on the device instead: :mod:`~treegen.runtime.token_automata`).

Each constrained branch has its own xgrammar matcher (made from the compiled grammar that all
branches with the same constraint share, :class:`~treegen.runtime.constraint.Grammars`). After the
host accepts a branch's token it advances the matcher; before the branch's next token is sampled its
row of a bitmask ``[rows, ceil(vocab / 32)] int32`` is filled from the matcher (a decode step's accepts
and fills in one pass, chunks of many rows on threads of their own: :meth:`TokenMasks.accept_and_fill`) and :func:`apply_bitmask`
sets the logits of the tokens it forbids to ``-inf``. Rows of unconstrained or finished branches are all ones (nothing forbidden), so
one bitmask serves a mixed batch and its shape never changes during a decode phase.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from treegen.runtime.constraint import Grammars


# rows per thread at least when accepting and filling a step's masks. xgrammar's own multi-threaded fill was
# measured slower than one thread (H100 host, 16 CPUs, TinyLlama's 32K vocabulary, free-text regex: 1.4 ms
# on 8 threads against 0.27 on one at 256 rows, 4.4 against 1.1 at 1,024; bench_constrained, TREEGEN_MASK_THREADS)
FILL_CHUNK = 256


class TokenMasks:
    """Matchers by branch id; see the module doc."""

    def __init__(self, grammars: Grammars) -> None:
        import xgrammar as xgr

        self.grammars = grammars
        self.matchers: dict[int, object] = {}  # branch -> its xgrammar GrammarMatcher
        # xgrammar's "auto" is half of std::thread::hardware_concurrency(): in a container that is the
        # host's count (often 100+ threads), not the CPUs this process may use
        self.threads = fill_threads()
        self._pool = None  # threads for a step's accepts and fills of many rows (made when first needed)
        # one one-thread batch matcher per thread that fills (see FILL_CHUNK)
        self._fillers = [xgr.BatchGrammarMatcher(1) for _ in range(self.threads)]

    def __contains__(self, branch: int) -> bool:
        return branch in self.matchers

    def add(self, branch: int, constraint) -> None:
        self.matchers[branch] = self.grammars.matcher(constraint)

    def drop(self, branch: int) -> None:
        self.matchers.pop(branch, None)

    def accept(self, branches: list[int], tokens: list[int]) -> None:
        """Advance each ``branches[i]``'s matcher by ``tokens[i]``, which its mask allowed (else a bug:
        raises), all at once (one call into xgrammar: a step of 1,024 branches costs ~2 ms, not ~15)."""
        if not branches:
            return
        import xgrammar as xgr

        taken = xgr.BatchGrammarMatcher.batch_accept_token([self.matchers[b] for b in branches], tokens)
        self._check_taken(branches, tokens, taken)

    def accept_and_fill(self, branches: list[int], handles: list, tokens: list[int] | None, bitmask: torch.Tensor,
                        rows: list[int], fill: list[bool] | None = None) -> None:
        """A decode step's host work, in one pass: advance the matcher of each ``handles[i]`` (branch
        ``branches[i]``) by ``tokens[i]`` (None: no token, fill only), then write ``bitmask[rows[i]]`` from
        it where ``fill[i]`` (None: everywhere; a matcher that just took its last token is not filled).
        A row's mask needs only its own matcher, so chunks of at least ``FILL_CHUNK`` rows go to threads
        (xgrammar releases the GIL), each accepting and filling its own with a one-thread batch matcher.
        A token its matcher refuses raises, naming the branch (its mask was not applied)."""
        if not handles:
            return
        from xgrammar.base import _core

        accept = _core.BatchGrammarMatcher.batch_accept_token

        def part(k: int, lo: int, hi: int):
            taken = accept(handles[lo:hi], tokens[lo:hi], False) if tokens is not None else ()
            if fill is None:
                mine, where = handles[lo:hi], rows[lo:hi]
            else:
                chosen = [i for i in range(lo, hi) if fill[i]]
                mine, where = [handles[i] for i in chosen], [rows[i] for i in chosen]
            if mine:
                self._fillers[k]._handle.batch_fill_next_token_bitmask(mine, bitmask, where, False)
            return taken

        chunks = max(1, min(self.threads, len(handles) // FILL_CHUNK))
        size = -(-len(handles) // chunks)
        if chunks == 1:
            taken = [part(0, 0, len(handles))]
        else:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="treegen-masks")
            futures = [self._pool.submit(part, k, lo, min(lo + size, len(handles)))
                       for k, lo in enumerate(range(0, len(handles), size))]
            taken = [f.result() for f in futures]
        if tokens is not None and any(0 in t for t in taken):
            self._check_taken(branches, tokens, [ok for t in taken for ok in t])

    def _check_taken(self, branches: list[int], tokens: list[int], taken) -> None:
        """Raise for a token a matcher refused, naming its branch (its mask was not applied: a bug) — unless it
        is a stop token, which a branch draws at a dead end (:func:`open_dead_ends`): it ends there, unmet."""
        stops = self.grammars.stop_token_ids
        for b, t, ok in zip(branches, tokens, taken):
            if not ok and not (t in stops and self._dead_end(b)):
                raise RuntimeError(f"branch {b} drew token {t}, which its constraint forbids "
                                   "(its token mask was not applied)")

    def _dead_end(self, branch: int) -> bool:
        """The branch's matcher allows no token at all (asked only when it refused a stop token: rare)."""
        row = self.new_bitmask(1)
        self.matchers[branch].fill_next_token_bitmask(row, 0)
        return not bool(row.any())

    def matched(self, branch: int) -> bool:
        """The branch's text so far is a complete match of its constraint."""
        m = self.matchers[branch]
        return m.is_terminated() or m.is_completed()

    def new_bitmask(self, rows: int, device=None, pinned: bool = False) -> torch.Tensor:
        """An all-ones (nothing forbidden) bitmask of ``rows`` rows."""
        return torch.full((rows, self.grammars.mask_width), -1, dtype=torch.int32, device=device,
                          pin_memory=pinned)

    @staticmethod
    def handles(matchers: list) -> list:
        """xgrammar's own objects behind ``matchers``, for :meth:`fill_rows` and :meth:`accept_and_fill`
        (its Python wrappers rebuild this list per call and read results back one item at a time,
        which at 1,024 branches costs about three times the accept itself)."""
        return [m._handle for m in matchers]

    def fill_rows(self, bitmask: torch.Tensor, handles: list, rows: list[int]) -> None:
        """Write ``bitmask[rows[i]]`` from the matcher of ``handles[i]`` (live, not terminated)."""
        self.accept_and_fill([], handles, None, bitmask, rows)

    def fill(self, bitmask: torch.Tensor, branches: list[int | None]) -> bool:
        """Write row ``j`` of the host ``bitmask`` for ``branches[j]``: its matcher's next-token mask,
        or all ones for None / an unconstrained / a finished branch. True when any row is constrained."""
        rows, free = [], []
        for j, b in enumerate(branches):
            m = self.matchers.get(b)
            (rows if m is not None and not m.is_terminated() else free).append(j)
        if free:
            bitmask[free] = -1
        self.fill_rows(bitmask, self.handles([self.matchers[branches[j]] for j in rows]), rows)
        return bool(rows)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, lowered by a cgroup v2 CPU quota if one is set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def fill_threads() -> int:
    """Threads for accepting tokens and filling masks (each takes a chunk of at least ``FILL_CHUNK``
    rows): half the usable CPUs (the rest run Python, the model's launches and torch), at most
    8; ``TREEGEN_MASK_THREADS`` overrides."""
    given = os.environ.get("TREEGEN_MASK_THREADS")
    if given:
        return max(1, int(given))
    return max(1, min(8, usable_cpus() // 2))


def stop_row(stop_ids, words: int) -> np.ndarray:
    """``[words]`` uint32: a bitmask row allowing only ``stop_ids``."""
    row = np.zeros(words, dtype=np.uint32)
    for t in stop_ids:
        row[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return row


def stop_bits(stop_ids, words: int, device=None) -> torch.Tensor:
    """:func:`stop_row` as the int32 tensor the step's bitmasks are."""
    return torch.from_numpy(stop_row(stop_ids, words).view(np.int32)).to(device)


def open_dead_ends(bitmask: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """``bitmask`` ``[rows, words]`` with every row that allows no token — a constraint at a dead end, which
    no text can complete (``regex="a[^\\s\\S]"`` after ``a``; a schema or grammar that matches nothing) —
    allowing the stop tokens ``stops`` (:func:`stop_bits`) instead: the branch ends there, its text an
    incomplete prefix and ``constraint_met`` False, rather than drawing a token its constraint forbids. A new
    tensor; no host sync (a decode step's graph captures it)."""
    dead = (bitmask == 0).all(dim=1, keepdim=True)
    return torch.where(dead, stops, bitmask)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits [rows, vocab]`` (fp32) to ``-inf`` where ``bitmask [rows, ceil(vocab / 32)]``
    (int32, on the logits' device) has a 0 bit, in place. On CUDA xgrammar's Triton kernel (no host
    sync, so a CUDA graph can capture it, reading the bitmask from its buffer); on the CPU its C++ loop."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
