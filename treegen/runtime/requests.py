"""What the language layer asks of a tree run, and what it gets back.

A :class:`GenRequest` or :class:`ScoreRequest` is submitted to a :class:`~treegen.runtime.tree_run.TreeRun`
and becomes a :class:`Job`: it waits for KV memory, is admitted, its new tokens are prefilled, and it
completes (its ``result`` set, its ``on_done`` called) as soon as its own work is done — other jobs
keep running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from treegen.runtime.sampler import SamplingParams


@dataclass(frozen=True)
class GenRequest:
    """Generate into ``node`` (a leaf owned by one branch). ``key``: the branch's random key.
    ``final``: the branch takes nothing more afterwards, so its KV may be freed once it is done
    (what lets a workload too big for memory run a part at a time). ``forced``: the gen's first tokens,
    already on ``node`` (jump-forward: what its constraint forces, see ``SamplingParams.jump_forward``)."""

    node: int
    params: SamplingParams
    key: int
    final: bool = False
    forced: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenResult:
    """A branch's generation: its tokens, the text (stop string excluded), why it ended, and the
    natural-log probability of each token under the model's distribution (before temperature,
    filtering and a constraint's token mask). ``constraint_met``: None for an unconstrained gen; for
    a constrained one True when the text is a complete match of its constraint, False when it ended
    before it could be — the text is then an incomplete prefix: ``max_tokens`` came first
    (``finish_reason="length"``), or the constraint allowed no next token, no text completing it
    (``finish_reason="dead_end"``: e.g. ``regex="a[^\\s\\S]"`` after ``a``; the branch drew EOS there).
    ``kv_keep``: None for exact attention; the keep ratio when the branch was generated with sparse
    window attention (lossy, :mod:`treegen.runtime.swa`). ``kv_dropped``: tokens of the branch's node whose
    KV SWA had dropped when it finished.

    ``tokens`` is the gen's whole output, its final EOS included; what stays on the branch's node, the
    context later text follows, is :attr:`context` — without that EOS (as SGLang appends a gen's text, EOS
    left out): a document goes on without an end-of-text mark in the middle, and a chat message's end
    adds its own end-of-turn token."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "dead_end" (a constraint's; see above)
    logprobs: tuple[float, ...] = ()
    constraint_met: bool | None = None
    kv_keep: float | None = None
    kv_dropped: int = 0

    @property
    def ends_on_eos(self) -> bool:
        """The last token is the EOS that ended the gen (``finish_reason`` "eos", or a constraint's
        "dead_end", where the branch drew EOS)."""
        return self.finish_reason in ("eos", "dead_end")

    @property
    def context(self) -> tuple[int, ...]:
        """The tokens the gen leaves on its branch's node: :attr:`tokens` without a final EOS."""
        return self.tokens[:-1] if self.ends_on_eos else self.tokens


@dataclass(frozen=True)
class ScoreRequest:
    """Score each child ``choices[i]`` of ``parent`` by its mean token log-probability."""

    parent: int
    choices: tuple[int, ...]


@dataclass(eq=False)
class Job:
    """A submitted request. ``result``: a :class:`GenResult`, the list of choice scores, or the
    exception that refused it (``error``). ``on_done(job)`` is called once, when it completes;
    ``on_tokens(tokens)`` (gens only) with every branch's tokens so far, each time new ones are seen.
    ``drawn``: tokens a gen had drawn when it last paused (0: it never has; see the scheduler's slices);
    ``queued``: a sliced gen's (aging window, arrival) when first submitted, the place it waits at again."""

    request: GenRequest | ScoreRequest
    on_done: Callable[["Job"], None] | None = None
    on_tokens: Callable[[tuple[int, ...]], None] | None = None
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    drawn: int = 0
    queued: tuple[int, int] | None = None

    @property
    def is_gen(self) -> bool:
        return isinstance(self.request, GenRequest)
