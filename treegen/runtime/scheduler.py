"""The engine's step decisions, as plain data: what is admitted, what is prefilled, when to replan.

Jobs (:class:`~treegen.runtime.requests.Job`) arrive at any time. Each engine step the
:class:`Scheduler` returns a :class:`Step`:

* **admission by memory** — waiting jobs enter in priority order (below) while the KV they may need (the
  tokens of every path node not yet in memory, and each generating branch's tokens plus
  ``max_tokens``, or with sparse window attention its kept budget plus slack) fits the budget; their slots are reserved at once, so a run never runs out of KV
  memory half way. The rest wait until finished branches free theirs. A job that needs more than the
  whole budget is refused at once; one that cannot fit while nothing runs (the memory is held by
  branches that continue) is refused too, with the sizes, rather than waiting forever.
* **priority** — a program's later work (the gens after a join, a search's next level) depends on its
  earlier work, so a run ends when its last dependent chain does. Waiting jobs go shallowest first (the
  fewest nodes on their path: a program's first fork before another program's follow-ups, whose
  chains are shorter), scores before gens, then the longest ``max_tokens`` first (long gens started
  early do not leave a tail at the end), then arrival order. Replayed on the CPU
  (``benchmarks/dynamic_schedule_cpu.py``, 256 branches), against arrival order: a tree-of-thought
  search 1,293 -> 1,143 forward passes (ideal 1,011), three dependent rounds 2,274 -> 1,961 (ideal
  1,795). A job submitted in an earlier window of ``AGING_STEPS`` decode steps goes before every later
  one, so a stream of new shallow work cannot starve deep work.
* **token batching** (BatchLLM's memory-centric batching) — every live branch decodes one token
  each step; the rows of admitted jobs' new nodes (parents first) fill the step up to
  ``token_budget`` tokens, a whole job at a time (at least one job per step, so a large prompt still
  moves). A job whose rows are all in the step is *ready*: a gen draws its first token from the
  step's logits and joins decoding, a score is computed.
* **offload / recompute** (:mod:`~treegen.runtime.offload`: the policy; :mod:`~treegen.runtime.eviction`: which
  nodes, carried out) — when a job does not fit, the KV of
  *idle* nodes (no admitted or decoding job reads them: a branch that will continue later, the
  nodes of a waiting subtree) leaves the budget, least recently used first and nodes no waiting job
  reads before those one does: copied to the host, or dropped to be prefilled again, as the
  :class:`~treegen.runtime.offload.OffloadPolicy` decides per node. A job whose nodes are on the
  host has them copied back when it is admitted (their slots are part of its need); a dropped
  node's tokens are rows of the step again. The :class:`Step` lists what moved.
* **slices** — with offload on and a bounded budget, a gen with more than ``slice_tokens`` tokens
  still to draw reserves only its next ``slice_tokens`` (``Engine(slice_tokens=)``, off by
  default; ``SLICE_TOKENS`` is the measured size): it decodes that far, then *pauses* (leaves the
  batch, its KV kept) and waits again, ahead of fresh gens of its kind, the furthest along first
  (:meth:`resume`). Its node is then idle, so when memory runs short the branches furthest behind go to
  the host and the rest decode on — branches at staggered lengths share the budget, instead of whole
  reservations of ``max_tokens`` that hold most of it unwritten (vLLM's preemption, by slices). Only a gen
  that can finish alone is sliced: its path, its whole length and the range it holds while its node moves
  for its last growth fit the budget (else it reserves its whole length, as without slices). With memory to
  spare — nothing waits, and the budget holds its next slice and the range it holds while it moves — a live
  branch is given its next slice where its slice ends, without a pause (:meth:`extend`).
* **phases** — between steps that prefill, live branches decode in phases planned once (see
  :mod:`~treegen.runtime.decode`); :meth:`Scheduler.phase_should_end` says when a phase should stop
  so that finished branches leave and new work joins.

Nothing here touches the model: the scheduler reads the sharing tree and the KV store's segments, so
it is tested on the CPU without one (``tests/test_scheduler.py``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Iterable

from treegen.runtime.eviction import Evictions
from treegen.runtime.offload import OffloadPolicy
from treegen.runtime.requests import GenRequest, Job
from treegen.runtime.swa import DEFAULT_EVERY, reserve_slots

# A decode phase stops for new work once the new jobs plus the branches finished since it began reach
# this fraction of its size. Replanning costs about ten steps of a 256-branch TinyLlama phase (the
# CUDA graph capture dominates); stopping later leaves finished rows computing. Measured on an H100
# (bench_dynamic, rounds, 256 branches): 0.125 -> 29.3K tok/s, 0.25 -> 38.1K, 0.5 -> 42.1K.
REPLAN_FRACTION = 0.5
# ...or once new work has waited this many decode steps, whatever its size.
MAX_WAIT_STEPS = 64
# With nothing waiting, a phase half of whose branches are done shrinks to the rest only once it has run
# this many steps: the new phase's set-up (a plan, often a CUDA graph capture: about ten steps at 256
# TinyLlama branches) pays only over many steps at the smaller batch, and a phase whose first half ended
# sooner is one of short answers whose second half ends soon too. Measured on an H100 (bench_constrained,
# answer regex, 256 branches, 2-17 tokens each): shrinking at half done made the decode 1.8x the same
# token work's time (a second capture); see the issue notes.
SHRINK_AFTER_STEPS = 32
# Decode steps are counted in windows of this many (from the run's first step); a job submitted in an
# earlier window is admitted before every job of a later one, whatever their depth or length, so later
# shallow work holds a job back for at most the rest of its window and the next. (The benchmark's runs,
# 1,100-2,000 steps at 256 branches, cross one boundary: its pass counts include that.)
AGING_STEPS = 1024
# The slice size measured for ``Engine(slice_tokens=)`` (off by default; see "slices" in the module doc): with
# offload on and a bounded KV budget, a gen reserves at most this many tokens ahead. Measured on an H100 (bench_alisa, Llama-3-8B shape, 64 branches
# x 4,096 new tokens under a third of their KV): 9,232 forward passes against 16,400 with whole reservations (rounds of 20 branches), 0.54 of
# the unlimited run's tokens/s against 0.35. Each slice ends a decode phase, so small ones replan often.
SLICE_TOKENS = 512


@dataclass(frozen=True)
class KVBudget:
    """Bytes the KV cache may use in all (``None``: no limit, e.g. on the CPU) and per token."""

    total_bytes: int | None
    bytes_per_token: int

    @property
    def slots(self) -> int | None:
        return None if self.total_bytes is None else self.total_bytes // self.bytes_per_token


@dataclass
class Step:
    """One engine step. ``rows``: the (node, index) tokens to run besides the live branches' decode
    rows — new tokens of admitted jobs' paths (parents first) and conditioning tokens run again;
    ``ready``: jobs whose rows are all in ``rows`` (complete after this step); ``admitted`` /
    ``refused``: jobs that entered or were turned away (``job.error`` says why) at this step;
    ``offloaded`` / ``dropped``: idle nodes whose KV went to the host / was dropped to make room;
    ``restored``: nodes copied back from the host for admitted jobs; ``recomputed``: dropped nodes
    whose tokens admitted jobs prefill again."""

    rows: list[tuple[int, int]] = field(default_factory=list)
    ready: list[Job] = field(default_factory=list)
    admitted: list[Job] = field(default_factory=list)
    refused: list[Job] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    restored: list[int] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)

    @property
    def runs_model(self) -> bool:
        return bool(self.rows or self.ready)


def conditioning_row(tree, node: int) -> tuple[int, int]:
    """(node, index) of the last token on ``node``'s path — the one whose logits come next."""
    for n in reversed(tree.path(node)):
        if tree.tokens(n):
            return n, len(tree.tokens(n)) - 1
    raise ValueError("nothing to condition on: append some text before gen or select")


