"""A run over one sharing tree: :class:`TreeRun` (the engine's loop) and :class:`PassPlan`.

:meth:`Engine.start <treegen.runtime.engine.Engine.start>` opens a :class:`TreeRun`: a sharing tree
plus the KV store for its nodes. The language layer grows the tree and submits generation and scoring
requests (:meth:`TreeRun.submit`); :meth:`TreeRun.advance` runs the engine's loop until at least one
job completes, so a program resumes as soon as its own work is done while the others keep decoding.
Each step of the loop is decided by the :class:`~treegen.runtime.scheduler.Scheduler` (admission by
KV memory, which new tokens to prefill) and run here:

* a step with new work is one forward pass over every live branch's next token **and** the new
  tokens of admitted jobs' nodes (each node prefilled once however many branches lie below it; a
  child's tokens attend to their ancestors' KV through the tree-attention decomposition); new gens
  draw their first token from it, ``select`` choices are scored from it (length-normalised
  log-probability);
* a step whose only rows are its new gens' conditioning tokens (a program forking right after a gen,
  as a search expanding its thoughts does) runs no step of its own: the gens join the next decode
  phase at its first step (:meth:`TreeRun.joins_phase`);
* otherwise the live branches decode in phases planned once and captured as CUDA graphs
  (:mod:`~treegen.runtime.decode`); finished branches leave, new work joins when the scheduler ends
  the phase.

The last sampled token of a branch is appended to its node without KV; it is computed when the
branch continues. An EOS that ends a gen is not appended at all (``GenResult.context``: later text
follows the gen's text; the EOS is the last of the result's ``tokens``). When a request's conditioning
token already has KV (e.g. a fork after a finished phase), that token is run again as a query and writes
the identical KV into its own slot.
:meth:`TreeRun.execute` is the static special case: submit everything, run until all is done.
"""


from __future__ import annotations

import dataclasses
import gc
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from treegen.kernels.tree_attention import (TreeAttentionPlan, library_copy, library_copy_bytes, plan_tree_attention,
                                            tree_attention, tree_lse_reference)
from treegen.runtime import swa
from treegen.runtime.collector import full_collections_paused
from treegen.runtime.decode import Decoder
from treegen.runtime.device_memory import activation_margin, device_free
from treegen.runtime.kv_store import KVStore
from treegen.runtime.mixed_step import MixedSteps
from treegen.runtime.requests import GenRequest, GenResult, Job, ScoreRequest
from treegen.runtime.scheduler import KVBudget, Scheduler, conditioning_row
from treegen.runtime.token_automata import FREE
from treegen.tree.sharing_tree import SharingTree

__all__ = ["PassPlan", "TreeRun"]


@dataclass(frozen=True)
class PassPlan:
    """The tree-attention plans of one forward pass: one per kind of attention among the model's layers
    (full, or a sliding window of some size: Mistral, Gemma 2/3's local layers), all sharing one
    ``query_pos`` tensor, which a decode phase advances in place between steps.

    ``by_window``: window (None: full attention) → plan; ``layer_window[i]``: layer i's window."""

    by_window: dict[int | None, TreeAttentionPlan]
    layer_window: tuple[int | None, ...]
    # reference-backend plans of the same pass, for rows' LSEs (attention sinks: the model's needs_row_lse),
    # where by_window's are the Triton kernels' (which carry no levels); None: by_window's serve
    lse_by_window: dict[int | None, TreeAttentionPlan] | None = None

    @property
    def query_pos(self) -> torch.Tensor:
        return next(iter(self.by_window.values())).query_pos

    @property
    def backend(self) -> str:
        return next(iter(self.by_window.values())).backend

    def layer(self, i: int) -> TreeAttentionPlan:
        return self.by_window[self.layer_window[i]]

    def lse_layer(self, i: int) -> TreeAttentionPlan:
        """Layer ``i``'s plan for :func:`~treegen.kernels.tree_attention.tree_lse_reference` (reference levels)."""
        plan = (self.lse_by_window or self.by_window)[self.layer_window[i]]
        if plan.backend != "reference":  # (its levels are empty: every LSE would read -inf, every output 0)
            raise RuntimeError("rows' LSEs need reference plans of the pass (PassPlan.lse_by_window), which this "
                               f"{plan.backend} plan lacks (a padded plan of kept graphs carries none)")
        return plan

    def shape_key(self) -> tuple | None:
        """What a CUDA graph of a forward pass with this plan fixes besides its tables: every window's
        plan's (:meth:`TreeAttentionPlan.shape_key`); None when one cannot be padded."""
        keys = tuple(p.shape_key() for p in self.by_window.values())
        return None if None in keys else keys

    def sizes(self) -> tuple:
        """Every window's plan's table lengths (:meth:`TreeAttentionPlan.sizes`)."""
        return tuple(p.sizes() for p in self.by_window.values())

    def padded(self, num_queries: int, capacity: tuple) -> "PassPlan":
        """Empty plans for ``num_queries`` query rows (this plan's and more) at ``capacity`` (as
        :meth:`sizes`), sharing one position tensor, to be filled by :meth:`load`."""
        query_pos = torch.zeros(num_queries, dtype=torch.int64, device=self.query_pos.device)
        return PassPlan({w: p.padded(num_queries, c, query_pos) for (w, p), c in zip(self.by_window.items(), capacity)},
                        self.layer_window)

    def load(self, plan: "PassPlan") -> None:
        """Copy ``plan`` (of an equal shape key) into this :meth:`padded` one; extra rows at position 0."""
        n = plan.query_pos.numel()
        self.query_pos[:n].copy_(plan.query_pos)
        self.query_pos[n:].zero_()
        for mine, theirs in zip(self.by_window.values(), plan.by_window.values()):
            mine.load(theirs)


