"""Sampling parameters and a batched, per-branch-seeded sampler.

Randomness is counter-based: the noise for branch ``b`` at its step ``t`` is a hash of
``(key_b, t, token id)``, where ``key_b`` comes from the program seed and the branch's path in the
tree. So a branch draws the same tokens whatever else is in the batch and in whatever order work is
scheduled, and sampling needs no per-branch generator objects or Python loop over branches.
Sampling is Gumbel-max over the temperature-scaled, top-k / top-p filtered logits, which draws
exactly from the filtered softmax distribution. ``temperature == 0`` is greedy (argmax).

:func:`pick` draws a step's tokens and their log-probabilities, also from logits split by vocabulary
over tensor-parallel ranks (:mod:`treegen.runtime.vocab_split`): since a token's noise depends only
on ``(key, step, token id)``, each rank scores its own tokens, and the best score of all ranks (the
lowest token id among equal ones, as ``argmax`` over the whole row) is the token ``sample`` draws
from the whole logits. Top-p / top-k need the whole distribution: the logits are then gathered.

On CUDA a step without top-p / top-k draws in one pass over the logits, the noise made in registers
(:func:`treegen.kernels.sampling.gumbel_argmax`, the same tokens as the PyTorch ops here, which serve the
CPU and top-p / top-k rows).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from treegen.kernels import sampling
from treegen.kernels.filter_floor import filter_floor, filter_floor_reference
from treegen.kernels.sampling import gumbel_noise
from treegen.runtime.constraint import Constraint
from treegen.runtime.swa import check_kv_keep
from treegen.runtime.token_masks import apply_bitmask

@dataclass(frozen=True)
class SamplingParams:
    """How one ``gen`` samples. Validated on construction; errors name the parameter.

    max_tokens: new tokens at most (>= 1). temperature: 0 = greedy (the default), else > 0.
    top_p: nucleus mass in (0, 1]. top_k: keep the k most likely tokens, 0 = all.
    stop: strings that end generation (the value excludes the stop string). seed: overrides the
    program seed for this ``gen``; None = derive from the program seed and the branch path.
    ignore_eos: keep generating past end-of-sequence tokens (benchmarks: exactly max_tokens).
    constraint: what the text must be (a regex, choices, a JSON schema or a grammar, see
    :mod:`treegen.runtime.constraint`); the gen then ends where its constraint is complete (the model
    draws EOS, which the constraint allows only there), so it takes no stop strings and no ignore_eos.
    kv_keep: not how a token is drawn but how the branch attends — None (exact attention, the default)
    or the fraction in (0, 1] of the branch's own KV that sparse window attention keeps (lossy; see
    :mod:`treegen.runtime.swa`).
    jump_forward: a constrained gen's text starts with what its constraint forces (``"The answer is "`` of
    ``regex="The answer is [0-9]+"``, ``{"answer": `` of a JSON schema) written at once — tokenized as the
    tokenizer writes it, its last token left to the model (it may join what follows), prefilled with the
    prompt instead of decoded a step a token (:meth:`~treegen.runtime.constraint.Grammars.forced_prefix`);
    those tokens' log-probabilities are 0 (the constraint allowed nothing else). None: the engine's
    setting (off unless ``Engine(jump_forward=True)``). Off, greedy text is exactly the model's.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    constraint: Constraint | None = None
    kv_keep: float | None = None
    jump_forward: bool | None = None

    def __post_init__(self) -> None:
        given_stop = self.stop  # (messages show it as written, not as the tuple it becomes)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {given_stop!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.kv_keep is not None:
            object.__setattr__(self, "kv_keep", check_kv_keep(self.kv_keep))
        if self.jump_forward is not None and not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward must be True, False or None, got {self.jump_forward!r}")
        if self.jump_forward and self.constraint is None:
            raise ValueError("jump_forward=True needs a constraint (regex, choices, json_schema or grammar): "
                             "it writes the text a constraint forces")
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise ValueError(f"constraint must be a Constraint or None, got {type(self.constraint).__name__}")
            if self.stop:
                raise ValueError(f"a constrained gen ({self.constraint}) ends where its constraint is complete: "
                                 f"it takes no stop strings, got stop={self.stop!r}")
            if self.ignore_eos:
                raise ValueError(f"a constrained gen ({self.constraint}) ends on EOS where its constraint is "
                                 "complete: ignore_eos=True is not allowed with it")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def branch_key(seed: int, path: tuple) -> int:
    """A 32-bit key for a branch from a seed and its path in the program (fork indices, gen index)."""
    digest = hashlib.blake2b(repr((seed, tuple(path))).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def sample(logits: Tensor, *, temperature: Tensor, top_p: Tensor, top_k: Tensor, keys: Tensor, steps: Tensor,
           all_greedy: bool = False, filter_needed: bool = True) -> Tensor:
    """Sample one token per row.

    logits: [B, V] fp32; temperature, top_p: [B] float; top_k: [B] int64 (0 = all);
    keys, steps: [B] int64 (see :func:`treegen.kernels.sampling.uniform_noise`). Returns [B] int64 token ids.
    all_greedy / filter_needed: host-side facts about the batch's parameters (no device sync here):
    every row greedy → argmax only; no row with top_p < 1 or top_k > 0 → the sort is skipped.
    """
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    if filter_needed:
        scaled = scaled.masked_fill(scaled < filter_floor_reference(scaled, top_p, top_k).unsqueeze(1), float("-inf"))
    if logits.device.type == "cpu":  # noise only for the tokens that can win (the same draw)
        sampled = sampling.gumbel_argmax_sparse(scaled, keys, steps)
    else:
        sampled = (scaled + gumbel_noise(keys, steps, logits.shape[1])).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)


