"""Decoding all live branches together, one token per branch per step, in phases.

A *phase* is a fixed set of live branches. It is planned once: every branch's leaf segment is
planned as long as it can grow in the phase (keys not yet written sit at positions after every query,
so the position mask hides them), so each step only advances device tensors in place — the token
fed, its position, its KV slot, the step counter — and the same attention plan serves every step and
layer. On CUDA the step is captured once per phase as a CUDA graph and replayed.

The host looks at the generated tokens every ``sync_every`` steps (every step on the CPU): branches
that hit EOS, a stop string or ``max_tokens`` are finished there, their extra tokens dropped. On CUDA
this is pipelined: a block's tokens are copied to the host asynchronously and read while the next
block's steps already run, so the decode loop never drains the GPU (a finished branch may run one
block longer; its extra tokens are dropped). When at
most half the branches are still live, the phase ends and a new, smaller one is planned, so finished
branches leave the batch; those that take nothing more (``GenRequest.final``) free their KV then. Sampling is counter-based (see :mod:`treegen.runtime.sampler`), so a
branch's tokens do not depend on phases, batch composition or ``sync_every``.
"""

from __future__ import annotations

import dataclasses

import torch

from treegen.runtime.cuda_graph import capture
from treegen.runtime.sampler import SamplingParams, sample


class Decoder:
    """Generates for a list of requests of one :class:`~treegen.runtime.engine.TreeRun`."""

    def __init__(self, run, gens) -> None:
        self.tree_run, self.gens = run, gens
        self.model, self.tree, self.kv = run.model, run.tree, run.kv
        self.tokenizer = run.engine.tokenizer
        self.eos = self.model.eos_token_ids
        device = self.model.device
        self.graphs = run.engine.cuda_graphs and device.type == "cuda"
        self.sync_every = 8 if device.type == "cuda" else 1
        self.out: list[list[int]] = [[] for _ in gens]
        self.logprobs: list[list[float]] = [[] for _ in gens]
        self.results: list = [None] * len(gens)
        params = [g.params for g in gens]
        self.temperature = torch.tensor([float(p.temperature) for p in params], device=device)
        self.top_p = torch.tensor([float(p.top_p) for p in params], device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        self.keys = torch.tensor([g.key for g in gens], dtype=torch.int64, device=device)
        self.all_greedy = all(p.temperature == 0 for p in params)
        self.filter_needed = any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params)

    def _sample(self, logits, idx, steps):
        return sample(logits, temperature=self.temperature[idx], top_p=self.top_p[idx], top_k=self.top_k[idx],
                      keys=self.keys[idx], steps=steps, all_greedy=self.all_greedy, filter_needed=self.filter_needed)

    def run(self, first_logits: torch.Tensor) -> list:
        """``first_logits [len(gens), vocab]``: the logits each branch's first token is drawn from."""
        device = self.model.device
        everyone = torch.arange(len(self.gens), device=device)
        first = self._sample(first_logits, everyone, torch.zeros(len(self.gens), dtype=torch.int64, device=device))
        first_lp = first_logits.log_softmax(-1).gather(1, first.unsqueeze(1)).squeeze(1)
        live = []
        for b, (t, lp) in enumerate(zip(first.tolist(), first_lp.tolist())):
            self._accept(b, [t], [lp])
            if self.results[b] is None:
                live.append(b)
            elif self.gens[b].final:
                self.kv.free(self.gens[b].node)
        self._report()
        while live:
            live = self._phase(live)
        return self.results

    def _report(self) -> None:
        hook = self.tree_run.engine.on_step
        if hook is not None:
            live = [b for b in range(len(self.gens)) if self.results[b] is None]
            done = sum(len(o) for o in self.out)
            hook(len(live), done, done + sum(self.gens[b].params.max_tokens - len(self.out[b]) for b in live))

    # ---------------------------------------------------------------------------------------------
    def _accept(self, b: int, new: list[int], logprobs: list[float]) -> bool:
        """Append branch ``b``'s new tokens up to where it finishes; True when it finished."""
        out, before = self.out[b], len(self.out[b])
        result = None
        for t, lp in zip(new, logprobs):
            out.append(t)
            self.logprobs[b].append(lp)
            result = finished(out, self.gens[b].params, self.eos, self.tokenizer)
            if result is not None:
                self.results[b] = dataclasses.replace(result, logprobs=tuple(self.logprobs[b]))
                break
        self.tree.extend(self.gens[b].node, out[before:])  # one extend per branch per sync
        return result is not None

    def _phase(self, live: list[int]) -> list[int]:
        tree, kv, model = self.tree, self.kv, self.model
        device = model.device
        self.tree_run.decode_phases.append(len(live))
        nodes = [self.gens[b].node for b in live]
        remaining = [self.gens[b].params.max_tokens - len(self.out[b]) for b in live]
        rows = [(n, len(tree.tokens(n)) - 1) for n in nodes]  # each branch's pending last token
        input_ids, slots, plan = self.tree_run.plan_rows(rows, grow={n: r for n, r in zip(nodes, remaining)})
        slot_limit = slots + torch.tensor(remaining, device=device) - 1  # never write past a reservation
        idx = torch.tensor(live, device=device)
        steps = torch.tensor([len(self.out[b]) for b in live], dtype=torch.int64, device=device)
        width = max(remaining)
        buf = torch.zeros(len(live), width, dtype=torch.int64, device=device)
        lp_buf = torch.zeros(len(live), width, dtype=torch.float32, device=device)
        column = torch.zeros(len(live), 1, dtype=torch.int64, device=device)
        attend = self.tree_run.attend_fn(plan, slots)

        def step() -> None:
            logits = model.forward(input_ids, plan.query_pos, attend)
            nxt = self._sample(logits, idx, steps)
            buf.scatter_(1, column, nxt.unsqueeze(1))
            lp_buf.scatter_(1, column, logits.log_softmax(-1).gather(1, nxt.unsqueeze(1)))
            input_ids.copy_(nxt)
            plan.query_pos.add_(1)
            torch.minimum(slots + 1, slot_limit, out=slots)
            steps.add_(1)
            column.add_(1)

        replay = self._capture(step) if self.graphs and plan.backend == "triton" else None
        pipelined = device.type == "cuda"
        done_steps, still, pending = 0, list(live), None
        for t in range(width):
            (replay or step)()
            self.tree_run.forward_passes += 1
            if (t + 1) % self.sync_every and t + 1 < width:
                continue
            block = _Block(buf, lp_buf, done_steps, t + 1, pipelined)
            done_steps = t + 1
            if pipelined:  # look at the previous block while this one's steps run: the GPU never waits
                block, pending = pending, block
                if block is None:
                    continue
            still = self._settle(live, block)
            if not still or 2 * len(still) <= len(live):
                break
        if pending is not None:  # every step run is accepted (finished branches ignore theirs)
            still = self._settle(live, pending)
        for b, n in zip(live, nodes):
            if self.results[b] is not None and self.gens[b].final:
                kv.free(n)  # a finished branch that takes nothing more gives its KV back at once
            else:  # KV is written for every token but each branch's last
                kv.segments[n].computed = len(tree.tokens(n)) - 1
        self._report()
        return still

    def _settle(self, live: list[int], block: "_Block") -> list[int]:
        """Accept a block of sampled tokens for the branches still live; returns those still live after."""
        tokens, lps = block.read()
        still = [b for j, b in enumerate(live) if self.results[b] is None and not self._accept(b, tokens[j], lps[j])]
        self._report()
        return still

    @staticmethod
    def _capture(step):
        """Capture ``step`` as a CUDA graph; returns a replay function for the phase's steps. Capturing
        runs the step once for real, which is the phase's first step, so the first call does nothing."""
        graph = capture(step)
        first = [True]

        def replay():
            if first[0]:
                first[0] = False
                return
            graph.replay()

        return replay


