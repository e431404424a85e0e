"""A mixed step: one forward pass over every live branch's next token **and** the new tokens of admitted jobs'
nodes (:class:`MixedSteps`, a base of :class:`~treegen.runtime.tree_run.TreeRun`, which decides when one runs).

The live branches draw their next tokens from it, ready gens their first, ready ``select`` choices are scored
(length-normalised log-probability). A step of one chunk whose plan can be padded runs in kept buffers and is
replayed as a CUDA graph by later steps that fit (:mod:`~treegen.runtime.mixed_graphs`); its padding rows write
to a generating branch's last reserved slot (:meth:`MixedSteps._pad_slot`), which holds no KV while it runs.

The run's own parts it uses: ``tree``, ``kv``, ``decoder``, ``engine``, ``model``, ``_forward`` (the forward
pass over token rows), ``attend_fn``, ``complete``, and its counters (``mixed_steps``, ``prefill_rows``,
``mixed_kept``, ``mixed_reused``, ``host_seconds``).
"""

from __future__ import annotations

import itertools
import time

import torch

from treegen.runtime import mixed_graphs
from treegen.runtime.mixed_graphs import MixedBuffers
from treegen.runtime.requests import Job
from treegen.runtime.scheduler import conditioning_row, score_rows


class MixedSteps:
    """Running a step that prefills new work beside the live branches' decode rows (see module doc)."""

    def _run_step(self, step) -> None:
        """One forward pass: the live branches' decode rows, then ``step.rows``; draws the live
        branches' next tokens and the first tokens of ready gens, and scores ready selects."""
        tree, dec = self.tree, self.decoder
        decode_rows = dec.decode_rows()
        rows = decode_rows + step.rows
        self.prefill_rows += len(step.rows)
        row_of = {r: j for j, r in enumerate(rows)}
        gens = [j for j in step.ready if j.is_gen]
        scores = [j for j in step.ready if not j.is_gen]
        wanted = [row_of[r] for r in decode_rows] + [row_of[conditioning_row(tree, j.request.node)] for j in gens]
        per_score = [score_rows(tree, j) for j in scores]
        for rs in per_score:
            wanted += [row_of[r] for choice in rs for r in choice]
        split = self.model.vocab_split  # (a head split by vocabulary: the sampler reads this rank's logits)
        logits = self._forward(rows, wanted, gather=split is None, pad_ends=(decode_rows, gens))
        self.mixed_steps += 1
        dec.draw(logits[: len(decode_rows) + len(gens)], gens)
        if not scores:
            return
        # every choice's mean token log-probability, read to the host at once
        at = len(decode_rows) + len(gens)
        targets = torch.tensor([t for job in scores for c in job.request.choices for t in tree.tokens(c)],
                               device=logits.device)
        chosen = logits[at:] if split is None else split.gather(logits[at:])
        picked = chosen.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        sizes = [len(choice_rows) for rs in per_score for choice_rows in rs]
        means = iter(torch.stack([part.mean() for part in picked.split(sizes)]).tolist())
        for job in scores:
            self.complete(job, [next(means) for _ in job.request.choices])

    def _pad_slot(self, decode_rows: list[tuple[int, int]], gens: list[Job]) -> int | None:
        """A KV slot that no row of a mixed step writes and that holds no KV while it runs, for the padding
        rows of a kept mixed step (:mod:`~treegen.runtime.mixed_graphs`): the last reserved slot of a
        generating branch's node — a decode row's, or a new gen's — past every token that node holds now
        (a gen's last token is never run, so its slot is written by nothing before the node grows). None:
        no such slot (the step runs uncaptured)."""
        segments = self.kv.segments
        ends = itertools.chain(decode_rows, ((j.request.node, len(self.tree.tokens(j.request.node)) - 1) for j in gens))
        for n, last in ends:
            seg = segments.get(n)
            if seg is not None and seg.capacity - 1 > last - seg.dropped:
                return seg.start + seg.capacity - 1
        return None

    def _kept_mixed(self, plan, rows: int, logits_rows: int, gather: bool,
                    pad_ends: tuple) -> tuple[MixedBuffers | None, int | None]:
        """The kept buffers a mixed step with this plan (a :class:`~treegen.runtime.tree_run.PassPlan`) runs in
        (an earlier step's of the same key, or new ones) and its padding rows' slot (:meth:`_pad_slot` of ``pad_ends``; chosen after planning, whose
        reservations may move segments), or ``(None, None)``: it runs uncaptured (keeping off, decode phases'
        kept graphs off, too many rows, a plan that cannot be padded, no pad slot). See
        :mod:`~treegen.runtime.mixed_graphs`."""
        kept = self.decoder.kept
        if kept is None or not mixed_graphs.enabled() or self.engine.attention == "none" or plan.backend != "triton":
            return None, None
        key = mixed_graphs.mixed_key(plan, rows=rows, logits_rows=logits_rows, gather=gather,
                                     pool_generation=self.kv.pool_generation)
        pad_slot = None if key is None else self._pad_slot(*pad_ends)
        if pad_slot is None:
            return None, None
        self.mixed_kept += 1
        found = kept.get(key, plan)
        if found is not None:
            self.mixed_reused += 1
            return found, pad_slot
        return kept.add(key, MixedBuffers.allocate(plan=plan, rows=rows, logits_rows=logits_rows,
                                                   device=self.model.device)), pad_slot

    def _run_kept_mixed(self, kept: MixedBuffers, input_ids, slots, pad_slot: int, wanted, plan, gather: bool):
        """Run a mixed step in ``kept``: its values loaded, its forward replayed (captured first if new; on the
        CPU run eagerly in the same buffers). Returns its logits (the step's rows only), fp32."""
        self.kv.wait_restores()  # (a captured forward cannot wait on copies made outside it)
        kept.load(input_ids=input_ids, slots=slots, pad_slot=pad_slot, logits_rows=wanted, plan=plan)

        def forward() -> None:
            kept.logits = self.model.forward(kept.input_ids, kept.plan.query_pos, self.attend_fn(kept.plan, kept.slots),
                                             kept.logits_rows, gather=gather, fp32_logits=False)

        dec = self.decoder
        if not dec.graphs:
            forward()
        elif "forward" in kept.graphs:
            kept.graphs["forward"].replay()
        else:
            started = time.perf_counter()
            # its kernel variants are compiled once a mixed step has been captured (a decode phase's capture is
            # no sign of the prefill tiles'); this step is counted in mixed_kept - mixed_reused already
            graph, _ = dec.capture_graph(forward, dec.kept.pool(), compiled=self.mixed_kept - self.mixed_reused > 1)
            kept.graphs["forward"] = graph
            graph.replay()  # (a capture that ran it, warming up, gave its logits elsewhere)
            self.host_seconds["capture"] += time.perf_counter() - started
            dec.kept.trim()
        return kept.logits[: wanted.numel()].float()
