"""The grammar state of every constrained branch of a tree run, and the token bitmasks it gives.

Each constrained branch has its own xgrammar matcher (made from the compiled grammar that all
branches with the same constraint share, :class:`~treegen.runtime.constraint.Grammars`). After the
host accepts a branch's token it advances the matcher; before the branch's next token is sampled its
row of a bitmask ``[rows, ceil(vocab / 32)] int32`` is filled from the matcher (all of a batch's
rows at once, on xgrammar's thread pool) and :func:`apply_bitmask` sets the logits of the tokens it
forbids to ``-inf``. Rows of unconstrained or finished branches are all ones (nothing forbidden), so
one bitmask serves a mixed batch and its shape never changes during a decode phase.
"""

from __future__ import annotations

import torch

from treegen.runtime.constraint import Grammars


class TokenMasks:
    """Matchers by branch id; see the module doc."""

    def __init__(self, grammars: Grammars) -> None:
        import xgrammar as xgr

        self.grammars = grammars
        self.matchers: dict[int, object] = {}  # branch -> its xgrammar GrammarMatcher
        self._batch = xgr.BatchGrammarMatcher()

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
        for b, t, ok in zip(branches, tokens, taken):
            if not ok:
                raise RuntimeError(f"branch {b} drew token {t}, which its constraint forbids "
                                   "(its token mask was not applied)")

    def matched(self, branch: int) -> bool:
        """The branch's text so far is a complete match of its constraint."""
        m = self.matchers[branch]
        return m.is_terminated() or m.is_completed()

    def new_bitmask(self, rows: int, device=None, pinned: bool = False) -> torch.Tensor:
        """An all-ones (nothing forbidden) bitmask of ``rows`` rows."""
        return torch.full((rows, self.grammars.mask_width), -1, dtype=torch.int32, device=device,
                          pin_memory=pinned)

    def fill(self, bitmask: torch.Tensor, branches: list[int | None]) -> bool:
        """Write row ``j`` of the host ``bitmask`` for ``branches[j]``: its matcher's next-token mask,
        or all ones for None / an unconstrained / a finished branch. True when any row is constrained."""
        rows, free = [], []
        for j, b in enumerate(branches):
            m = self.matchers.get(b)
            (rows if m is not None and not m.is_terminated() else free).append(j)
        if free:
            bitmask[free] = -1
        if rows:
            self._batch.batch_fill_next_token_bitmask([self.matchers[branches[j]] for j in rows], bitmask, rows)
        return bool(rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits [rows, vocab]`` (fp32) to ``-inf`` where ``bitmask [rows, ceil(vocab / 32)]``
    (int32, on the logits' device) has a 0 bit, in place. On CUDA xgrammar's Triton kernel (no host
    sync, so a CUDA graph can capture it, reading the bitmask from its buffer); on the CPU its C++ loop."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
