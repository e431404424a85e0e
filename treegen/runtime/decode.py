"""Decoding: every live branch of a tree run, one token per branch per step.

The :class:`Decoder` keeps one entry per generating branch (its job, the tokens drawn so far) for the
whole run; branches join when the step that computed their prompt drew their first token
(:meth:`Decoder.draw`) — or, when their conditioning token is the only one to run, at a decode phase's
first step (:meth:`Decoder.phase`'s ``joining``) — and leave when they finish.

Between steps that prefill new work, live branches decode in *phases*. A phase is a fixed set of
live branches, planned once: every branch's leaf segment is planned as long as it can grow in the
phase (keys not yet written sit at positions after every query, so the position mask hides them), so
each step only advances device tensors in place — the token fed, its position, its KV slot, the step
counter — and the same attention plan serves every step and layer. On CUDA the step is captured once
per phase as a CUDA graph and replayed.

The host looks at the generated tokens every ``sync_every`` steps (every step on the CPU): branches
that hit EOS, a stop string (looked for only where :mod:`~treegen.runtime.stop_strings`' test on the
block's text tails says one may be) or ``max_tokens`` are finished there, their extra tokens dropped, and
their jobs complete at once (the phase *yields*, so the caller can resume the programs waiting for
them while the GPU keeps going). On CUDA this is pipelined: a block's tokens are copied to the host
asynchronously and read while the next block's steps already run, so the decode loop never drains
the GPU (a finished branch may run one block longer; its extra tokens are dropped). The phase ends
when the scheduler says so (:meth:`~treegen.runtime.scheduler.Scheduler.phase_should_end`: at most
half the branches live — with nothing waiting, only once a captured phase has run a while — or enough
new work waiting); branches that take nothing more (``GenRequest.final``) free their KV then.

A *sliced* gen (the scheduler's slices: offload on, a bounded budget) owns only part of its tokens' KV
slots: a phase ends at the latest where its node's range does, and there — or in a step that prefills
other work — it takes its next slice from the scheduler (memory to spare) or *pauses*: it leaves the live
set with its tokens, log-probabilities and matcher state kept (``Decoder.paused``), its job waits in the
scheduler's queue, and when admitted again its pending last token is its conditioning row, from which
:meth:`Decoder.draw` continues the same branch.
Sampling is counter-based (see :mod:`treegen.runtime.sampler`), so a branch's tokens do not depend on phases, batch composition or
``sync_every``.
"""

from __future__ import annotations

import math
import time

import torch

from treegen.runtime import phase_graphs, swa
from treegen.runtime.constrained_steps import CONSTRAINED_PARTS, ConstrainedSteps
from treegen.runtime.cuda_graph import capture, capture_cold
from treegen.runtime.phase_graphs import PhaseBuffers, PhaseGraphs
from treegen.runtime.phase_io import RowSampling, TokenBlock
from treegen.runtime.requests import Job
from treegen.runtime.scheduler import REPLAN_FRACTION, conditioning_row, expected_left
from treegen.runtime.token_accept import TokenAcceptance
from treegen.runtime.token_automata import FREE
from treegen.runtime.token_masks import TokenMasks, open_dead_ends, stop_bits

# a phase expected to end sooner than this many steps runs without a CUDA graph (capture costs more)
MIN_CAPTURED_STEPS = 8
# a pipelined phase's host runs this many steps ahead of the device (it reads each step's count of rows
# still generating then: a phase that should end stops this many steps late), one more while it settles a
# block (see Decoder._steps)
WATCH_LAG = 1


