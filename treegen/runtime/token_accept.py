"""Taking a decode block's tokens: each branch's new tokens appended up to where it finishes (EOS, a stop
string, ``max_tokens``, a constraint's end), its matcher or token automaton advanced, finished branches'
results made and their jobs completed — the part of :class:`~treegen.runtime.decode.Decoder` that runs on
the host every ``sync_every`` steps (:class:`TokenAcceptance`, a base of the decoder; it reads the decoder's
per-branch lists: ``jobs``, ``out``, ``logprobs``, ``plain``, ``state``, ``masks``)."""

from __future__ import annotations

import dataclasses
import time

from treegen.runtime.phase_io import TokenBlock
from treegen.runtime.requests import GenResult
from treegen.runtime.sampler import SamplingParams


class TokenAcceptance:
    """Settling blocks of sampled tokens into the decoder's branches (see module doc)."""

    def _settle(self, live: list[int], block: "TokenBlock", advance: bool = True) -> None:
        """Accept a block of sampled tokens of the phase's branches ``live`` (those still live).
        ``advance``: the constrained branches' matchers take the tokens (False: they have already)."""
        tokens, lps = block.read()
        started = time.perf_counter()
        if advance:
            self._advance_matchers(live, tokens)
        jobs, outs, logprobs, quick, limit, eos_ends, eos = (self.jobs, self.out, self.logprobs, self.quick,
                                                             self.limit, self.eos_ends, self.eos)
        state, walk = self.state, self.run.engine.automata.walk if self.state else None
        may_stop = self._may_stop(live, tokens)
        # (branch, result) of the branches this block ends, in row order (see _accept): they complete after the
        # loop, their texts decoded at once. (So a completion that cancels another job — a program over its
        # max_program_tokens — comes after that job's tokens of this block are taken and streamed.)
        ending: list = []
        taken = 0
        for j, b in enumerate(live):
            job = jobs[b]
            if job.done:  # (finished, or cancelled by a callback of an earlier branch)
                continue
            # the usual case, inline: a branch that goes on (the part of _accept's first branch that ends nothing)
            if quick[b] or (j not in may_stop and job.on_tokens is None):
                new, out = tokens[j], outs[b]
                if len(out) + len(new) < limit[b] and not (eos_ends[b] and not eos.isdisjoint(new)):
                    out.extend(new)  # (its node takes them later: see _catch_up)
                    logprobs[b].extend(lps[j])
                    taken += len(new)
                    if state and b in state:  # (a token automaton's branch: its mask allowed every token)
                        state[b] = walk(state[b], new)
                    continue
            self._accept(b, tokens[j], lps[j], j not in may_stop, ending)
        self.tokens_done += taken
        if ending:  # the texts still to decode in one batched call, then the jobs complete in row order
            untold = [r for _, r in ending if r.text is None]
            texts = iter(self.run.engine.batch_decode([r.tokens[:-1] if r.finish_reason == "eos" else r.tokens
                                                       for r in untold], skip_special_tokens=True))
            for b, result in ending:
                if result.text is None:
                    result = dataclasses.replace(result, text=next(texts))
                if not jobs[b].done:  # (cancelled by a callback of a job completed before it)
                    self._complete(b, result)
        self.live = [b for b in self.live if not self.jobs[b].done]
        self._report()
        self.run.host_seconds["accept"] += time.perf_counter() - started

    # ---------------------------------------------------------------------------------------------
    def _advance_matchers(self, branches: list[int], tokens: list[list[int]]) -> None:
        """Advance the matchers of the live constrained ``branches`` by their new tokens (one each:
        a phase with a constrained branch reads its tokens every step), in one batch."""
        if self.masks is None:
            return
        taking = [(b, new) for b, new in zip(branches, tokens) if b in self.masks and not self.jobs[b].done]
        if any(len(new) != 1 for _, new in taking):
            raise RuntimeError("a constrained branch was given several tokens at once")
        self.masks.accept([b for b, _ in taking], [new[0] for _, new in taking])

    def _may_stop(self, branches: list[int], tokens: list[list[int]]) -> set[int]:
        """The indices ``j`` of ``branches`` whose stop strings may end within their new ``tokens[j]``
        (:meth:`~treegen.runtime.stop_strings.StopStrings.may_stop`, one batched decode of their texts'
        tails); the others take their tokens without a stop string check after each."""
        jobs, outs = self.jobs, self.out
        asked = [j for j, b in enumerate(branches) if not self.plain[b] and not jobs[b].done]  # (plain: no stop strings)
        if not asked:
            return set()
        maybe = self.run.engine.stop_strings.may_stop([outs[branches[j]] for j in asked], [tokens[j] for j in asked],
                                                      [jobs[branches[j]].request.params.stop for j in asked])
        return {j for j, m in zip(asked, maybe) if m}

    def _accept(self, b: int, new: list[int], logprobs: list[float], stop_free: bool = False,
                ending: list | None = None) -> bool:
        """Append branch ``b``'s new tokens up to where it finishes; True when it finished (its job
        is then complete). A constrained branch's matcher has taken them already (``_advance_matchers``).
        ``stop_free``: no stop string of the branch can end within ``new`` (``_may_stop``), so only EOS and
        ``max_tokens`` decide where it ends. ``ending``: where a finished branch goes, ``(b, result)``, for
        the caller to complete — an EOS or ``max_tokens`` result with its text still to decode (None: it
        completes here)."""
        job = self.jobs[b]
        out = self.out[b]
        if self.in_tree[b] < len(out):  # (its node first takes the tokens the fast path left it behind by)
            self._catch_up((b,))
        before = len(out)
        result = None
        masks = self.masks if self.masks is not None and b in self.masks else None
        state = self.state.get(b)
        automata = self.run.engine.automata if state is not None else None
        params = job.request.params
        if masks is None and automata is None and (stop_free or not params.stop):
            # only EOS and max_tokens can end it: cut where the first does, take the tokens at once
            cut = max(0, min(len(new), params.max_tokens - before))
            ends = before + cut >= params.max_tokens
            if not params.ignore_eos and not self.eos.isdisjoint(new[:cut]):
                cut = next(i for i, t in enumerate(new) if t in self.eos) + 1
                ends = True
            out.extend(new[:cut])
            self.logprobs[b].extend(logprobs[:cut])
            result = None
            if cut > 0 and ends:
                result = finished(out, params, self.eos, self.tokenizer, stop_free, text=ending is None)
        else:  # token by token: a stop string, a matcher or an automaton decides after each one
            for t, lp in zip(new, logprobs):
                out.append(t)
                self.logprobs[b].append(lp)
                prior, state = state, (automata.walk(state, (t,)) if automata is not None else None)
                result = finished(out, params, self.eos, self.tokenizer)
                if result is not None:
                    if masks is not None:
                        met = masks.matched(b)
                        masks.drop(b)
                    else:  # (a stop token is allowed only where the text is complete)
                        met = (prior if result.finish_reason == "eos" else state) in automata.final if automata else None
                    if met is not None:
                        # EOS where the text is not complete: the constraint had no other token (open_dead_ends)
                        dead = result.finish_reason == "eos" and not met
                        result = dataclasses.replace(result, constraint_met=met,
                                                     finish_reason="dead_end" if dead else result.finish_reason)
                    break
        if automata is not None:
            if result is None:
                self.state[b] = state
            else:
                del self.state[b]
        # one extend per branch per sync; a final EOS stays out of the node (GenResult.context): its KV was
        # never computed (the last sampled token has none), so nothing is written or freed for it
        end = len(out) - 1 if result is not None and result.ends_on_eos else len(out)
        self.tree.extend(job.request.node, out[before:end])
        self.in_tree[b] = len(out)  # (all its tokens accounted for: a final EOS never goes into the node)
        self.tokens_done += len(out) - before
        if job.on_tokens is not None:
            job.on_tokens(tuple(out))
        if result is None:
            return False
        if ending is not None:
            ending.append((b, result))
        else:
            self._complete(b, result)
        return True

    def _catch_up(self, branches) -> None:
        """The nodes of ``branches`` take the tokens of theirs that they do not hold yet, in one call. The fast path
        of :meth:`_settle` only extends a going-on branch's ``out`` (its node's copy costs more than the rest of
        the row's settle, a lookup of scattered objects); its node catches up here: before the branch takes the
        slow path (which ends or streams it) and when its phase's steps end, before anything reads the node's
        tokens (room, pauses, the KV's ``computed``, the next plan). Within a phase nothing else reads a live
        branch's node: programs resumed by its completions read finished branches, a tensor-parallel follower
        that takes rank 0's graph holds the same counts and catches up alike, and a radix match of an arriving
        prompt sees a shorter live leaf (a shorter match, never a wrong one)."""
        out, in_tree, jobs = self.out, self.in_tree, self.jobs
        behind = [b for b in branches if in_tree[b] < len(out[b])]  # (a cancelled branch too: its KV stays)
        if behind:
            self.tree.extend_leaves([jobs[b].request.node for b in behind], [out[b][in_tree[b]:] for b in behind])
            for b in behind:
                in_tree[b] = len(out[b])

    def _complete(self, b: int, result: GenResult) -> None:
        """Branch ``b``'s job is complete with ``result`` (its log-probabilities and KV facts added)."""
        job = self.jobs[b]
        self.run.complete(job, dataclasses.replace(result, logprobs=tuple(self.logprobs[b]),
                                                   kv_keep=job.request.params.kv_keep,
                                                   kv_dropped=self.kv.dropped(job.request.node)))

    def _report(self) -> None:
        hook = self.run.engine.on_step
        if hook is not None:
            left = sum(self.jobs[b].request.params.max_tokens - len(self.out[b]) for b in [*self.live, *self.paused.values()])
            hook(len(self.live), self.tokens_done, self.tokens_done + left)


def finished(tokens: list[int], params: SamplingParams, eos: set[int], tokenizer,
             stop_free: bool = False, text: bool = True) -> GenResult | None:
    """The :class:`~treegen.runtime.requests.GenResult` of a branch whose generated ``tokens`` end
    it (stop string, EOS, ``max_tokens``), else None. ``stop_free``: the caller knows that no stop
    string is in their text (``Decoder._may_stop``), which is then not decoded to look. ``text``
    False: a result of EOS or ``max_tokens`` has ``text=None`` — the caller decodes it (``tokens``
    without the EOS, special tokens skipped), with others' at once."""
    if params.stop and not stop_free:
        text = tokenizer.decode(tokens)
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            return GenResult(tuple(tokens), text[: min(hits)], "stop")
    if tokens[-1] in eos and not params.ignore_eos:
        return GenResult(tuple(tokens), tokenizer.decode(tokens[:-1], skip_special_tokens=True) if text else None, "eos")
    if len(tokens) >= params.max_tokens:
        return GenResult(tuple(tokens), tokenizer.decode(tokens, skip_special_tokens=True) if text else None, "length")
    return None