def join_enabled() -> bool:
    """Gens whose only row is their conditioning token join a decode phase at its first step
    (:meth:`TreeRun.joins_phase`) unless ``TREEGEN_JOIN_PHASES=0``."""
    return os.environ.get("TREEGEN_JOIN_PHASES", "1") != "0"


# garbage beyond the engine's weights and this run's pool that makes kv_budget collect once (see there)
_FINISHED_RUN_BYTES = 2**30


class TreeRun(MixedSteps):
    """One sharing tree, the KV of its nodes, and the jobs running over it (see the module doc)."""

    def __init__(self, engine) -> None:
        """``engine``: the :class:`~treegen.runtime.engine.Engine` whose model and settings this run uses."""
        self.engine = engine
        self.model = engine.model
        self._reclaimed = False  # kv_budget collected finished runs' garbage once (see there)
        self.tree = SharingTree()
        m = self.model
        self.kv = KVStore(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                          dtype=m.dtype, device=m.device, fmt=engine.kv_format, arena=engine.host_arena)
        self.scheduler = Scheduler(self.tree, self.kv, self.kv_budget, engine.max_prefill_tokens, engine.max_batch,
                                   offload=engine.offload_policy(), kv_keep_every=engine.kv_keep_every,
                                   slice_tokens=engine.slice_tokens)
        self.decoder = Decoder(self)
        self.forward_passes = 0
        self.decode_phases: list[int] = []  # live branches of each decode phase, in order
        # forward passes of each decode phase that ran to its end (a branch's row computes every one, also
        # after it finished): with decode_phases, the rows the phases computed
        self.phase_passes: list[int] = []
        self.phase_capture_seconds: list[float] = []  # host seconds each of them spent capturing (0: replayed kept graphs)
        self.mixed_steps = 0  # forward passes that prefilled new work (with the live branches' decode rows)
        # wall seconds of those steps, whole: planned, run (launched uncaptured, or replayed), tokens drawn and read
        self.mixed_seconds = 0.0
        # mixed steps run in kept buffers, and those of them in buffers an earlier one made (see mixed_graphs; on
        # CUDA the others were captured as graphs, these replayed one)
        self.mixed_kept = self.mixed_reused = 0
        self.prefill_rows = 0  # token rows those passes ran besides decode rows (new tokens, conditioning tokens)
        self.phase_joins = 0  # gens that joined a decode phase at its first step, with no mixed step (see joins_phase)
        # whether they may (read once a run: a tensor-parallel worker's mirror run is given rank 0's, see mirror)
        self.join_phases = join_enabled()
        # scheduling calls (between decode phases only: host_seconds["schedule"] is spent in these, not spread
        # over every step)
        self.schedule_calls = 0
        self._phase = None  # the running decode phase (a generator), if any
        self._mixed_in_row = 0  # steps in a row that prefilled new work (0: the last step did not; see advance)
        # host time by kind (seconds): scheduling, planning phases, capturing their CUDA graphs (which
        # runs the first step), reading sampled tokens, running program code (batch driver)
        self.host_seconds = {"schedule": 0.0, "plan": 0.0, "capture": 0.0, "accept": 0.0, "programs": 0.0,
                             "swa": 0.0}
        # sparse window attention: compactions run, KV tokens dropped; swa_log (None: off) = {} records
        # each compaction as node -> [(tokens accounted for, token indices kept), ...]
        self.swa_compactions = self.swa_dropped = 0
        self.swa_log: dict | None = None
        self._completed: list[Job] = []

    # jobs ----------------------------------------------------------------------------------------
    def submit(self, request: GenRequest | ScoreRequest, on_done=None, on_tokens=None) -> Job:
        """Queue a request; it runs when :meth:`advance` is called. Returns its :class:`Job`.
        Raises at once for a request that can never run (a gen into a node with children, or past
        the model's context)."""
        if isinstance(request, GenRequest):
            tree = self.tree
            if tree.children(request.node):
                raise RuntimeError(f"gen into node {request.node}, which has children")
            total = tree.path_length(request.node) + request.params.max_tokens
            if total > self.model.max_context:
                raise ValueError(f"a branch would reach {total} tokens (prompt + max_tokens={request.params.max_tokens}), "
                                 f"past the model's context of {self.model.max_context}")
            if request.params.constraint is not None:
                if not self.model.eos_token_ids:
                    raise ValueError(f"a constrained gen ({request.params.constraint}) ends on an EOS token, "
                                     "and this model has none")
                if self.engine.automaton(request.params.constraint) is None:  # (built once, before it runs)
                    self.engine.grammars.compile(request.params.constraint)  # (xgrammar's: compiled once)
            if request.params.kv_keep is None and self.engine.kv_keep is not None:  # the engine's default
                request = dataclasses.replace(request, params=dataclasses.replace(request.params,
                                                                                  kv_keep=self.engine.kv_keep))
            if request.params.kv_keep is not None:
                self.engine.check_swa(f"gen into node {request.node} with kv_keep={request.params.kv_keep}")
            request = self._jump_forward(request)  # (last: it writes on the node, once the request is known good)
        elif not isinstance(request, ScoreRequest):
            raise TypeError(f"submit expects a GenRequest or ScoreRequest, got {type(request).__name__}")
        job = Job(request, on_done=on_done, on_tokens=on_tokens)
        self.scheduler.submit(job)
        return job

    def _jump_forward(self, request: GenRequest) -> GenRequest:
        """A constrained gen with jump-forward on (its own setting, else the engine's): the tokens its
        constraint forces from the start (at most ``max_tokens - 1``) go on its node now — prefilled with the
        prompt — and on the request (``forced``), which the decoder counts as the gen's first tokens."""
        params = request.params
        on = self.engine.jump_forward if params.jump_forward is None else params.jump_forward
        if not on or params.constraint is None:
            return request
        forced = self.engine.grammars.forced_prefix(params.constraint)[:params.max_tokens - 1]
        automaton = self.engine.automaton(params.constraint)
        if automaton is not None and self.engine.automata.walk(automaton.initial, forced) == FREE:
            forced = ()  # (a tokenization its token automaton does not take: none is forced)
        if not forced:
            return request
        self.tree.extend(request.node, forced)  # (within the context checked: they count in max_tokens)
        return dataclasses.replace(request, forced=forced)

    def busy(self) -> bool:
        """Jobs are waiting, prefilling or decoding."""
        return self._phase is not None or bool(self.decoder.live) or self.scheduler.has_work()

    def wants_work(self, rows: int) -> bool:
        """Whether more work would find room now: fewer than ``rows`` branches decode or wait for admission,
        and the last admission did not stop for want of memory (what decides when the next input of a batch
        whose inputs arrive as it runs is started: :mod:`treegen.lang.arrivals`)."""
        s = self.scheduler
        return len(self.decoder.live) + len(s.waiting) + len(s.admitted) < rows and not (s.memory_blocked and s.waiting)

    def advance(self, until: Callable[[], bool] | None = None) -> list[Job]:
        """Run the engine's loop until at least one job completes; returns the jobs that did (their
        ``on_done`` already called). An empty list: nothing is left to run — or ``until()`` became true
        (asked between steps: new work has come, e.g. an input of a batch whose inputs arrive as it runs)."""
        with full_collections_paused():  # (see treegen.runtime.collector)
            return self._advance(until)

    def _advance(self, until: Callable[[], bool] | None = None) -> list[Job]:
        while not self._completed:
            if until is not None and until():
                break
            if self._phase is not None:
                try:
                    next(self._phase)
                except StopIteration:
                    self._phase = None
                continue
            live = len(self.decoder.live)
            if self._mixed_in_row and live and (not self.scheduler.phase_should_end(live, live) or (
                    self._mixed_in_row >= swa.MIXED_STEPS and self.decoder.sparse_window_live())):
                # new work arrived during the last mixed step, too little to be worth another
                # uncaptured step before the live branches decode on: it joins when the phase ends
                # (and sparse-window branches compact after at most MIXED_STEPS: what they reserve)
                self._mixed_in_row = 0
                self._phase = self.decoder.phase()
                continue
            t0 = time.perf_counter()
            step = self.scheduler.next_step(live, [self.decoder.jobs[b].request.node for b in self.decoder.live])
            self.host_seconds["schedule"] += time.perf_counter() - t0
            self.schedule_calls += 1
            for job in step.refused:
                if job in self.decoder.paused:  # (a paused gen refused on its way back: its branch's state goes)
                    self.decoder.cancel(job)
                self.complete(job, None)
            self._mixed_in_row = self._mixed_in_row + 1 if step.runs_model else 0
            if step.runs_model and self.joins_phase(step):
                # its gens join the live branches at the next phase's first step: no step of their own
                self._mixed_in_row = 0
                self.phase_joins += sum(not job.done for job in step.ready)
                self._phase = self.decoder.phase(step.ready)
            elif step.runs_model:
                t0 = time.perf_counter()
                self._run_step(step)
                self.mixed_seconds += time.perf_counter() - t0
            elif self.decoder.live:
                self._phase = self.decoder.phase()
            elif not step.refused:
                if self.scheduler.has_work():  # the scheduler refuses what cannot fit when nothing runs
                    raise RuntimeError("the engine has waiting jobs but nothing it can run (a scheduler bug)")
                break
        done, self._completed = self._completed, []
        return done

    def joins_phase(self, step) -> bool:
        """Whether ``step``'s work joins the next decode phase at its first step rather than run as a mixed step
        (:meth:`Decoder.phase <treegen.runtime.decode.Decoder.phase>`'s ``joining``): gens only, none with
        sparse window attention, whose rows are only their conditioning tokens — nothing to prefill, as when a
        program forks right after a gen (a search expanding its thoughts). Such a mixed step is nearly a
        decode step, yet ran uncaptured or in a mixed graph of its own shape and drained the GPU while its
        tokens were read (measured: 21 ms against a 9.5 ms decode step, tree-of-thought at 256 branches,
        TinyLlama shape on an H200). Off with ``TREEGEN_JOIN_PHASES=0`` when the run starts (for measuring what it
        saves). A ready job already done (cancelled: its program failed at this step's callbacks) is not one."""
        if not step.ready or not self.join_phases:
            return False
        tree = self.tree
        conditioning = set()
        for job in step.ready:
            if not job.is_gen or job.request.params.kv_keep is not None:
                return False
            if not job.done:
                conditioning.add(conditioning_row(tree, job.request.node))
        return all(r in conditioning for r in step.rows)

    @property
    def offload_stats(self) -> dict:
        """KV moved to the host and back, dropped and recomputed during this run, and the time it took
        (:class:`~treegen.runtime.kv_host.OffloadCounters`)."""
        return self.kv.counters.as_dict()

    def cancel(self, job: Job) -> None:
        """Drop a job that is not done: a waiting or admitted one leaves the queue, a decoding
        branch leaves the batch (a running phase computes its row until it ends, unread). Its
        ``on_done`` is not called; the KV it holds stays until its owner frees it."""
        if job.done:
            return
        job.done = True
        job.error = RuntimeError("cancelled")
        # (a paused branch's job waits in the scheduler's queue, its state in the decoder: both let it go)
        if not self.scheduler.cancel(job) or job in self.decoder.paused:
            self.decoder.cancel(job)

    def complete(self, job: Job, result) -> None:
        """Record a job's result (``job.error`` set: refused) and tell its submitter."""
        job.result, job.done = result, True
        self._completed.append(job)
        if job.on_done is not None:
            job.on_done(job)

    def execute(self, gens: list[GenRequest], scores: list[ScoreRequest]) -> tuple[list[GenResult], list[list[float]]]:
        """Run these requests to completion (the static case: everything known up front); returns
        the generations and the choice scores in request order. A refused request raises its error."""
        jobs = [self.submit(r) for r in [*gens, *scores]]
        while not all(j.done for j in jobs) and self.advance():
            pass
        for j in jobs:
            if j.error is not None:
                raise j.error
        return [j.result for j in jobs[: len(gens)]], [j.result for j in jobs[len(gens):]]

    # ---------------------------------------------------------------------------------------------
    def can_split(self, node: int, length: int) -> bool:
        """Whether :meth:`split` may divide ``node`` after its first ``length`` tokens now: a node with children
        (never generated into) whose KV, if any, is dense, on the device and holds slots past ``length``."""
        return bool(self.tree.children(node)) and 0 < length < len(self.tree.tokens(node)) and \
            self.kv.can_split(node, length)

    def split(self, node: int, length: int) -> int:
        """Put a new node holding ``node``'s first ``length`` tokens above it, in the tree and in the KV
        store (the slots of those tokens become the new node's; nothing is copied or computed again), so
        that a later program sharing only those tokens can attach below it (radix reuse,
        :meth:`~treegen.lang.program_run.ProgramRun.attach`). Returns the new node. Jobs already queued
        see the new path when they are next looked at (their rows are read from the tree each step); a
        running decode phase keeps its plan, which reads the same slots as one segment."""
        if not self.can_split(node, length):
            raise RuntimeError(f"node {node} cannot be split after {length} tokens now (a leaf, its KV on the host, "
                               f"sparse or without slots there, or the length out of its range)")
        head = self.tree.split(node, length)
        self.kv.split(node, head, length)
        used = self.scheduler.last_used.get(node)
        if used is not None:
            self.scheduler.last_used[head] = used
        return head

    def free(self, node: int) -> None:
        """Drop a node's KV and mark it (and its subtree) pruned."""
        subtree = self.tree.subtree(node)
        for n in subtree[:1] + sorted(subtree[1:]):
            self.kv.free(n)
        self.tree.prune(node)

    def plan_rows(self, rows: list[tuple[int, int]], grow: dict[int, int] | None = None,
                  query_nodes: list[int] | None = None):
        """Inputs and attention plan for running the (node, index) token ``rows`` through the model.

        Every node on a row's path must already have its KV or have all its missing rows here.
        ``grow``: node → extra keys it may gain during a decode phase; its segment is planned that
        long (keys not yet written sit at positions after every query, so attention masks them).
        ``query_nodes``: the node whose segment each row's query sits in (None: the row's own). A gen that
        joins a decode phase runs its conditioning token — the last of an ancestor, at the position just
        before its own empty node — as a query of that node, whose segment grows as it decodes.
        Returns ``(input_ids [T], slots [T], plan)``: a :class:`PassPlan` (one plan per window size
        among the layers); ``plan.query_pos`` holds the positions [T].

        A segment that sparse window attention compacted (``dropped`` tokens, :mod:`treegen.runtime.swa`)
        holds its kept keys in its first slots: token ``i`` written since goes to slot ``i - dropped``,
        and the plan gives the segment the *mask* position ``node position + dropped``, so its written
        keys sit just before the next query and the unwritten tail after it. The queries keep their
        true positions (``query_pos`` is also their RoPE position; the keys were stored after RoPE at
        theirs), so only the mask of that one segment moves — which is why sliding-window layers, whose
        mask compares true distances, are refused with SWA.
        """
        tree, kv, model = self.tree, self.kv, self.model
        held = kv.segments
        grow = grow or {}
        new_len: dict[int, int] = {}  # tokens of each row's node accounted for after this pass
        for n, i in rows:
            if n in new_len:
                if i + 1 > new_len[n]:
                    new_len[n] = i + 1
            else:
                seg = held.get(n)
                new_len[n] = max(seg.tokens if seg else 0, i + 1)
        compacted = {n: seg.dropped for n in new_len if (seg := held.get(n)) is not None and seg.dropped}
        for n, i in rows if compacted else ():
            if i < compacted.get(n, 0):
                raise RuntimeError(f"token {i} of node {n} is among the {compacted[n]} whose KV sparse window "
                                   "attention dropped; it cannot be run again")
        # every node on the rows' (and queries') paths, and where it starts
        pos = tree.positions(new_len if query_nodes is None else [*new_len, *query_nodes])
        segments = sorted(pos)
        offloaded, tokens = kv.offloaded, tree.tokens
        # each segment's (KV length, dropped tokens): the rows' nodes as above, reserved for what they may
        # gain; every other one (an ancestor: most of a decode phase's thousands) must hold all its tokens
        length_of: dict[int, int] = {}
        drop: dict[int, int] = {}
        for s in segments:
            if s in offloaded:
                raise RuntimeError(f"node {s} is read while its KV is on the host (a scheduling bug)")
            seg = held.get(s)
            d = drop[s] = seg.dropped if seg else 0
            if s in new_len:
                length = new_len[s]
                kv.reserve(s, max(length - d + grow.get(s, 0), 1))
            else:
                length = seg.tokens if seg else 0
                if length != len(tokens(s)):
                    raise RuntimeError(f"node {s} is missing KV for {len(tokens(s)) - length} tokens")
                if seg is None:  # (an empty node is given one slot)
                    kv.reserve(s, 1)
            length_of[s] = length - d
        index = {s: j for j, s in enumerate(segments)}
        device = model.device
        query_pos = [pos[n] + i for n, i in rows]
        # one host-to-device copy: the token ids, their slots and positions (the last shared by every window's plan)
        input_ids, slots, query_pos_buffer = torch.tensor(
            [[tokens(n)[i] for n, i in rows], [held[n].start + i - drop[n] for n, i in rows], query_pos],
            dtype=torch.int64).reshape(3, len(rows)).to(device)
        layer_window = tuple(model.layer_window)

        shape = dict(
            segment_parent=[index.get(tree.parent(s), -1) for s in segments],
            segment_start=[held[s].start for s in segments],
            segment_len=[length_of[s] + grow.get(s, 0) for s in segments],
            segment_pos=[pos[s] + drop[s] for s in segments],
            query_segment=[index[n] for n, _ in rows] if query_nodes is None else [index[n] for n in query_nodes],
            query_pos=query_pos,
            query_pos_buffer=query_pos_buffer,  # (one tensor: a decode phase advances it in place)
            device=device,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            dtype=model.dtype,  # the queries' dtype (an 8-bit cache's large shared segment is dequantized to it)
            kv_quantized=kv.format.quantized,
            softcap=model.attn_softcap,
        )

        def plans(backend: str) -> dict:
            return {window: plan_tree_attention(**shape, backend=backend, window=window)
                    for window in dict.fromkeys(layer_window)}

        by_window = plans(self.engine.attention_backend)
        lse_plans = None
        if getattr(model, "needs_row_lse", False) and next(iter(by_window.values())).backend != "reference":
            lse_plans = plans("reference")
        plan = PassPlan(by_window, layer_window, lse_plans)
        for s in new_len:  # (an ancestor's KV is whole already)
            seg = held[s]
            seg.computed = max(seg.computed, new_len[s] - drop[s])
        return input_ids, slots, plan

    def library_copies(self, plan: PassPlan, written: list[int] = ()) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """For a decode phase (many steps of one plan): each layer's library segment of an 8-bit cache
        dequantized once (``tree_attention``'s ``library_kv``), so that its steps do not dequantize it
        every call (246 us a step at the Llama-3-8B shape, 256 branches x 2,047 keys, FP8; see
        :mod:`~treegen.kernels.library_attention`). The segment is shared, so no row of the phase writes
        it — save the first step's writes into ancestors of gens that join the phase (``written``: their
        slots): a layer whose library range holds one reads the cache. {} when no plan has a library
        segment, the cache holds the values themselves, or the copies (two of the segment's keys x KV heads
        x head dim in the model's dtype, every layer) do not fit in the device memory beyond the KV pool and
        the activations' margin: then each call dequantizes."""
        kv, model = self.kv, self.model
        if self.engine.attention == "none" or not kv.format.quantized:
            return {}

        def copied(library) -> bool:  # (a copy made before the first step would miss what it writes there)
            end = library.start + library.chunks * library.chunk_len
            return not any(library.start <= slot < end for slot in written)

        layers = [i for i in range(model.num_layers) if plan.layer(i).triton is not None
                  and plan.layer(i).triton.library is not None and copied(plan.layer(i).triton.library)]
        if not layers:
            return {}
        if kv.device.type == "cuda":
            need = sum(library_copy_bytes(plan.layer(i), kv.layer(i)[0], model.dtype) for i in layers)
            free, total = device_free(kv.device)
            if need > free - activation_margin(total):
                return {}
        return {i: library_copy(plan.layer(i), *kv.layer(i), model.dtype) for i in layers}

    def attend_fn(self, plan, slots: torch.Tensor, recorder=None, library_kv: dict | None = None):
        """The per-layer ``attend`` callback: write the new keys/values at ``slots``, then attend.
        ``recorder``: a :class:`~treegen.runtime.swa.QueryRecorder` keeping the SWA rows' queries.
        ``library_kv``: :meth:`library_copies` of ``plan`` (layer → keys/values; None or a missing layer:
        the library segment reads the cache)."""
        kv, scale = self.kv, self.model.attn_scale
        library_kv = library_kv or {}
        if self.engine.attention == "none":
            def skip(layer, q, k, v):  # benchmark ceiling: no KV traffic, no attention
                return q

            skip.lse = lambda layer, q: torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
            return skip

        def attend(layer: int, q, k, v):
            kv.wait_layer(layer)  # KV copied back from the host for this step: this layer's copies first
            if recorder is not None:
                recorder.record(layer, q)
            if k is not None:  # else the model wrote them already (see cache below)
                kv.write(layer, slots, k, v)
            k_cache, v_cache, k_scale, v_scale = kv.layer(layer)
            return tree_attention(q, k_cache, v_cache, plan.layer(layer), scale, k_scale, v_scale,
                                  library_kv.get(layer))

        def cache(layer: int):
            """Where this pass's keys/values go: the model's fused RoPE kernel writes (and, for an 8-bit
            cache, quantizes) them there directly — ``(k_cache, v_cache, slots[, k_scale, v_scale])``."""
            kv.wait_layer(layer)  # (before the write: the slots may have held offloaded KV still being copied)
            k_cache, v_cache, k_scale, v_scale = kv.layer(layer)
            return (k_cache, v_cache, slots) + ((k_scale, v_scale) if k_scale is not None else ())

        def lse(layer: int, q):
            """Each query row's log-sum-exp over the keys it sees in ``layer`` (after ``attend`` wrote this pass's
            keys), ``[rows, heads]`` fp32: what attention sinks (gpt-oss) rescale the output by. A second pass
            over the keys (no values), PyTorch's."""
            k_cache, _, k_scale, _ = kv.layer(layer)
            return tree_lse_reference(q, k_cache, plan.lse_layer(layer), scale, k_scale)

        attend.cache = cache
        attend.lse = lse
        return attend

    def _forward(self, rows: list[tuple[int, int]], logits_rows: list[int], gather: bool = True,
                 pad_ends: tuple | None = None) -> torch.Tensor:
        """Run the model on the (node, index) token rows → fp32 logits [len(logits_rows), vocab].

        Rows are taken in order (parents before children) in chunks of at most
        ``engine.max_prefill_tokens``, so activations stay bounded however large the prefill.
        ``gather=False``: of a head split by vocabulary, this rank's columns only (``model.forward``).
        ``pad_ends``: a mixed step's decode rows and new gens (:meth:`_pad_slot`'s arguments): a pass of one chunk
        may then run in kept buffers, as a kept graph (:mod:`~treegen.runtime.mixed_graphs`)."""
        chunk = self.engine.max_prefill_tokens
        parts, taken = [], []
        for begin in range(0, len(rows), chunk):
            input_ids, slots, plan = self.plan_rows(rows[begin : begin + chunk])
            mine = [i for i, r in enumerate(logits_rows) if begin <= r < begin + chunk]
            wanted = torch.tensor([logits_rows[i] - begin for i in mine], dtype=torch.int64, device=self.model.device)
            kept, pad_slot = self._kept_mixed(plan, input_ids.numel(), len(mine), gather, pad_ends) \
                if pad_ends is not None and len(rows) <= chunk else (None, None)
            if kept is not None:
                parts.append(self._run_kept_mixed(kept, input_ids, slots, pad_slot, wanted, plan, gather))
            else:
                parts.append(self.model.forward(input_ids, plan.query_pos, self.attend_fn(plan, slots), wanted,
                                                gather=gather))
            self.kv.wait_restores()  # (every layer waited already; nothing is pending afterwards)
            taken += mine
            self.forward_passes += 1
        if len(taken) != len(logits_rows):
            raise ValueError("logits_rows must name rows of this forward pass")
        split = self.model.vocab_split
        width = self.model.vocab_size if gather or split is None else split.width
        logits = torch.cat(parts) if parts else torch.empty(0, width, device=self.model.device)
        out = torch.empty_like(logits)
        out[torch.tensor(taken, dtype=torch.int64, device=logits.device)] = logits
        return out

    def prefill(self, nodes: list[int]) -> dict[int, torch.Tensor]:
        """Compute the KV of every pending token on the paths of ``nodes`` in one forward pass.

        Returns, for each node in ``nodes``, the fp32 logits of its newly computed tokens
        ``[new tokens of that node, vocab]`` (row i predicts the token after the node's i-th new one).
        Forcing tokens this way (append, prefill, repeat) is how tests compare with Hugging Face.
        """
        pending = sorted({p for n in nodes for p in self.tree.path(n) if self.kv.computed(p) < len(self.tree.tokens(p))})
        rows = [(n, i) for n in pending for i in range(self.kv.computed(n), len(self.tree.tokens(n)))]
        chosen = set(nodes)
        wanted = [j for j, (n, _) in enumerate(rows) if n in chosen]
        logits = self._forward(rows, wanted) if rows else None
        per_node: dict[int, list[int]] = {n: [] for n in nodes}
        for k, j in enumerate(wanted):
            per_node[rows[j][0]].append(k)
        empty = torch.empty(0, self.model.vocab_size)
        return {n: logits[idx] if idx else empty for n, idx in per_node.items()}

    # ---------------------------------------------------------------------------------------------
    def kv_budget(self) -> KVBudget:
        """The KV memory this run may use now. On CUDA: its slot pool plus what the device has free
        (cached blocks it can give back included: :func:`~treegen.runtime.device_memory.device_free`) less
        a margin for activations — less a copy of the pool's largest tensor (keys or values) once KV is
        written, because a grown pool is a copy made while the old one is still held (so admitting work
        never needs memory the device cannot give); at most ``engine.kv_budget_bytes`` when set. On the
        CPU: ``engine.kv_budget_bytes`` (None: no limit)."""
        kv, engine = self.kv, self.engine
        if kv.device.type != "cuda":
            return KVBudget(engine.kv_budget_bytes, kv.bytes_per_token)
        pool = kv.num_slots * kv.bytes_per_token
        free, total = device_free(kv.device)
        allocated = torch.cuda.memory_allocated(kv.device)
        if not self._reclaimed and free < total // 2 and allocated - engine.idle_allocated - pool > _FINISHED_RUN_BYTES:
            # An earlier run its caller dropped may still hold its KV pool: a run is a reference cycle
            # (run <-> decoder), freed only by the cycle collector, whose full collections are rare (paused
            # during batches, treegen.runtime.collector). Seen on an H200: a run of branches 1.3x the GPU's
            # memory, then a small run refused its work ("more than the whole KV budget of 1024 tokens").
            # With the device half full of more than the weights and this pool, collect once per run.
            self._reclaimed = True
            gc.collect()
            free, total = device_free(kv.device)
        room = int(free - activation_margin(total)) - (kv.grow_copy_bytes() if kv.written() else 0)
        reachable = pool + max(0, room)
        if engine.kv_budget_bytes is not None:
            reachable = min(reachable, engine.kv_budget_bytes)
        if engine.parallel is not None:  # every rank of a replica admits the same work: the smallest budget
            reachable = engine.parallel.tensor.agree_min(reachable, kv.device)
        return KVBudget(reachable, kv.bytes_per_token)