class Decoder(ConstrainedSteps, TokenAcceptance):
    """The generating branches of one :class:`~treegen.runtime.tree_run.TreeRun` (see module doc)."""

    # programs resume while the GPU decodes: a block that completes jobs yields before the phase decides
    # whether to end (False: after it, the order before; an A/B). (Decoding one more block for the live
    # branches where a phase ends at a block boundary, while its last jobs' programs run, measured no
    # gain: tot / rounds at 256 branches on an H100, -0.01 / +0.03 of the static ratio, within the spread.
    # Nor did admitting, while a phase's last block still ran, the waiting work that needed no KV moved: tot at
    # 1,024 on an H100, scheduling after the phase 18.4 vs 22.2 ms a call, the static ratio 1.059 vs 1.062;
    # dynamic_tinyllama-1.1b_tot_1024_admit_ahead_ab_h100.json, stop 60.)
    overlap_programs = True

    def __init__(self, run) -> None:
        self.run = run
        self.model, self.tree, self.kv = run.model, run.tree, run.kv
        self.tokenizer = run.engine.tokenizer
        self.eos = self.model.eos_token_ids
        device = self.model.device
        self.graphs = run.engine.cuda_graphs and device.type == "cuda"
        self.sync_every = 8 if device.type == "cuda" else 1
        self.jobs: list[Job] = []  # branch b's job
        self.out: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.plain: list[bool] = []  # only EOS and max_tokens can end branch b (see draw)
        # what settling a block reads of branch b on its fast path (see TokenAcceptance._settle): plain and not
        # streamed (no on_tokens), its max_tokens, whether EOS ends it
        self.quick: list[bool] = []
        self.limit: list[int] = []
        self.eos_ends: list[bool] = []
        # how many of branch b's tokens (``out[b]``) its node has taken (a final EOS, which never goes there, counted
        # as taken): within a phase the fast path leaves the node behind, and it catches up where the branch takes
        # the slow path and when the phase's steps end (see TokenAcceptance._catch_up)
        self.in_tree: list[int] = []
        self.live: list[int] = []
        # sliced gens that used up their slice's reservation and wait to be admitted again (job → branch): their
        # tokens, log-probabilities and matcher states stay here; the scheduler's queue holds the jobs
        self.paused: dict[Job, int] = {}
        self.pauses = 0  # branches paused so far
        self.tokens_done = 0
        self.masks: TokenMasks | None = None  # the constrained branches' matchers (made at the first one)
        # the state of each branch that a token automaton constrains (host copy, as of its last accepted
        # token; see token_automata): its masks and next states are computed in the step itself
        self.state: dict[int, int] = {}
        self.constrained_steps = 0  # decode steps of phases with a constrained branch (host sync per step)
        # host seconds of those steps by part (see _constrained_steps); "launch": forward/pick calls (on
        # CUDA graph launches; on the CPU the model's work itself), "other": the loop's own Python
        self.constrained_host = dict.fromkeys(CONSTRAINED_PARTS, 0.0)
        self.captured_phases = 0  # phases run as CUDA graphs
        # a capture may skip its warm-up run once the engine has captured a phase (its kernels compiled),
        # in one process only (tensor-parallel ranks must run their collectives alike; see capture_cold)
        parallel = run.engine.parallel
        self.cold_captures = parallel is None or parallel.tp == 1
        self.cold_fallbacks = 0  # captures without warm-up that failed and were made with it
        # decode phases' graphs kept for later phases of the same padded shape (see phase_graphs); one
        # process only (tensor-parallel ranks are not kept in step)
        self.kept = PhaseGraphs() if self.graphs and self.cold_captures and phase_graphs.enabled() else None
        self.kept_phases = 0  # phases that replayed kept graphs (captured nothing)
        self.eos_ids = torch.tensor(sorted(self.eos), dtype=torch.int64, device=device)
        self._stops: torch.Tensor | None = None  # a bitmask row allowing only EOS (see _stop_bits)
        # a pipelined phase looks at the device's count of rows still generating every step and ends as
        # soon as the scheduler would (one process only: ranks would see the count at different steps)
        self.early_ends = 0  # phases ended on that count before their block's tokens were read

    def _stop_bits(self, words: int, device) -> torch.Tensor:
        """A bitmask row of ``words`` words allowing only EOS: what a constrained branch at a dead end may draw
        (:func:`~treegen.runtime.token_masks.open_dead_ends`). Made once (kept phases' graphs read it)."""
        if self._stops is None:
            self._stops = stop_bits(self.eos, words, device)
        return self._stops

    # ---------------------------------------------------------------------------------------------
    def sparse_window_live(self) -> bool:
        """Whether a live branch keeps only part of its KV (sparse window attention, ``kv_keep``)."""
        return any(self.jobs[b].request.params.kv_keep is not None for b in self.live)

    def decode_rows(self) -> list[tuple[int, int]]:
        """Each live branch's pending last token (sampled, no KV yet): its row in the next step."""
        return [(n, len(self.tree.tokens(n)) - 1) for n in (self.jobs[b].request.node for b in self.live)]

    def draw(self, logits: torch.Tensor, new_jobs: list[Job]) -> None:
        """After a step that ran the live branches' decode rows and the conditioning rows of
        ``new_jobs`` (gens), in that order: ``logits [live + new, vocab]``. Draws the next token of
        every live branch and the first of every new one, on the host at once. (A paused branch's job comes
        back as a new job whose conditioning row is its last token: it draws its next one and decodes on.)"""
        joining = [self._join(job) for job in new_jobs]
        rows = self.live + joining
        if not rows:
            return
        device = logits.device
        steps = torch.tensor([len(self.out[b]) for b in rows], dtype=torch.int64, device=device)
        params = RowSampling([self.jobs[b] for b in rows], device, self.model.vocab_split)
        bitmask = None
        if self.masks is not None:
            bitmask = self.masks.new_bitmask(len(rows))
            bitmask = bitmask.to(device) if self.masks.fill(bitmask, rows) else None
        states = self._states(rows, device)
        if states is not None:
            bitmask = self.run.engine.automata.tables.bitmask(states, also=bitmask)
        if bitmask is not None:
            bitmask = open_dead_ends(bitmask, self._stop_bits(bitmask.shape[1], device))
        nxt, lp = params.pick(logits, torch.arange(len(rows), device=device), steps, bitmask)
        tokens = [[t] for t in nxt.tolist()]
        self._advance_matchers(rows, tokens)
        may_stop = self._may_stop(rows, tokens)
        for j, (b, new, p) in enumerate(zip(rows, tokens, lp.tolist())):
            # (a job may be done already: cancelled by an earlier callback, its program having failed)
            if not self.jobs[b].done and self._accept(b, new, [p], j not in may_stop) and self.jobs[b].request.final:
                self.kv.free(self.jobs[b].request.node)
        self.live = [b for b in rows if not self.jobs[b].done]
        self._pause_full()  # (a step that prefilled other work drew a token for every live branch too)
        self._report()

    def _join(self, job: Job) -> int:
        """The branch of gen ``job``, which joins the live ones: a paused gen's own (its tokens and states kept),
        else a new branch (its forced tokens, if any, drawn already; its matcher or automaton state made)."""
        if job in self.paused:
            return self.paused.pop(job)
        b, forced = len(self.jobs), list(job.request.forced)
        self.jobs.append(job)
        self.out.append(forced)  # (jump-forward: the tokens its constraint forced, on its node already)
        self.logprobs.append([0.0] * len(forced))
        self.tokens_done += len(forced)
        constraint = job.request.params.constraint
        automaton = self.run.engine.automaton(constraint)
        # only EOS and max_tokens can end it (no stop string; a constraint's matcher takes the tokens before
        # they are settled, a token automaton's state is walked there): settled on the fast path
        params = job.request.params
        self.plain.append(not params.stop)
        self.quick.append(not params.stop and job.on_tokens is None)
        self.limit.append(params.max_tokens)
        self.eos_ends.append(not params.ignore_eos)
        self.in_tree.append(len(forced))
        if automaton is not None:
            self.state[b] = self.run.engine.automata.walk(automaton.initial, forced) if forced else automaton.initial
        elif constraint is not None:
            if self.masks is None:
                self.masks = TokenMasks(self.run.engine.grammars)
            self.masks.add(b, constraint)
            for t in forced:
                self.masks.accept([b], [t])
        return b

    def _pause_full(self) -> None:
        """Pause every live branch whose node's range holds no slot past its pending token (a sliced gen at
        the end of its slice: see the scheduler): it leaves the batch and its job waits to be admitted again,
        its tokens and states kept here (``paused``) — unless the scheduler gives it its next slice at once."""
        if self.run.scheduler.slice_tokens is None:  # (whole reservations: no branch runs out of room)
            return
        extend = self.run.scheduler.extend
        full = [b for b in self.live if self._room(self.jobs[b]) <= 0 and not extend(self.jobs[b], len(self.out[b]))]
        if not full:
            return
        self.live = [b for b in self.live if b not in set(full)]
        for b in full:
            self.paused[self.jobs[b]] = b
            self.run.scheduler.resume(self.jobs[b], len(self.out[b]))
        self.pauses += len(full)

    def cancel(self, job: Job) -> None:
        """A job was cancelled, or refused after a pause: its branch leaves the live set or the paused ones, and
        its matcher state is dropped (see ``TreeRun.cancel``)."""
        self.live = [b for b in self.live if self.jobs[b] is not job]
        self.paused.pop(job, None)
        for b, j in enumerate(self.jobs):
            if j is job:
                self.state.pop(b, None)
                if self.masks is not None:
                    self.masks.drop(b)

    def _states(self, rows: list[int], device) -> torch.Tensor | None:
        """The automaton state of each of ``rows`` (free: none), on ``device``; None when no row has one."""
        if not self.state:
            return None
        states = [self.state.get(b, FREE) for b in rows]
        return torch.tensor(states, dtype=torch.int64, device=device) if any(states) else None

    # ---------------------------------------------------------------------------------------------
    def phase(self, joining: list[Job] = ()):
        """Decode the live branches until the scheduler ends the phase; a generator that yields
        whenever branches finished (their jobs are complete), see the module docstring.

        ``joining``: gens that join the live branches at the phase's first step — admitted gens whose only
        row without KV is their conditioning token (:meth:`~treegen.runtime.tree_run.TreeRun.joins_phase`):
        it is their row's first token (its KV written by one of the rows that share it, the others writing
        to their own spare slot), whose logits give their first token; from the second step on they decode
        like every live branch. (Otherwise a step of its own would run first: a mixed step, uncaptured or
        in kept buffers, its tokens read on the host before the phase is planned.)"""
        run, tree, kv, model = self.run, self.tree, self.kv, self.model
        device = model.device
        started = time.perf_counter()
        kv.wait_restores()  # (a captured step cannot wait on copies made outside it)
        # (node, index) of the token each row runs first: a live branch's last (sampled, no KV yet), a joining
        # gen's conditioning token (its node's last, or an ancestor's when it generates into an empty node)
        rows = self.decode_rows()
        staying = len(rows)  # rows from here on join at the first step
        # (a job cancelled since it was admitted — its program failed at a callback of that step — joins nothing)
        self.live += [self._join(job) for job in joining if not job.done]
        live = list(self.live)
        run.decode_phases.append(len(live))
        jobs = [self.jobs[b] for b in live]
        nodes = [j.request.node for j in jobs]
        made = [len(self.out[b]) for b in live]  # tokens each branch has drawn
        remaining = [j.request.params.max_tokens - m for j, m in zip(jobs, made)]
        if self.state:  # a token automaton's branch can draw no more than its longest answer
            most = run.engine.automata.most
            remaining = [int(min(r, most(self.state[b]))) if b in self.state else r for b, r in zip(live, remaining)]
        # a sliced gen (see the scheduler) decodes only as far as its node's reservation reaches: a phase ends
        # there at the latest, and the branch pauses (what its node's range holds past its tokens: remaining
        # rows' own reservations hold exactly ``max_tokens`` more)
        room = [self._room(j) for j in jobs]  # (at least 1: a branch with none left paused, see _pause_full)
        if any(r < left for r, left in zip(room, remaining)):  # the scheduler may give them their next slice now
            for j, (b, job) in enumerate(zip(live, jobs)):
                if room[j] < remaining[j] and run.scheduler.extend(job, len(self.out[b])):
                    room[j] = self._room(job)
        sliced = [r < left for r, left in zip(room, remaining)]
        remaining = [min(left, r) for left, r in zip(remaining, room)]
        rows += [conditioning_row(tree, n) for n in nodes[staying:]]
        # of those an ancestor's token without KV: the first row to run it writes its KV, the others do not
        unwritten = {r for r, n in zip(rows[staying:], nodes[staying:]) if r[0] != n and kv.computed(r[0]) <= r[1]}
        writes = []
        for r, n in zip(rows, nodes):
            writes.append(r[0] == n or r in unwritten)
            unwritten.discard(r)
        # tokens each node holds before its generated ones: what a program appends after a finished
        # gen (while the phase still runs) has no KV yet, so it must not be counted as computed
        prompt_len = [len(tree.tokens(n)) - m for n, m in zip(nodes, made)]
        keep = [j.request.params.kv_keep for j in jobs]
        swa_rows = [j for j, r in enumerate(keep) if r is not None]
        width = max(remaining)
        if swa_rows:  # sparse window attention compacts its branches' KV when the phase ends (see swa)
            width = min(width, run.engine.kv_keep_every)
        if any(sliced):
            width = min(width, min(r for r, cut in zip(remaining, sliced) if cut))
        grow = [min(r, width) for r in remaining]
        # what sparse window attention's compaction needs of the phase's first step (nothing without it)
        positions = [tree.position(n) + i for n, i in rows] if swa_rows else []
        out_before = made if swa_rows else []
        input_ids, slots, plan = run.plan_rows(rows, grow=dict(zip(nodes, grow)),
                                               query_nodes=nodes if staying < len(live) else None)
        # each row's KV slot from its second step on (its node's next token's, one past the first step's but for
        # a joining gen's), and its reservation's last: a branch done while the phase runs on keeps writing there
        # (its last token's KV is never written, so it holds none): never into its written KV, never past it
        segments = kv.segments
        second = [segments[n].start - segments[n].dropped + len(tree.tokens(n)) for n in nodes]
        slot_limit = torch.tensor([min(s + g - 1, segments[n].start + segments[n].capacity - 1)
                                   for s, g, n in zip(second, grow, nodes)], device=device)
        # the first step's KV writes into ancestors (a joining gen's conditioning token's)
        written = [segments[r[0]].start + r[1] - segments[r[0]].dropped
                   for r, n, w in zip(rows, nodes, writes) if w and r[0] != n]
        if not all(writes):  # a joining gen whose conditioning token another row writes writes its own last slot
            spare = torch.tensor([j for j, w in enumerate(writes) if not w], device=device)
            slots[spare] = slot_limit[spare]
        jump = torch.tensor(second, device=device) - slots  # the slot's step after the first step (then 1)
        params = RowSampling(jobs, device, model.vocab_split)
        steps = torch.tensor(made, dtype=torch.int64, device=device)
        # the SWA rows whose queries a recorder keeps for the compaction (none: attention "none" has none)
        recorded = swa_rows if run.engine.attention != "none" else []
        constrained = self.masks is not None and any(b in self.masks for b in live)
        states = self._states(live, device)  # (rows that token automata constrain: masks made in the step)
        tables = run.engine.automata.tables if states is not None else None
        kept = self._kept(plan, params, len(live), width, constrained, remaining, tables, len(recorded))
        recorder = None
        if kept is not None:  # the phase runs in kept buffers (padded), replaying their graphs if captured
            kept.load(input_ids=input_ids, slots=slots, slot_limit=slot_limit, jump=jump, steps=steps, plan=plan,
                      params=params, states=states, recorded=recorded)
            input_ids, slots, slot_limit, jump, steps, plan, params, states = (
                kept.input_ids, kept.slots, kept.slot_limit, kept.jump, kept.steps, kept.plan, kept.params, kept.states)
            idx, buf, lp_buf, column, bitmask = kept.idx, kept.buf, kept.lp_buf, kept.column, kept.bitmask
            done, alive = kept.done, kept.alive
            logits_of, graphs, recorder = kept.logits, kept.graphs, kept.recorder
        else:
            if recorded:
                recorder = self._recorder(recorded)
            idx = torch.arange(len(live), device=device)
            buf = torch.zeros(len(live), width, dtype=torch.int64, device=device)
            lp_buf = torch.zeros(len(live), width, dtype=torch.float32, device=device)
            column = torch.zeros(len(live), 1, dtype=torch.int64, device=device)
            # a constraint's token masks: a device buffer the step reads (captured with it), filled from the host
            bitmask = self.masks.new_bitmask(len(live), device=device) if constrained else None
            done = torch.zeros(len(live), dtype=torch.bool, device=device)  # rows that drew EOS or max_tokens
            alive = torch.zeros(1, dtype=torch.int64, device=device)  # rows not done
            logits_of, graphs = {}, {}
        attend = run.attend_fn(plan, slots, recorder, run.library_copies(plan, written))
        stops = None if bitmask is None and tables is None else \
            self._stop_bits((bitmask if bitmask is not None else tables.masks).shape[1], device)

        def forward() -> None:
            # (a head split by vocabulary: this rank's logits, which the sampler reads)
            logits_of["step"] = model.forward(input_ids, plan.query_pos, attend, gather=False, fp32_logits=False)

        def pick() -> None:
            mask = bitmask if tables is None else tables.bitmask(states, also=bitmask)
            if mask is not None:
                mask = open_dead_ends(mask, stops)
            nxt, lp = params.pick(logits_of["step"], idx, steps, mask)
            if tables is not None:
                states.copy_(tables.advance(states, nxt))
            buf.scatter_(1, column, nxt.unsqueeze(1))
            lp_buf.scatter_(1, column, lp.unsqueeze(1))
            input_ids.copy_(nxt)
            plan.query_pos.add_(1)
            torch.minimum(slots + jump, slot_limit, out=slots)
            jump.fill_(1)
            steps.add_(1)
            done.logical_or_(steps >= params.max_tokens).logical_or_(torch.isin(nxt, self.eos_ids) & params.eos_ends)
            alive.copy_(done.logical_not().sum().view(1))
            column.add_(1)
            if recorder is not None:
                recorder.advance()

        def step() -> None:
            forward()
            pick()

        planned = time.perf_counter()
        run.host_seconds["plan"] += planned - started
        capturing = self.graphs and plan.backend == "triton" and (kept is not None or self._worth_capturing(remaining))
        self.captured_phases += capturing and not graphs
        self.kept_phases += bool(graphs)
        pool = self.kept.pool() if capturing and kept is not None else None  # (kept graphs share one pool)
        passes_before, capture_before = run.forward_passes, run.host_seconds["capture"]
        own = len(live)  # (kept buffers have padding rows after the phase's own)
        if constrained:
            yield from self._constrained_steps(live, width, forward, pick, bitmask, input_ids[:own], buf[:own],
                                               lp_buf[:own], capturing, graphs, pool)
        else:
            yield from self._steps(live, width, step, buf[:own], lp_buf[:own], capturing, graphs, pool, alive)
            logits_of.clear()  # (a step graph's logits are its own temporaries: not kept)
        self._catch_up(live)  # (the nodes of the branches that go on take the phase's tokens)
        if kept is not None:
            self.kept.trim()
        run.phase_passes.append(run.forward_passes - passes_before)
        run.phase_capture_seconds.append(run.host_seconds["capture"] - capture_before)
        alive = set(self.live)
        for b, n, held in zip(live, nodes, prompt_len):
            if b not in alive and self.jobs[b].request.final:
                kv.free(n)  # a finished branch that takes nothing more gives its KV back at once
            elif n in kv.segments:  # (its program may have ended and freed it meanwhile)
                seg = kv.segments[n]  # KV for all its tokens but the last (less those SWA dropped)
                seg.computed = held + len(self.out[b]) - 1 - seg.dropped
        self._pause_full()
        if swa_rows:
            self._compact(live, nodes, keep, recorder, run.forward_passes - passes_before, out_before, positions)

    def _room(self, job: Job) -> int | float:
        """Tokens the live branch of gen ``job`` can still decode within its node's range (its last token's
        KV included); unbounded for sparse window attention, whose reservation compaction keeps."""
        seg = self.kv.segments.get(job.request.node)
        if seg is None or job.request.params.kv_keep is not None:
            return math.inf
        return seg.capacity - (len(self.tree.tokens(job.request.node)) - seg.dropped)

    def _compact(self, live, nodes, keep, recorder, steps_run: int, out_before, positions) -> None:
        """After a phase: compact the KV of its SWA branches that hold more than they keep (ALISA's
        selection from the attention weights of the phase's last recorded steps; see :mod:`~treegen.runtime.swa`).
        ``keep[j]``: row j's keep ratio (None: exact); ``positions[j]``: its position at the phase's
        first step; ``out_before[j]``: its generated tokens then."""
        run, kv = self.run, self.kv
        started = time.perf_counter()
        todo = [j for j, (n, r) in enumerate(zip(nodes, keep)) if r is not None and n in kv.segments
                and swa.kept_count(r, kv.segments[n].tokens) < kv.segments[n].computed]
        if not todo:
            return
        column = {j: c for c, j in enumerate(j for j, r in enumerate(keep) if r is not None)}
        importance: dict[int, torch.Tensor] = {}
        asked, queries, at = [], [], []
        for j in list(todo):
            if recorder is None:  # attention "none" (a benchmark ceiling): the recent tokens only
                importance[j] = torch.zeros(kv.num_layers, kv.num_kv_heads, kv.segments[nodes[j]].computed,
                                            device=kv.device)
                continue
            ring, taken = recorder.steps(steps_run, len(self.out[live[j]]) - out_before[j])
            if not ring:  # it finished before the ring's steps: compacted when it decodes again, if ever
                todo.remove(j)
                continue
            asked.append(j)
            queries.append(recorder.q[:, ring, column[j]])
            at.append([positions[j] + t for t in taken])
        if asked:
            weights = swa.own_attention(kv, self.tree, self.model, [nodes[j] for j in asked], queries, at,
                                        per_head=True)
            importance.update(zip(asked, weights))
        log = run.swa_log
        compacted = {}
        for j in todo:
            n, seg = nodes[j], kv.segments[nodes[j]]
            kept = swa.alisa_select(importance[j], seg.computed, seg.tokens, keep[j])  # [layers, kv_heads, m]
            if log is not None:  # token index of every kept slot, per layer and KV head (tests, the accuracy script)
                held = log.get(n, [])
                held = held[-1][1] if held else [[[] for _ in range(kv.num_kv_heads)] for _ in range(kv.num_layers)]
                log.setdefault(n, []).append((seg.tokens, [
                    [[h[s] if s < len(h) else seg.dropped + s for s in row] for h, row in zip(held_l, kept_l)]
                    for held_l, kept_l in zip(held, kept.tolist())]))
            run.swa_dropped += seg.computed - kept.shape[-1]
            compacted[n] = kept
        kv.keep_many(compacted)
        run.swa_compactions += len(todo)
        run.host_seconds["swa"] += time.perf_counter() - started

    def _steps(self, live: list[int], width: int, step, buf, lp_buf, capturing: bool, graphs: dict, pool, alive):
        """The steps of a phase without xgrammar's constraints: the host reads the tokens every
        ``sync_every`` steps, pipelined on CUDA (see the module doc). ``capturing``: replay ``step`` as a
        CUDA graph — ``graphs["step"]`` if kept from an earlier phase, else captured now into ``graphs``
        (in ``pool``). ``alive``: the device's count of rows not done (EOS or ``max_tokens``), which a
        pipelined phase of one process with rows that EOS may end reads every step, ``WATCH_LAG`` steps
        behind (the host waits for it, so it queues no more than that): once the scheduler would end the
        phase on it, the steps stop there and their tokens are read at once, rather than up to two blocks
        later (a phase of short answers ran about twice its steps). Every step queued past the one that
        ended the phase is a whole step wasted (a short answer's run is a few dozen steps), so the lag is
        one step; where a block ends, the host settles it (and the programs may run at a ``yield``)
        before it reads the count, so the device has two steps queued to run meanwhile. A block
        that completes jobs yields before the phase decides whether to end (``overlap_programs``), so
        the programs run while the next block does and the decision sees the work they queued."""
        run = self.run
        started = time.perf_counter()
        replay = self._replayer("step", step, graphs, pool) if capturing else None
        run.host_seconds["capture"] += time.perf_counter() - started
        pipelined = self.model.device.type == "cuda"
        # (cold_captures: one process, see __init__; rows that only max_tokens ends end where the host knows)
        watch = pipelined and self.cold_captures and any(not self.jobs[b].request.params.ignore_eos for b in live)
        seen: list = []  # per step, its count copied into pinned memory, and the event after the copy
        done_steps, pending = 0, None

        first_end = None  # the steps run when a row was first seen done

        def watched_end(t: int) -> bool:
            """The device's count of rows generating after step ``t - WATCH_LAG`` ends the phase."""
            nonlocal first_end
            count, copied = seen[t - WATCH_LAG]
            copied.synchronize()
            if first_end is None and int(count[0]) < len(live):
                first_end = t - WATCH_LAG + 1
            return t + 1 < width and run.scheduler.phase_should_end(len(live), int(count[0]), ran,
                                                                    expected_left(width, t + 1, first_end))

        for t in range(width):
            (replay or step)()
            run.forward_passes += 1
            ran = t + 1 if capturing else None  # (for phase_should_end: an uncaptured phase's successor costs no capture)
            watching = watch and t >= WATCH_LAG
            if watch:  # the host stays WATCH_LAG steps ahead of the device, reading each step's count
                seen.append((torch.empty(1, dtype=torch.int64, pin_memory=True).copy_(alive, non_blocking=True),
                             torch.cuda.Event()))
                seen[-1][1].record()
            if (t + 1) % self.sync_every and t + 1 < width:
                if watching and watched_end(t):
                    run.scheduler.tick(t + 1 - done_steps)
                    if pending is not None:
                        self._settle(live, pending)
                    self._settle(live, TokenBlock(buf, lp_buf, done_steps, t + 1, pipelined))
                    self.early_ends += 1
                    return
                continue
            # a block ends: the host settles one (and the programs may run) before it reads the count, so
            # the device has this step and the one before queued meanwhile
            run.scheduler.tick(t + 1 - done_steps)
            block = TokenBlock(buf, lp_buf, done_steps, t + 1, pipelined)
            done_steps = t + 1
            if pipelined:  # look at the previous block while this one's steps run: the GPU never waits
                block, pending = pending, block
            if block is not None:
                before = len(self.live)
                self._settle(live, block)
                completed = len(self.live) < before
                if completed and first_end is None:
                    first_end = block.end
                resume_first = completed and self.overlap_programs and bool(self.live)
                if resume_first:
                    # jobs completed: their programs may resume (and queue work, which the decision below
                    # then sees) while the GPU runs the next block (with none live, the phase ends first)
                    yield
                if run.scheduler.phase_should_end(len(live), len(self.live), ran, expected_left(width, t + 1, first_end)):
                    break
                if completed and not resume_first:
                    yield
            if watching and watched_end(t):
                if pending is not None:  # (the block just made: steps up to t)
                    self._settle(live, pending)
                    pending = None
                self.early_ends += 1
                return
        if pending is not None:  # every step run is accepted (finished branches ignore theirs)
            self._settle(live, pending)

    def _kept(self, plan, params, rows: int, width: int, constrained: bool, remaining: list[int], tables=None,
              recorded: int = 0):
        """The kept buffers a phase like this runs in (:mod:`~treegen.runtime.phase_graphs`): an earlier
        phase's of the same key, or new ones when the phase is worth capturing; None: the phase runs in
        tensors of its own (no graphs, no kept graphs, or a plan that cannot be padded). ``tables``: the
        token automata's tables the phase's step reads (kept with the buffers), or None; ``recorded``: how
        many of its rows sparse window attention records (the buffers then hold a recorder)."""
        if self.kept is None or plan.backend != "triton":
            return None
        key = phase_graphs.phase_key(plan, rows=rows, constrained=constrained, params=params,
                                     pool_generation=self.kv.pool_generation,
                                     automata_generation=None if tables is None else tables.generation,
                                     recorded=recorded)
        if key is None:
            return None
        kept = self.kept.get(key, plan, width)
        if kept is None and self._worth_capturing(remaining):
            kept = self.kept.add(key, PhaseBuffers.allocate(
                plan=plan, params=params, rows=rows, width=width, device=self.model.device,
                mask_width=self.masks.grammars.mask_width if constrained else None, automata=tables,
                recorder=self._recorder([], capacity=key.recorded) if recorded else None))
        return kept

    def _recorder(self, rows: list[int], capacity: int | None = None) -> swa.QueryRecorder:
        """A query recorder of ``rows`` (room for ``capacity``) for sparse window attention's compaction."""
        model = self.model
        return swa.QueryRecorder(num_layers=model.num_layers, rows=rows, history=self.run.engine.kv_keep_history,
                                 num_heads=model.num_heads, head_dim=model.head_dim, dtype=model.dtype,
                                 device=model.device, capacity=capacity)

    def _worth_capturing(self, remaining: list[int]) -> bool:
        """Capturing costs a few steps' host time: skip it for a phase that new work waiting for room
        will end within ``MIN_CAPTURED_STEPS`` (once ``REPLAN_FRACTION`` of its branches are done)."""
        if not self.run.scheduler.has_work():
            return True
        at = min(len(remaining) - 1, int(len(remaining) * REPLAN_FRACTION))
        return sorted(remaining)[at] >= MIN_CAPTURED_STEPS

    def capture_graph(self, fn, pool=None, compiled: bool | None = None) -> tuple[torch.cuda.CUDAGraph, bool]:
        """``fn`` captured as a CUDA graph, and whether capturing ran it for real: without the warm-up run where
        its kernel variants are compiled already (see ``cold_captures``), else with it. ``compiled``: whether they
        are (None: a decode phase's step, compiled once this engine has captured one, which this capture counts)."""
        engine = self.run.engine
        if compiled is None:
            compiled = engine.phases_captured > 0
            engine.phases_captured += 1
        cold = self.cold_captures and compiled
        graph, ran = capture_cold(fn, pool) if cold else (capture(fn, pool), True)
        self.cold_fallbacks += cold and ran
        return graph, ran

    def _replayer(self, name: str, step, graphs: dict, pool=None):
        """A replay function for the phase's steps: of ``graphs[name]`` (kept from an earlier phase), else
        of ``step`` captured now as a CUDA graph (in ``pool``) and put there. When capturing ran the step
        for real, that was the phase's first step, so the first call does nothing."""
        if name in graphs:
            return graphs[name].replay
        graph, ran = self.capture_graph(step, pool)
        graphs[name] = graph
        first = [ran]

        def replay():
            if first[0]:
                first[0] = False
                return
            graph.replay()

        return replay
