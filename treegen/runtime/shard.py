"""Which part of each weight one tensor-parallel rank holds (the Megatron split gpt-fast and vLLM use).

A model split over ``size`` ranks keeps, on rank ``rank``:

* its share of the attention heads: query heads ``[rank * H / size, (rank + 1) * H / size)`` and the
  KV heads they read — ``Hkv / size`` of them, or, when there are fewer KV heads than ranks, the one
  KV head its query heads share (replicated on ``size / Hkv`` ranks);
* q/k/v and gate/up **by rows** (column-parallel: each rank computes its heads' / its slice of the
  MLP's channels from the whole hidden state); o and down **by columns** (row-parallel: each rank's
  product is a partial sum of the whole output, completed by one all-reduce after each);
* the output biases of o and down on rank 0 only (added once by the all-reduce's sum), the norms and
  the embedding whole on every rank;
* the LM head whole on every rank (every rank computes the same logits from the same all-reduced
  hidden state), or, with ``vocab_parallel``, **by vocabulary**: rank ``r`` holds the rows of tokens
  :meth:`Shard.vocab` gives it (``ceil(V / size)`` rounded up to a multiple of ``VOCAB_ALIGN``, the
  last rank the rest) and computes only those logits; :mod:`treegen.runtime.vocab_split` gathers
  them, and the sampler draws from them exactly as from the whole logits.

The embedding stays whole even with a split head: a lookup of a few rows costs nothing, while a
split one needs an all-reduce of ``[tokens, hidden]`` in every forward (one more per decode step
besides the two per layer), to save ``(size - 1) / size`` of ``V x hidden`` per rank (0.5 GB of
Llama-3-8B's bf16 embedding at ``size`` 2). A tied model's head is then a view of the embedding's rows.

A slice is a :data:`Part`: ``(axis, [(start, stop), ...])`` — the weight's ranges along ``axis``,
concatenated. Example: rank 1 of 2 of a fused q/k/v weight with 4 query and 2 KV heads of dim 8
takes rows ``(0, [(16, 32), (40, 48), (56, 64)])`` (its 2 query heads, its KV head's k and v rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

Part = tuple[int, list[tuple[int, int]]]

# the tokens per rank of a split LM head are a multiple of this: a constraint's token bitmask (32 tokens
# per int32 word) then splits along whole words
VOCAB_ALIGN = 32


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks; ``size == 1`` is the whole model."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"a shard is rank in [0, size) with size >= 1, got rank={self.rank!r} size={self.size!r}")

    def heads(self, heads: int, kv_heads: int) -> tuple[range, range]:
        """(this rank's query heads, its KV heads) of a model with ``heads`` / ``kv_heads``."""
        per = heads // self.size
        if kv_heads >= self.size:
            kv_per = kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per), range(self.rank * kv_per, (self.rank + 1) * kv_per)
        first = self.rank * kv_heads // self.size  # the KV head of this rank's query heads
        return range(self.rank * per, (self.rank + 1) * per), range(first, first + 1)

    def channels(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` MLP channels."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of a vocabulary of ``n`` tokens split over the ranks: ``vocab_per_rank``
        tokens each, the last rank the rest (fewer: uneven slices, never padded weights)."""
        per = vocab_per_rank(n, self.size)
        start = min(self.rank * per, n)
        return start, min(start + per, n)


def vocab_per_rank(n: int, size: int) -> int:
    """Tokens per rank of a vocabulary of ``n`` split over ``size`` ranks (the last rank may hold fewer)."""
    per = -(-n // size)
    return -(-per // VOCAB_ALIGN) * VOCAB_ALIGN


VOCAB_PARALLEL_CHOICES = (True, False, "auto")


def vocab_parallel_for(value, size: int, vocab_size: int | None = None) -> bool:
    """Whether the LM head is split by vocabulary: ``value`` is True, False or ``"auto"`` (split
    whenever the model is tensor parallel and its vocabulary splits into a non-empty slice per rank).
    Raises :class:`TensorParallelError` for another value, for True without tensor parallel, or for True
    with a vocabulary too small to split (``vocab_size`` None: not checked yet). Cheap: before any weight."""
    if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
        raise TensorParallelError(f"vocab_parallel must be True, False or 'auto', got {value!r}")
    if value is False or size == 1:
        if value is True:
            raise TensorParallelError("vocab_parallel=True splits the LM head over tensor-parallel ranks: it needs "
                                      "tensor_parallel > 1")
        return False
    fits = vocab_size is None or vocab_per_rank(vocab_size, size) * (size - 1) < vocab_size
    if value is True and not fits:
        raise TensorParallelError(f"a vocabulary of {vocab_size} tokens is too small to split over {size} ranks "
                                  f"({vocab_per_rank(vocab_size, size)} tokens each would leave the last rank none); "
                                  f"use vocab_parallel=False")
    return fits


def check_tensor_parallel(config, size: int) -> None:
    """Raise :class:`TensorParallelError` unless a model of ``config`` splits over ``size`` ranks.
    Cheap (the config only): runs before any weight is read."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise TensorParallelError(f"tensor_parallel must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(config.intermediate_size)
    name = getattr(config, "model_type", "?")
    if heads % size:
        raise TensorParallelError(f"tensor_parallel={size} does not divide the {heads} attention heads of this "
                                  f"{name} model; use a divisor of {heads}")
    if kv_heads % size and size % kv_heads:
        raise TensorParallelError(f"tensor_parallel={size} neither divides nor is a multiple of the {kv_heads} KV "
                                  f"heads of this {name} model")
    if inter % size:
        raise TensorParallelError(f"tensor_parallel={size} does not divide the MLP's {inter} channels")
    from treegen.runtime.families import FAMILIES

    family = FAMILIES.get(name)
    if family is not None and family.qk_norm == "proj":
        raise TensorParallelError(f"tensor parallel does not support {name}'s q/k norm over the whole projection "
                                  f"(it would need an all-reduce inside the norm); run it with tensor_parallel=1")


def take(t: Tensor, part: Part | None) -> Tensor:
    """The ranges ``part`` of ``t`` concatenated (``t`` itself for None); a copy when sliced."""
    if part is None:
        return t
    axis, ranges = part
    pieces = [t.narrow(axis, a, b - a) for a, b in ranges]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=axis)


def part_shape(shape: tuple, part: Part | None) -> tuple:
    """The shape of ``take(t, part)`` for ``t`` of ``shape``."""
    if part is None:
        return tuple(shape)
    axis, ranges = part
    out = list(shape)
    out[axis] = sum(b - a for a, b in ranges)
    return tuple(out)


__all__ = ["Part", "Shard", "TensorParallelError", "VOCAB_ALIGN", "VOCAB_PARALLEL_CHOICES", "check_tensor_parallel",
           "part_shape", "take", "vocab_parallel_for", "vocab_per_rank"]
