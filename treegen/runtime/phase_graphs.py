"""Decode phases' CUDA graphs, kept and replayed by later phases of the same padded shape.

Capturing a phase's step costs about one Python forward pass of host time (10–25 ms) while the GPU
waits, and a program that forks and prunes as it runs starts dozens of phases. So a phase whose
attention plan can be padded (:meth:`~treegen.runtime.tree_run.PassPlan.shape_key`: the Triton
kernels, no library segment) runs in :class:`PhaseBuffers` rather than in tensors of its own: every
tensor its captured step reads or writes, at padded sizes — rows rounded up by :func:`bucket`, the
attention plan's tables with half again as much room as the phase needs (a run's trees grow: longer
branches are split into more work items), the token buffer's width to a power of two. The phase's
values are copied in (:meth:`PhaseBuffers.load`, a few dozen small device copies); a later phase with
the same :func:`phase_key` whose tables fit (:meth:`PhaseBuffers.fits`) loads its own values into the
same buffers and replays the same graphs, capturing nothing.

Padding rows decode token 0 at position 0, greedily, and attend to nothing (no work item names them);
their one KV write per step goes to the first row's last reserved slot, which holds no KV while the
phase runs (a finished branch writes there too, see :meth:`~treegen.runtime.decode.Decoder.phase`), and
nothing reads their tokens. Kept graphs share one memory pool: they are replayed one after another,
never concurrently, and nothing a graph leaves in the pool is read after another graph has run, save
a constrained phase's logits, read by the same step's sampling graph right after its forward graph.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from treegen.runtime import cuda_graph

# kept phases' own memory (token buffers, a constrained phase's logits) beyond which the least recently
# used are dropped
KEPT_BYTES = 1 << 30


def bucket(n: int) -> int:
    """``n`` rounded up: to a multiple of 8 up to 64, then to the next ``2^k x {1, 1.25, 1.5, 1.75}``
    (at most a quarter of padding, a handful of distinct sizes per doubling)."""
    if n <= 64:
        return max(8, -(-n // 8) * 8)
    base = 1 << (n.bit_length() - 1)
    return next(base * f // 4 for f in (4, 5, 6, 7, 8) if base * f // 4 >= n)


def width_bucket(n: int) -> int:
    """A phase's token buffer width: the next power of two (at least 8)."""
    return max(8, 1 << (max(n, 1) - 1).bit_length())


def enabled() -> bool:
    """Keeping phase graphs is on unless ``TREEGEN_KEEP_PHASE_GRAPHS=0`` (for measuring what it saves)."""
    return os.environ.get("TREEGEN_KEEP_PHASE_GRAPHS", "1") != "0"


class PhaseKey(NamedTuple):
    """What must be equal for two phases to share graphs (see :func:`phase_key`)."""

    pool_generation: int  # the KV pool (graphs hold its addresses)
    rows: int  # padded rows
    constrained: bool  # the step is split for xgrammar's masks
    automata_generation: int | None  # the token automata's tables the step reads (None: it reads none)
    all_greedy: bool  # the sampler's branches
    filter_needed: bool
    plan: tuple  # the plan's shape key
    recorded: int = 0  # padded rows whose queries sparse window attention records (swa.QueryRecorder)


def phase_key(plan, *, rows: int, constrained: bool, params, pool_generation: int,
              automata_generation: int | None = None, recorded: int = 0) -> PhaseKey | None:
    """The :class:`PhaseKey` of a phase (None: the plan cannot be padded); phases of one key must also
    have tables that fit to share buffers (:meth:`PhaseBuffers.fits`). ``recorded``: its rows whose
    queries sparse window attention records."""
    plan_key = plan.shape_key()
    if plan_key is None:
        return None
    return PhaseKey(pool_generation, bucket(rows), constrained, automata_generation, params.all_greedy,
                    params.filter_needed, plan_key, bucket(recorded) if recorded else 0)