class _Block:
    """Columns ``[begin, end)`` of a phase's sampled tokens and log-probabilities, on their way to the
    host. ``pipelined``: copied asynchronously into pinned memory (ordered after the steps that wrote
    them), so the host can read them while later steps already run; else read at once."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, begin: int, end: int, pipelined: bool) -> None:
        self.tokens, self.logprobs = tokens[:, begin:end], logprobs[:, begin:end]
        self.event = None
        if pipelined:  # into pinned host memory, so the copies are truly asynchronous
            self.tokens = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True).copy_(
                self.tokens, non_blocking=True)
            self.logprobs = torch.empty(self.logprobs.shape, dtype=self.logprobs.dtype, pin_memory=True).copy_(
                self.logprobs, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> tuple[list[list[int]], list[list[float]]]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()


def finished(tokens: list[int], params: SamplingParams, eos: set[int], tokenizer):
    """The :class:`~treegen.runtime.engine.GenResult` of a branch whose generated ``tokens`` end
    it (stop string, EOS, ``max_tokens``), else None."""
    from treegen.runtime.engine import GenResult

    if params.stop:
        text = tokenizer.decode(tokens)
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            return GenResult(tuple(tokens), text[: min(hits)], "stop")
    if tokens[-1] in eos and not params.ignore_eos:
        return GenResult(tuple(tokens), tokenizer.decode(tokens[:-1], skip_special_tokens=True), "eos")
    if len(tokens) >= params.max_tokens:
        return GenResult(tuple(tokens), tokenizer.decode(tokens, skip_special_tokens=True), "length")
    return None
