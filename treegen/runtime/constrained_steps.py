"""The steps of a decode phase with a constrained branch (xgrammar's matchers): each step's tokens come to
the host, which advances the matchers and uploads the next step's masks while the GPU runs the step's
forward (:class:`ConstrainedSteps`, a base of :class:`~treegen.runtime.decode.Decoder`; phases without such
a branch run :meth:`~treegen.runtime.decode.Decoder._steps`)."""

from __future__ import annotations

import time

from treegen.runtime.phase_io import TokenBlock, TokenColumn
from treegen.runtime.scheduler import expected_left

# the parts of a constrained step's host time (Decoder.constrained_host; "accept" holds the step's mask fill,
# done in the same pass, "fill" only a phase's first masks)
CONSTRAINED_PARTS = ("wait", "accept", "fill", "upload", "settle", "launch", "other")
# the clock those parts are timed by (a benchmark on a shared CPU may set time.process_time)
CLOCK = time.perf_counter


class ConstrainedSteps:
    """A constrained phase's step loop (see module doc)."""

    def _constrained_steps(self, live: list[int], width: int, forward, pick, bitmask, last, buf, lp_buf,
                           capturing: bool, graphs: dict, pool):
        """The steps of a phase with a constrained branch. Its matcher must see every token before the
        next mask, so each step's tokens come to the host; the step is split in two — the model's
        ``forward`` and ``pick`` (mask, sample, advance), each a CUDA graph — and while step ``t``'s
        forward runs the host reads step ``t - 1``'s tokens, advances the matchers (one batched call)
        and uploads step ``t``'s masks: the GPU waits only for host work longer than a forward. The
        rest of the host's work (appending tokens, finishing branches) runs every ``sync_every``
        steps, as in unconstrained phases. A matcher stops at its branch's EOS or ``max_tokens``; its
        row is then all ones, and the tokens the branch draws after it are dropped when settled.
        ``last``: the device tensor the step's tokens are left in (the next step's input ids).
        ``capturing``, ``graphs``, ``pool``: as :meth:`_steps` (graphs ``"forward"`` and ``"pick"``)."""
        run, masks, eos = self.run, self.masks, self.eos
        pipelined = self.model.device.type == "cuda"
        row_of = {b: j for j, b in enumerate(live)}
        budget = {b: self.jobs[b].request.params.max_tokens - len(self.out[b]) for b in live if b in masks}
        shortest = min(budget.values(), default=width + 1)  # (steps after which some active branch ends)
        dirty = False  # a settle or the programs ran since the last advance (jobs may be done)
        active = [b for b in budget if not self.jobs[b].done]  # matchers still advancing, in row order
        host = masks.new_bitmask(bitmask.shape[0], pinned=pipelined)  # rows of the others stay all ones
        parts = self.constrained_host
        clock = CLOCK
        # the active branches' matchers and rows, kept beside `active` (no per-branch lookups per step)
        matchers = masks.handles([masks.matchers[b] for b in active])
        rows = [row_of[b] for b in active]

        def upload(fill: bool = True) -> None:  # ordered after the step that read the previous masks (same stream)
            t0 = clock()
            if fill:  # (a step's own masks are filled with its accepts: advance)
                masks.fill_rows(host, matchers, rows)
            t1 = clock()
            bitmask.copy_(host, non_blocking=pipelined)
            parts["fill"] += t1 - t0
            parts["upload"] += clock() - t1

        def advance(t: int, column: "TokenColumn") -> bool:
            """Step ``t``'s tokens (one per row) into the active matchers, and the next step's masks
            from them (one pass); those that end leave (their rows become all ones). True when some did."""
            nonlocal dirty
            t0 = clock()
            tokens = column.read()
            t1 = clock()
            if dirty:  # branches finished or were cancelled since: their matchers take nothing more
                keep_only(lambda i, b: not self.jobs[b].done)
                dirty = False
            picked = [tokens[j] for j in rows]
            ending = t + 1 >= shortest or not eos.isdisjoint(picked)
            goes = [picked[i] not in eos and t + 1 < budget[b] for i, b in enumerate(active)] if ending else None
            masks.accept_and_fill(active, matchers, picked, host, rows, goes)
            before = len(active)
            if ending:
                keep_only(lambda i, b: goes[i])
            parts["wait"] += t1 - t0
            parts["accept"] += clock() - t1
            return len(active) < before

        def keep_only(keeps) -> None:
            nonlocal active, matchers, rows, shortest
            keep = [i for i, b in enumerate(active) if keeps(i, b)]
            if len(keep) < len(active):
                host[sorted(set(rows) - {rows[i] for i in keep})] = -1
                active, matchers, rows = ([x[i] for i in keep] for x in (active, matchers, rows))
                shortest = min((budget[b] for b in active), default=width + 1)

        def launch(fn) -> None:
            t0 = clock()
            fn()
            parts["launch"] += clock() - t0

        started = time.perf_counter()
        if capturing and "pick" in graphs:  # kept from an earlier phase of this shape
            forward, pick = graphs["forward"].replay, graphs["pick"].replay
            forward()
            upload()
        elif capturing:
            graph, _ = self.capture_graph(forward, pool)  # (if it ran step 0's forward, its logits are not the graph's output)
            graphs["forward"] = graph
            graph.replay()  # so run it (again) into that output (rewriting the same KV)
            upload()
            forward, pick = graph.replay, self._replayer("pick", pick, graphs, pool or graph.pool())
        else:
            forward()
            upload()
        run.host_seconds["capture"] += time.perf_counter() - started
        done_steps, block, step_tokens = 0, None, None
        first_end = None  # the steps run when a matcher first ended
        loop_started, known = clock(), sum(parts.values()) - parts["other"]
        try:
            for t in range(width):
                if t:
                    launch(forward)  # the GPU computes step t while the host works on step t - 1
                run.forward_passes += 1
                if t:
                    ended = advance(t - 1, step_tokens)
                    if ended and first_end is None:
                        first_end = t
                    if block is not None:
                        before = len(self.live)
                        t0 = clock()
                        self._settle(live, block, advance=False)
                        parts["settle"] += clock() - t0
                        block, dirty = None, True
                        if run.scheduler.phase_should_end(len(live), len(self.live), t if capturing else None,
                                                          expected_left(width, t, first_end)):
                            return  # (step t's forward wrote KV for tokens that keep none: rewritten when they continue)
                        if len(self.live) < before:
                            paused = clock()
                            yield  # jobs completed: their programs may resume while the GPU runs
                            loop_started += clock() - paused  # (the programs' time is not the loop's)
                            dirty = True
                    # the host knows each step which matchers ended: a phase the scheduler would end on
                    # that ends now, not at the next block (its other rows count as generating)
                    if ended and run.scheduler.phase_should_end(
                            len(live), len(active) + sum(b not in budget and not self.jobs[b].done for b in live),
                            t if capturing else None, expected_left(width, t, first_end)):
                        t0 = clock()
                        if done_steps < t:  # (the steps after the last block)
                            self._settle(live, TokenBlock(buf, lp_buf, done_steps, t, pipelined), advance=False)
                        parts["settle"] += clock() - t0
                        self.early_ends += 1
                        return
                    upload(fill=False)
                launch(pick)
                self.constrained_steps += 1
                run.scheduler.tick(1)
                step_tokens = TokenColumn(last, pipelined)
                if (t + 1) % self.sync_every == 0 or t + 1 == width:
                    block, done_steps = TokenBlock(buf, lp_buf, done_steps, t + 1, pipelined), t + 1
            advance(width - 1, step_tokens)
            t0 = clock()
            self._settle(live, block, advance=False)
            parts["settle"] += clock() - t0
        finally:
            parts["other"] += (clock() - loop_started) - (sum(parts.values()) - parts["other"] - known)
