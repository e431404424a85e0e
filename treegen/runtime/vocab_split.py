"""Logits split by vocabulary over the ranks of a tensor-parallel group: which columns a rank holds,
and the whole logits back from the ranks' slices.

With ``vocab_parallel`` (:mod:`treegen.runtime.shard`) rank ``r`` of ``size`` computes the logits of
tokens ``[start, stop)`` only: ``per`` tokens each (a multiple of ``shard.VOCAB_ALIGN``), the last
rank the rest of the ``size`` tokens. What needs every token's logit (top-p / top-k filtering, the
scores of ``select`` choices, :meth:`~treegen.runtime.tree_run.TreeRun.prefill`) gathers them
(:meth:`VocabSplit.gather`: one all-gather of ``[rows, per]`` per rank); drawing a token and its
log-probability needs only a few numbers per row and rank (:func:`treegen.runtime.sampler.pick`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from treegen.runtime.shard import vocab_per_rank


class VocabSplit:
    """This rank's slice ``[start, stop)`` of a vocabulary of ``size`` tokens split over ``tp``'s group
    (a :class:`~treegen.runtime.distributed.TensorParallel`: its ``shard`` and ``all_gather``)."""

    def __init__(self, tp, size: int) -> None:
        if size > 1 << 24:  # (the sampler sends token ids as fp32, exact up to 2^24)
            raise ValueError(f"a vocabulary of {size} tokens is too large to split (at most 2^24)")
        self.tp = tp
        self.size = size
        self.start, self.stop = tp.shard.vocab(size)
        self.per = vocab_per_rank(size, tp.shard.size)
        if self.width < 1:
            raise ValueError(f"rank {tp.shard.rank} of {tp.shard.size} gets no token of a "
                             f"{size}-token vocabulary")

    @property
    def width(self) -> int:
        """Tokens of this rank's slice."""
        return self.stop - self.start

    def gather(self, local: Tensor) -> Tensor:
        """The whole logits ``[rows, size]`` from every rank's ``local [rows, width]`` (any dtype; every rank
        calls this with the same rows). The last rank's shorter slice is padded for the all-gather."""
        if local.shape[-1] != self.width:
            raise ValueError(f"this rank's logits have {local.shape[-1]} columns, its vocabulary slice {self.width}")
        if self.width < self.per:
            local = torch.nn.functional.pad(local, (0, self.per - self.width))
        every = self.tp.all_gather(local)  # [ranks, rows, per]
        return every.permute(1, 0, 2).reshape(local.shape[0], -1)[:, : self.size]

    def bitmask(self, bitmask: Tensor) -> Tensor:
        """The words of a token bitmask ``[rows, ceil(size / 32)]`` int32 that cover this rank's tokens
        (``start`` is a multiple of 32): ``[rows, ceil(width / 32)]``, contiguous."""
        first = self.start // 32
        return bitmask[:, first : first + -(-self.width // 32)].contiguous()

    def __repr__(self) -> str:
        return f"VocabSplit(tokens [{self.start}, {self.stop}) of {self.size}, rank {self.tp.shard.rank}/{self.tp.shard.size})"


__all__ = ["VocabSplit"]