def _room(sizes):
    """Capacities for tables of these sizes (nested tuples of ints): half again as much, rounded up."""
    if isinstance(sizes, tuple):
        return tuple(_room(s) for s in sizes)
    return bucket(sizes + sizes // 2)


def _fits(capacity: tuple, sizes: tuple) -> bool:
    """Every window's plan's tables (``(programs per launch, rows, merge_idx, partials)``, as
    ``PassPlan.sizes``) within their capacities, and work items — whose padding are launched
    programs — at most about twice as many as needed."""
    def plan_fits(cap, need) -> bool:
        (cap_items, *cap_rest), (items, *rest) = cap, need
        return len(cap_items) == len(items) and all(n <= c <= 2 * n + 64 for c, n in zip(cap_items, items)) \
            and all(n <= c for c, n in zip(cap_rest, rest))

    return len(capacity) == len(sizes) and all(map(plan_fits, capacity, sizes))


@dataclass
class PhaseBuffers:
    """The tensors of a kept phase's step at padded sizes, and its graphs (see the module doc)."""

    input_ids: torch.Tensor  # [R] int64: each row's token fed to the next step
    slots: torch.Tensor  # [R] int64: each row's next KV slot
    slot_limit: torch.Tensor  # [R] int64: its last reserved slot
    jump: torch.Tensor  # [R] int64: what its slot moves by after the step (a joining gen's first: to its node; then 1)
    steps: torch.Tensor  # [R] int64: tokens each row has drawn (the sampler's counter)
    column: torch.Tensor  # [R, 1] int64: the step's column of buf
    idx: torch.Tensor  # [R] int64: 0 .. R - 1
    buf: torch.Tensor  # [R, W] int64: drawn tokens
    lp_buf: torch.Tensor  # [R, W] fp32: their log-probabilities
    plan: object  # the padded PassPlan
    params: object  # the padded sampling parameters (phase_io.RowSampling)
    bitmask: torch.Tensor | None  # [R, words] int32: a constrained phase's token masks
    done: torch.Tensor | None = None  # [R] bool: rows that drew EOS or reached max_tokens (padding: at once)
    alive: torch.Tensor | None = None  # [1] int64: rows not done
    states: torch.Tensor | None = None  # [R] int64: each row's token-automaton state (a phase with automata)
    automata: object = None  # the token automata's tables its graphs read (token_automata.AutomatonTables)
    recorder: object = None  # sparse window attention's swa.QueryRecorder its graphs write (or None)
    capacity: tuple = ()  # the plan's tables' (as PassPlan.sizes)
    graphs: dict = field(default_factory=dict)  # name -> torch.cuda.CUDAGraph, captured by the first phase
    logits: dict = field(default_factory=dict)  # a split step's logits, from its forward graph to its pick graph

    @classmethod
    def allocate(cls, *, plan, params, rows: int, width: int, mask_width: int | None, device,
                 automata=None, recorder=None) -> "PhaseBuffers":
        """Buffers for phases like one of ``rows`` branches, ``width`` steps, this plan and these params;
        ``automata``: the token automata's tables its step reads (kept alive with its graphs), or None;
        ``recorder``: a query recorder with room for the key's ``recorded`` rows, or None."""
        size = bucket(rows)
        capacity = _room(plan.sizes())

        def ints(*shape):
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        cols = width_bucket(width)
        return cls(input_ids=ints(size), slots=ints(size), slot_limit=ints(size), jump=ints(size), steps=ints(size),
                   column=ints(size, 1), idx=torch.arange(size, device=device), buf=ints(size, cols),
                   lp_buf=torch.zeros(size, cols, dtype=torch.float32, device=device),
                   plan=plan.padded(size, capacity), params=params.padded(size), capacity=capacity,
                   bitmask=None if mask_width is None else torch.full((size, mask_width), -1, dtype=torch.int32,
                                                                      device=device),
                   states=None if automata is None else ints(size), automata=automata, recorder=recorder,
                   done=torch.zeros(size, dtype=torch.bool, device=device), alive=ints(1))

    @property
    def rows(self) -> int:
        return self.input_ids.numel()

    def fits(self, plan, width: int) -> bool:
        """A phase of this key with ``plan`` and ``width`` steps can run in these buffers."""
        return width <= self.buf.shape[1] and _fits(self.capacity, plan.sizes())

    def load(self, *, input_ids, slots, slot_limit, jump, steps, plan, params, states=None, recorded=None) -> None:
        """Copy one phase's values in (its rows first; see the module doc for the padding rows, whose
        automaton state is free); ``recorded``: the rows whose queries the recorder keeps."""
        n = input_ids.numel()
        for mine, theirs, rest in ((self.input_ids, input_ids, 0), (self.steps, steps, 0), (self.jump, jump, 1),
                                   (self.slots, slots, slot_limit[:1]), (self.slot_limit, slot_limit, slot_limit[:1])):
            mine[:n].copy_(theirs)
            if n < self.rows:
                mine[n:].copy_(rest) if torch.is_tensor(rest) else mine[n:].fill_(rest)
        self.column.zero_()
        self.done.zero_()
        self.plan.load(plan)
        self.params.load(params)
        if self.bitmask is not None:
            self.bitmask.fill_(-1)
        if self.states is not None:
            self.states.zero_()
            self.states[:n].copy_(states)
        if self.recorder is not None:
            self.recorder.load(recorded or [])

    def own_bytes(self) -> int:
        """Memory this phase keeps for itself (its graphs' temporaries are in the shared pool)."""
        tensors = [self.buf, self.lp_buf, self.bitmask, *self.logits.values(),
                   None if self.recorder is None else self.recorder.q]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PhaseGraphs:
    """Kept phases by :func:`phase_key`, least recently used first, and the memory pool their graphs share."""

    def __init__(self, budget: int = KEPT_BYTES) -> None:
        self.budget = budget
        self.kept: OrderedDict[int, tuple[tuple, PhaseBuffers]] = OrderedDict()  # serial -> (key, buffers)
        self._serial = 0
        self._pool = None
        self.hits = self.misses = 0

    def pool(self):
        """The memory pool of kept graphs: a new one when no kept graph is left (a pool whose graphs are
        all gone is freed, and its handle cannot be captured into again) or a failed capture left it stuck."""
        graphs_left = any(b.graphs for _, b in self.kept.values())
        if self._pool is None or not graphs_left or not cuda_graph.usable(self._pool):
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def get(self, key: PhaseKey, *fit) -> PhaseBuffers | None:
        """Kept buffers of ``key`` that fit (``fits(*fit)``: a phase's plan and width, a mixed step's plan, see
        :mod:`~treegen.runtime.mixed_graphs`), the most recently used first."""
        for serial in reversed(self.kept):
            their_key, kept = self.kept[serial]
            if their_key == key and kept.fits(*fit):
                self.kept.move_to_end(serial)
                self.hits += 1
                return kept
        return None

    def add(self, key: PhaseKey, buffers: PhaseBuffers) -> PhaseBuffers:
        """Keep ``buffers`` under ``key``; phases of an older KV pool or older token-automata tables (they
        can never match again) and the least recently used beyond the budget are dropped."""
        self.misses += 1
        def stale(their: PhaseKey) -> bool:  # an older KV pool, or older token-automata tables
            if their.pool_generation != key.pool_generation:
                return True
            both = their.automata_generation is not None and key.automata_generation is not None
            return both and their.automata_generation != key.automata_generation

        for serial in [s for s, (k, _) in self.kept.items() if stale(k)]:
            del self.kept[serial]
        self._serial += 1
        self.kept[self._serial] = (key, buffers)
        self.trim()
        return buffers

    def trim(self) -> None:
        """Drop the least recently used phases while their own memory exceeds the budget (never the newest)."""
        while len(self.kept) > 1 and sum(b.own_bytes() for _, b in self.kept.values()) > self.budget:
            self.kept.popitem(last=False)