def pick(logits: Tensor, *, temperature: Tensor, top_p: Tensor, top_k: Tensor, keys: Tensor, steps: Tensor,
         all_greedy: bool = False, filter_needed: bool = True, bitmask: Tensor | None = None,
         split=None) -> tuple[Tensor, Tensor]:
    """A step's tokens and their log-probabilities under the model (before a constraint's mask):
    ``(tokens [B] int64, logprobs [B] float32)``; the tokens are :func:`sample`'s.

    logits: [B, V] fp32 (or the model's 16-bit logits: read by the sampling kernel as they are, and
    copied to fp32 for the PyTorch ops), the whole vocabulary's; or, with ``split`` (a
    :class:`~treegen.runtime.vocab_split.VocabSplit`), this rank's slice ``[B, split.width]``: every
    rank of the group calls this alike and gets the same tokens, those :func:`sample` draws from the
    whole logits. bitmask: ``[B, ceil(V / 32)]`` int32 on the logits' device (the whole vocabulary's:
    a constraint's allowed tokens, :func:`~treegen.runtime.token_masks.apply_bitmask`) or None (the
    PyTorch path masks ``logits`` in place; the kernel leaves them as they are). The other arguments
    are :func:`sample`'s. No host sync (a CUDA graph captures it, collectives included)."""
    args = dict(temperature=temperature, top_p=top_p, top_k=top_k, keys=keys, steps=steps, all_greedy=all_greedy,
                filter_needed=filter_needed)
    filtered = filter_needed and not all_greedy
    one_pass = sampling.available(logits)  # the kernel (top-p / top-k: past the floor that filter_floor finds)
    if logits.dtype != torch.float32 and not one_pass:
        logits = logits.float()  # (only the one-pass kernel reads 16-bit logits)
    if split is not None and filtered:  # top-p / top-k sort the whole distribution
        logits, split = split.gather(logits), None
    if split is not None:
        return _pick_split(logits, split, bitmask, **args)
    if one_pass:  # one pass, the noise in registers
        drawn = sampling.gumbel_argmax(logits, temperature, keys, steps, bitmask, all_greedy=all_greedy)
        if filtered:  # top-p / top-k: a row whose token is outside its filter draws again above its floor
            floor = filter_floor(logits, temperature, top_p, top_k, bitmask, winner=drawn[2])
            drawn = sampling.gumbel_argmax(logits, temperature, keys, steps, bitmask, floor=floor, redo=drawn)
        tokens, _, logit, lse = drawn
        return tokens, logit - lse
    if bitmask is None:
        tokens = sample(logits, **args)
        return tokens, logits.log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    lse = logits.logsumexp(-1)
    apply_bitmask(logits, bitmask)
    tokens = sample(logits, **args)
    return tokens, logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse


def _pick_split(logits: Tensor, split, bitmask: Tensor | None, *, temperature: Tensor, top_p: Tensor,
                top_k: Tensor, keys: Tensor, steps: Tensor, all_greedy: bool, filter_needed: bool
                ) -> tuple[Tensor, Tensor]:
    """:func:`pick` of unfiltered rows from this rank's slice of the logits. Each rank finds its best
    token by the score whose argmax :func:`sample` takes (the logit for greedy rows, the scaled logit
    plus its Gumbel noise for the others) and sends, per row, (score, token id, its logit, the
    log-sum-exp of its slice): one all-gather of ``[B, 4]`` fp32. The token of the best score (the
    lowest rank among equal ones) is the whole row's argmax; its log-probability is its logit less the
    log-sum-exp over the ranks' log-sum-exps."""
    if sampling.available(logits):  # one pass over the slice, the noise in registers
        best, score, logit, lse = sampling.gumbel_argmax(
            logits, temperature, keys, steps, None if bitmask is None else split.bitmask(bitmask), start=split.start,
            all_greedy=all_greedy)
        return _combine_ranks(split, torch.stack([score, (best + split.start).float(), logit, lse], dim=1))
    lse = logits.logsumexp(-1, keepdim=True)  # this rank's part of the normaliser, before the mask
    if bitmask is not None:
        apply_bitmask(logits, split.bitmask(bitmask))
    score = logits
    if not all_greedy:
        scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
        score = torch.where((temperature == 0).unsqueeze(1), logits,
                            scaled + gumbel_noise(keys, steps, split.width, start=split.start))
    best = score.argmax(-1, keepdim=True)  # [B, 1]: the lowest id among equal scores, as argmax of the whole row
    return _combine_ranks(split, torch.cat([score.gather(1, best), (best + split.start).float(),
                                            logits.gather(1, best), lse], dim=1))


def _combine_ranks(split, mine: Tensor) -> tuple[Tensor, Tensor]:
    """Every rank's ``[B, 4]`` (best score, its token id, its logit, the slice's log-sum-exp) → the
    whole row's token and log-probability (see :func:`_pick_split`)."""
    every = split.tp.all_gather(mine)  # [ranks, B, 4]
    winner = every[:, :, 0].argmax(0)  # [B]: the first rank among equal best scores
    row = every.gather(0, winner.view(1, -1, 1).expand(1, -1, every.shape[2])).squeeze(0)  # [B, 4]
    return row[:, 1].long(), row[:, 2] - every[:, :, 3].logsumexp(0)