def score_rows(tree, job: Job) -> list[list[tuple[int, int]]]:
    """For a score job: per choice, the rows whose logits predict the choice's tokens."""
    cond = conditioning_row(tree, job.request.parent)
    return [[cond] + [(c, i) for i in range(len(tree.tokens(c)) - 1)] for c in job.request.choices]


class Scheduler(Evictions):
    """Decides each step of one tree run (see the module docstring).

    ``budget()``: the current :class:`KVBudget` (asked only when jobs wait); ``token_budget``: rows a
    step aims for, decode rows included; ``max_batch``: generating branches at most (None: as many
    as memory holds); ``offload``: what may happen to idle KV when a job does not fit (default: it
    stays); ``slice_tokens``: the most tokens a gen reserves ahead with offload on and a bounded budget (None:
    its whole length; see "slices" in the module doc)."""

    def __init__(self, tree, kv, budget: Callable[[], KVBudget], token_budget: int, max_batch: int | None = None,
                 offload: OffloadPolicy | None = None, kv_keep_every: int = DEFAULT_EVERY,
                 slice_tokens: int | None = None) -> None:
        self.tree, self.kv, self.budget, self.token_budget = tree, kv, budget, token_budget
        self.max_batch = max_batch
        self.offload = offload or OffloadPolicy()
        self.slice_tokens = slice_tokens
        self.last_used: dict[int, int] = {}  # node → the step count when a job last started on it or read it
        self._steps = 0  # next_step calls (the clock of last_used)
        self._reading: list[int] = []  # the live branches' leaves (their paths are not idle)
        self._rates = None  # the policy's rates, once asked
        self.kv_keep_every = kv_keep_every  # a sparse-window gen's steps between compactions (its slack)
        self.waiting: list[Job] = []  # in priority order (see the module doc)
        self._priority: dict[Job, tuple] = {}  # waiting job -> its sort key
        self._submitted = 0  # jobs submitted so far (the key's last item: arrival order)
        self.admitted: list[Job] = []  # admitted, rows not run yet
        self.clock = 0  # decode steps run so far (advanced by the engine)
        self._work_since: int | None = None  # clock when the oldest waiting work arrived
        self.memory_waits = 0  # steps at which a job waited for memory (a workload over the budget)
        self.peak_slots = 0  # the most KV slots reserved at once
        self.memory_blocked = False  # the last admission stopped at a job that did not fit the memory
        self._blocked_at = 0  # KV slots reserved then
        # evictions decided in the last admission pass (see _evict; carried out at its end: the nodes are then
        # gone from the pool, which need() sees either way); reset when a pass starts
        self._evicting: dict[int, bool] = {}
        self._total: int | None = None  # the last admission pass's budget in slots (bounded: gens may be sliced)
        self.host_fallbacks = 0  # offloads the host had no memory for, dropped instead ("auto": see _carry_out)

    # ------------------------------------------------------------------------------------------------
    def submit(self, job: Job, priority: tuple | None = None) -> None:
        """Queue ``job``; ``priority``: its key as another rank's scheduler gave it (a tensor-parallel
        worker replays rank 0's queue), else :meth:`priority`."""
        if self._work_since is None:
            self._work_since = self.clock
        self._submitted += 1
        self._priority[job] = self.priority(job) if priority is None else priority
        bisect.insort(self.waiting, job, key=self._priority.__getitem__)
        if self.waiting[0] is job:  # a new head may fit where the job that did not went first
            self.memory_blocked = False

    def priority_of(self, job: Job) -> tuple | None:
        """The key ``job`` waits under; None once it has left the queue."""
        return self._priority.get(job)

    def priority(self, job: Job) -> tuple:
        """``job``'s place among waiting jobs, smallest first: (window of ``AGING_STEPS`` it arrived in,
        nodes on its path, gen after score, longest ``max_tokens`` first, most tokens drawn first (a paused
        gen before fresh ones), arrival). A paused gen keeps the window and arrival of its first submission."""
        req = job.request
        window, arrival = job.queued if job.queued is not None else (self.clock // AGING_STEPS, self._submitted)
        if isinstance(req, GenRequest):
            return (window, len(self.tree.path(req.node)), 1, -req.params.max_tokens, -job.drawn, arrival)
        return (window, len(self.tree.path(req.parent)) + 1, 0, 0, 0, arrival)

    def resume(self, job: Job, drawn: int) -> None:
        """A sliced gen paused after drawing ``drawn`` tokens (its slice's reservation used up; its KV and its
        branch's state kept by the decoder): it waits for its next slice, ahead of fresh gens of its kind."""
        job.drawn = drawn
        self.submit(job)

    def cancel(self, job: Job) -> bool:
        """Remove a job not admitted or not yet run; False when it is not here (it is decoding)."""
        for queue in (self.waiting, self.admitted):
            if job in queue:
                queue.remove(job)
                self._priority.pop(job, None)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.admitted)

    def tick(self, steps: int = 1) -> None:
        self.clock += steps

    def phase_should_end(self, size: int, live: int, steps: int | None = None, left: int | None = None) -> bool:
        """A decode phase of ``size`` branches, ``live`` of them still generating, ``steps`` steps run
        (None: a phase whose successor costs only a plan, no capture), at most ``left`` more to run (its
        rows' budgets: ``max_tokens``, a token automaton's longest answer; None: not known): stop it now?
        Half done ends it when work waits, at once for ``steps=None``, or after ``SHRINK_AFTER_STEPS``
        when as many may follow (a shrink's set-up pays only over many steps)."""
        if live == 0:
            return True
        if 2 * live <= size and (steps is None or self.has_work() or steps >= SHRINK_AFTER_STEPS
                                 and (left is None or left >= SHRINK_AFTER_STEPS)):
            return True
        done = size - live
        if self.memory_blocked and self.waiting and not self.admitted and self.kv.slots_reserved() >= self._blocked_at:
            # what waits needs memory that only finished branches give back (or make idle), and nothing
            # was freed since: counting it as new work would end every phase at once while it cannot join
            return done > 0 and (done >= REPLAN_FRACTION * size or self.clock - (self._work_since or 0) >= MAX_WAIT_STEPS)
        new = len(self.waiting) + len(self.admitted)
        if self.max_batch is not None:
            new = min(new, self.max_batch - live)  # only what could join now
        if new <= 0:
            return False
        return (size - live) + new >= REPLAN_FRACTION * size or self.clock - (self._work_since or 0) >= MAX_WAIT_STEPS

    # ------------------------------------------------------------------------------------------------
    def next_step(self, live: int, reading: Iterable[int] = ()) -> Step:
        """The next step, given ``live`` decoding branches (each one decode row in the step) and the
        nodes they generate into (``reading``: their paths' KV is not idle)."""
        step = Step()
        self._steps += 1
        self._reading = list(reading)
        for n in self._reading:
            self.last_used[n] = self._steps
        if self.waiting:
            self._admit(step, live)
        self._take_rows(step, room=self.token_budget - live)
        if not self.waiting and not self.admitted:
            self._work_since = None
        elif step.ready:
            self._work_since = self.clock
        return step

    def need(self, job: Job, counted: set[int] | frozenset = frozenset(), whole: bool = False) -> dict[int, int]:
        """Slots ``job`` adds: every path node without KV or grown past its range (and not in
        ``counted``) at its length, and
        a generating node at its tokens plus ``max_tokens`` or its slice (what it gains when it must grow;
        :meth:`moving` is the range held meanwhile). ``whole``: the gen's whole length, as if it held nothing."""
        kv = self.kv
        req = job.request
        # (a node extended past its range since it was reserved moves too: its new range is needed whole)
        # (a node whose eviction this admission pass decided counts as gone: it is restored or prefilled)
        segments, evicting = kv.segments, self._evicting
        need = {n: max(self.held(n), 1) for n in self.nodes(job)  # (an empty node is given one slot)
                if n not in counted and (n not in segments or n in evicting or segments[n].capacity < self.held(n))}
        if isinstance(req, GenRequest):
            want = self.gen_slots(job, whole)
            have = segments[req.node].capacity if req.node in segments and req.node not in evicting else 0
            # a node that must grow gains ``want - have`` slots; it may move (its new range taken whole while the
            # old one is held): an admission pass keeps room for its largest move (see _admit)
            need[req.node] = 0 if have >= want else (want if whole else want - have)
        return need

    def extend(self, job: Job, drawn: int) -> bool:
        """Give live sliced gen ``job`` (``drawn`` tokens so far) its next slice now, without a pause, if nothing
        waits and the budget holds the slots it gains and the range it holds while it moves (nothing is evicted
        for it): with memory to spare, slices never end a decode phase. True when its node holds the slice."""
        job.drawn = drawn
        node = job.request.node
        seg = self.kv.segments.get(node)
        if seg is None or self.waiting or self._total is None or self.slice_tokens is None:
            return False
        want = min(self.gen_slots(job, whole=True), seg.capacity + self.slice_tokens)  # (a whole slice more)
        if seg.capacity >= want:
            return True
        # the budget of now, not the admission's: should the pool grow, it is a copy, larger the larger the pool
        # (seen on an H100: 256 sliced gens of Llama-3-8B, a 41 GiB pool grown by one slice, out of memory). Asked
        # whatever the pool's free slots (which differ between tensor-parallel ranks, whose budgets are agreed by
        # a collective every rank must call alike); at a slice's end, not every step
        total = self.budget().slots
        if total is None or self.kv.slots_reserved() + want > total:  # (its gain, and its old range held while it moves)
            return False
        self.kv.ensure_free(want, limit=total)
        self.kv.reserve(node, want)
        self.peak_slots = max(self.peak_slots, self.kv.slots_reserved())
        return True

    def moving(self, job: Job) -> int:
        """Slots of the range that gen ``job``'s node holds while it must grow (0: it need not, or holds none):
        should it move, its new range is taken while this one is still held."""
        req = job.request
        seg = self.kv.segments.get(req.node) if isinstance(req, GenRequest) and req.node not in self._evicting else None
        return seg.capacity if seg is not None and seg.capacity < self.gen_slots(job) else 0

    def nodes(self, job: Job) -> list[int]:
        """Every node whose KV ``job`` reads (its paths), in path order."""
        req = job.request
        ends = [req.node] if isinstance(req, GenRequest) else [req.parent, *req.choices]
        return list(dict.fromkeys(n for end in ends for n in self.tree.path(end)))

    def gen_slots(self, job: Job, whole: bool = False) -> int:
        """Slots a gen's node needs: its tokens plus those still to draw (``max_tokens`` less what it drew
        before it paused), or its next slice (:meth:`sliced`; not with ``whole``); with sparse window attention
        (``params.kv_keep``) only what it holds at most between compactions (:func:`~treegen.runtime.swa.reserve_slots`)."""
        req = job.request
        left = req.params.max_tokens - job.drawn
        if not whole and self.sliced(job):
            left = self.slice_tokens
        return reserve_slots(len(self.tree.tokens(req.node)), left, req.params.kv_keep,
                             self.kv_keep_every, self.kv.dropped(req.node))

    def sliced(self, job: Job) -> bool:
        """Whether gen ``job`` reserves only its next ``slice_tokens`` (see the module doc): offload is on, the
        last admission pass had a bounded budget, the gen is exact, has more than that still to draw, and can
        finish alone — its path's other nodes, its whole length, and the range its node holds while it moves
        for its last growth (less than its whole length: its new range is taken before the old one is given
        back) fit the budget. (Its whole length is the same at every slice: what it drew joined its node.)"""
        params, node = job.request.params, job.request.node
        if not (self.slice_tokens is not None and self._total is not None and self.offload.on
                and params.kv_keep is None and params.max_tokens - job.drawn > self.slice_tokens):
            return False
        whole = self.gen_slots(job, whole=True)
        path = sum(max(self.held(n), 1) for n in self.nodes(job) if n != node)
        return path + 2 * whole <= self._total

    def held(self, node: int) -> int:
        """Slots ``node``'s tokens take: all of them, less those whose KV sparse window attention dropped."""
        return len(self.tree.tokens(node)) - self.kv.dropped(node)

    def _admit(self, step: Step, live: int) -> None:
        budget = self.budget()
        total = budget.slots
        self._total = total
        reserved = self.kv.slots_reserved()
        counted: set[int] = set()
        taken: list[tuple[Job, dict[int, int]]] = []
        busy = live > 0 or bool(self.admitted)
        generating = live + sum(1 for j in self.admitted if j.is_gen)
        idle = None  # the idle nodes in eviction order (see eviction.IdleNodes), made at the first eviction
        # slots kept free for the largest range a growing node holds while it moves: with that much free
        # after the pass, every move finds room for its new range (it gains its share of the rest)
        move = 0
        self._evicting = {}
        self.memory_blocked = False
        while self.waiting:
            job = self.waiting[0]
            if self.max_batch is not None and job.is_gen and generating >= self.max_batch:
                break  # the batch is full: wait for branches to finish
            need = self.need(job, counted)
            slots = sum(need.values())
            moves = max(move, self.moving(job))
            if total is not None and reserved + slots + moves > total:
                alone = sum(self.need(job, whole=True).values())
                if alone > total:
                    job.error = MemoryError(
                        f"this {_what(job)} needs {_size(alone, budget)} of KV, more than the whole KV budget "
                        f"of {_size(total, budget)}" + (" (offload cannot help: the KV a job reads is on the GPU "
                                                        "while it runs)" if self.offload.on else ""))
                    self._pop_waiting()
                    step.refused.append(job)
                    continue
            if total is not None and reserved + slots + moves > total:
                if self.offload.on:
                    if idle is None:
                        idle = self._idle_nodes(taken)
                        self._evicting = idle.evicting  # (need() counts these as gone)
                    evicted = self._evict(reserved + slots + moves - total, idle, set(self.nodes(job)), step)
                    if evicted is not None:
                        reserved -= evicted
                        idle.protected.update(self.nodes(job))
                        self._take(job, need, taken, counted)
                        reserved += slots
                        move = moves
                        generating += job.is_gen
                        continue
                if busy or taken:
                    self.memory_waits += 1
                    self.memory_blocked = True
                    self._blocked_at = self.kv.slots_reserved() - (idle.freed if idle is not None else 0)
                    break
                job.error = self._never_fits(job, slots, total, budget)
                self._pop_waiting()
                step.refused.append(job)
                continue
            self._take(job, need, taken, counted)
            if idle is not None:
                idle.protected.update(self.nodes(job))
            reserved += slots
            move = moves
            generating += job.is_gen
        if idle is not None:
            self._carry_out(idle, step)
        if not taken:
            return
        slots = sum(sum(need.values()) for _, need in taken)
        want = 0
        if self.kv.slots_free() < slots and not self.kv.written():  # growing copies nothing yet: size the
            want = slots + sum(sum(self.need(j, counted).values()) for j in self.waiting)  # pool for all known
        self.kv.ensure_free(slots + move, limit=total, want=want)
        restore: dict[int, int] = {}
        reserve: list[tuple[int, int]] = []
        for job, need in taken:
            for node in need:
                req = job.request
                gen = isinstance(req, GenRequest) and node == req.node
                length = max(self.gen_slots(job) if gen else self.held(node), 1)
                if node in self.kv.offloaded:
                    restore[node] = length
                    continue
                if node in self.kv.to_recompute:
                    step.recomputed.append(node)
                reserve.append((node, length))
            step.admitted.append(job)
            self.admitted.append(job)
        for node, length in sorted(reserve, key=lambda x: -x[1]):  # longest first: the holes fit the most
            self.kv.reserve(node, length)
        if restore:  # last: the copies must land in segments nothing moves before the step runs
            self.kv.restore(restore)
            step.restored += list(restore)
        self.peak_slots = max(self.peak_slots, self.kv.slots_reserved())

    def _pop_waiting(self) -> None:
        del self._priority[self.waiting.pop(0)]

    def _take(self, job: Job, need: dict[int, int], taken: list, counted: set[int]) -> None:
        key = self._priority[job]
        self._pop_waiting()
        if job.is_gen and job.queued is None and self.sliced(job):
            job.queued = (key[0], key[-1])
        taken.append((job, need))
        counted |= set(need)

    def _never_fits(self, job: Job, slots: int, total: int, budget: KVBudget) -> MemoryError:
        """Why ``job`` can never be admitted while nothing runs (the memory is held by idle nodes)."""
        free = total - self.kv.slots_reserved()
        held = ("the rest is held by branches that continue afterwards (not final), so waiting would never "
                "free it")
        if self.offload.mode == "host":
            per = budget.bytes_per_token
            held = (f"the rest is held by idle nodes, and moving enough of them to the host would pass its "
                    f"offload capacity ({self.kv.host_bytes / 2**20:.2f} of {self.offload.host_bytes / 2**20:.2f} "
                    f"MiB used; idle KV on the GPU: {_size(sum(s.computed for s in self.kv.segments.values()), budget)}"
                    f", {per} bytes a token): raise offload_bytes, or allow recompute (offload='auto')")
        elif self.offload.on:
            held = "the rest is held by nodes it reads or reserved beyond their tokens"
        return MemoryError(f"this {_what(job)} needs {_size(slots, budget)} of KV and only {_size(free, budget)} "
                           f"of the {_size(total, budget)} budget is free; {held}")

    def _take_rows(self, step: Step, room: int) -> None:
        """Move admitted jobs into the step, whole, while their rows fit ``room`` (at least one)."""
        seen: set[tuple[int, int]] = set()
        whole: set[int] = set()  # nodes all of whose rows without KV are in the step already
        keep: list[Job] = []
        for job in self.admitted:
            rows, nodes = self._rows(job, seen, whole)
            if self.offload.on and not (step.ready and len(step.rows) + len(rows) > room):
                for n in nodes:
                    self.last_used[n] = self._steps
            if step.ready and len(step.rows) + len(rows) > room:
                keep.append(job)
                continue
            seen.update(rows)
            whole.update(nodes)
            step.rows += rows
            step.ready.append(job)
        self.admitted = keep
        # parents before children (ids do not promise it: prefix sharing inserts parents later)
        depth = {n: len(self.tree.path(n)) for n in {n for n, _ in step.rows}}
        step.rows.sort(key=lambda r: (depth[r[0]], r[0], r[1]))

    def _rows(self, job: Job, seen: set[tuple[int, int]], whole: set[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """Rows ``job`` adds to a step that already has ``seen``: its paths' tokens without KV, then its
        conditioning rows (run again when their KV exists: the same KV is written again); and the nodes
        of its paths. ``whole``: nodes whose rows without KV are all in ``seen`` (skipped: a few-shot
        prefix shared by thousands of new jobs is not walked token by token for each)."""
        tree, kv = self.tree, self.kv
        req = job.request
        ends = [req.node] if isinstance(req, GenRequest) else [req.parent, *req.choices]
        rows: list[tuple[int, int]] = []
        nodes = sorted({n for end in ends for n in tree.path(end)})
        for n in nodes:
            if n not in whole:
                rows += [(n, i) for i in range(kv.computed(n), len(tree.tokens(n))) if (n, i) not in seen]
        cond = conditioning_row(tree, req.node if isinstance(req, GenRequest) else req.parent)
        if cond not in seen and cond not in rows:
            rows.append(cond)
        return rows, nodes


def _what(job: Job) -> str:
    req = job.request
    if isinstance(req, GenRequest):
        return f"gen (node {req.node}, max_tokens={req.params.max_tokens})"
    return f"select (node {req.parent}, {len(req.choices)} choices)"


def _size(slots: int, budget: KVBudget) -> str:
    """``slots`` KV tokens, and their bytes."""
    n = slots * budget.bytes_per_token
    return f"{slots} tokens ({n / 2**30:.2f} GiB)" if n >= 2**26 else f"{slots} tokens ({n / 2**20:.2f} MiB)"


def expected_left(width: int, steps: int, first_end: int | None) -> int:
    """How many more steps a phase of ``width`` steps that has run ``steps`` is expected to run, for the
    scheduler's choice to shrink it (:meth:`~treegen.runtime.scheduler.Scheduler.phase_should_end`): no
    more than its width allows, and, once a row has ended (seen ``first_end`` steps in), no more than the
    steps since — a phase half of whose rows ended within a few steps of the first is one of answers of
    about one length, whose other half ends about as soon (the spread of the answers' lengths below the
    median stands for the spread above it). A longer tail is caught later: the estimate grows a step a step."""
    left = width - steps
    return left if first_end is None else min(left, steps - first_end)
