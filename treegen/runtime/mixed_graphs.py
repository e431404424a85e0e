"""Mixed steps' forward passes captured as CUDA graphs and kept, as decode phases' are (:mod:`phase_graphs`).

A *mixed step* (a forward pass that prefills new work beside the live branches' decode rows,
:mod:`~treegen.runtime.mixed_step`) runs uncaptured, and launching its kernels costs the host far more than the GPU
needs to run them: measured on an H100 host, TinyLlama's 22 layers took 18-21 ms to launch while the step's
GPU work was a few ms, at each of a tree-of-thought search's 23 phase boundaries
(``benchmarks/profile_dynamic_host.py``). Mixed steps of one run often have the same shape: of those 23,
12 had the rows bucket and attention-plan shape of an earlier one with tables that fit its kept capacity.

So a mixed step whose plan can be padded (:meth:`~treegen.runtime.tree_run.PassPlan.shape_key`) runs in
:class:`MixedBuffers` at padded sizes — its token rows rounded up by :func:`~treegen.runtime.phase_graphs.bucket`,
the rows whose logits it returns too, the attention plan's tables half again as large — and its forward is
captured once per :class:`MixedKey` and replayed by later mixed steps that fit. Padding rows feed token 0 at
position 0 and attend to nothing (no work item names them); their keys and values are written to one slot
that holds no KV while the step runs (``pad_slot``: the last reserved slot of a generating branch's node,
past every token that branch can have by then, see ``MixedSteps._pad_slot``); their logits are never read. (Their
attention output is never written, so what they write there may not be finite: nothing reads it — every kernel
reads keys only up to its rows' positions, and moves, offloads and compactions copy only written slots.)

Kept with the decode phases' buffers (one :class:`~treegen.runtime.phase_graphs.PhaseGraphs`: one memory
pool, one budget of kept memory, which counts a step's logits but not its activations in the shared pool):
a mixed step's logits are read (copied out) right after its replay, before any other graph runs. Every new
key is captured (no rule yet for shapes that never recur). On unless ``TREEGEN_KEEP_MIXED_GRAPHS=0``: measured
on an H100 (TinyLlama, 256 branches, medians of 3 in one process), a tree-of-thought search's mixed steps took
18.5 ms against 25.5 uncaptured (11 of 22 replayed an earlier step's graph) and it ran at 0.89 of the static
fork's rate against 0.84; rounds 1.19 against 1.14 (``benchmarks/results/dynamic_tinyllama-1.1b_256_kept_mixed_ab_h100.json``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from treegen.runtime.phase_graphs import _fits, _room, bucket

# a mixed step of more token rows runs uncaptured (a kept graph keeps its activations in the shared pool)
MIXED_ROWS_MAX = 1024


def enabled() -> bool:
    """Keeping mixed steps' graphs is on unless ``TREEGEN_KEEP_MIXED_GRAPHS=0`` (for measuring what it saves)."""
    return os.environ.get("TREEGEN_KEEP_MIXED_GRAPHS", "1") != "0"


class MixedKey(NamedTuple):
    """What must be equal for two mixed steps to share a graph."""

    kind: str  # "mixed" (never equal to a decode phase's key)
    pool_generation: int  # the KV pool (the graph holds its addresses)
    rows: int  # padded token rows
    logits_rows: int  # padded rows whose logits the step returns
    gather: bool  # the whole logits, not this rank's vocabulary slice
    plan: tuple  # the plan's shape key
    automata_generation: None = None  # (PhaseGraphs drops keys of older token automata: a mixed step reads none)


def mixed_key(plan, *, rows: int, logits_rows: int, gather: bool, pool_generation: int) -> MixedKey | None:
    """The :class:`MixedKey` of a mixed step (None: it runs uncaptured — too many rows, or a plan that
    cannot be padded)."""
    if rows > MIXED_ROWS_MAX:
        return None
    plan_key = plan.shape_key()
    if plan_key is None:
        return None
    return MixedKey("mixed", pool_generation, bucket(rows), bucket(max(logits_rows, 1)), gather, plan_key)


@dataclass
class MixedBuffers:
    """A kept mixed step's inputs at padded sizes, its padded plan, and its graph's output."""

    input_ids: torch.Tensor  # [R] int64
    slots: torch.Tensor  # [R] int64: each row's KV slot (padding rows: the pad slot)
    logits_rows: torch.Tensor  # [L] int64: rows whose logits are returned (padding: row 0)
    plan: object  # the padded PassPlan (its query_pos: the rows' positions, padding rows 0)
    capacity: tuple = ()  # the plan's tables' (as PassPlan.sizes)
    graphs: dict = field(default_factory=dict)  # "forward" -> torch.cuda.CUDAGraph once captured (CUDA)
    logits: torch.Tensor | None = None  # [L, vocab] the forward's output, in the model's dtype

    @classmethod
    def allocate(cls, *, plan, rows: int, logits_rows: int, device) -> "MixedBuffers":
        capacity = _room(plan.sizes())
        size = bucket(rows)

        def ints(n):
            return torch.zeros(n, dtype=torch.int64, device=device)

        return cls(input_ids=ints(size), slots=ints(size), logits_rows=ints(bucket(max(logits_rows, 1))),
                   plan=plan.padded(size, capacity), capacity=capacity)

    def fits(self, plan) -> bool:
        """A mixed step of this key with ``plan`` can run in these buffers."""
        return _fits(self.capacity, plan.sizes())

    def load(self, *, input_ids, slots, pad_slot: int, logits_rows, plan) -> None:
        """Copy one mixed step's values in; padding rows get token 0, position 0 and ``pad_slot``."""
        n, m = input_ids.numel(), logits_rows.numel()
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:].zero_()
        self.slots[:n].copy_(slots)
        self.slots[n:].fill_(pad_slot)
        self.logits_rows[:m].copy_(logits_rows)
        self.logits_rows[m:].zero_()
        self.plan.load(plan)

    def own_bytes(self) -> int:
        """Memory kept for this step besides its graph's temporaries (its logits)."""
        return 0 if self.logits is None else self.logits.numel() * self.logits.element_size()


__all__ = ["MIXED_ROWS_MAX", "MixedBuffers", "MixedKey", "enabled", "mixed_key"]
