"""Sparse window attention (SWA, ALISA Algorithm 1): a branch keeps part of its own KV, lossy, opt-in.

``gen(..., kv_keep=r)`` (or ``Engine(kv_keep=r)`` for every gen that names none) keeps, of the KV of the
branch's own tokens — the tokens of its leaf node, whose segment no other branch reads — a fraction ``r``:

* the most recent tokens (*locally static*), and
* the earlier tokens with the largest attention weight summed over the last few decode steps
  (*globally dynamic*);

the rest of that KV is dropped for good. Shared nodes (the ancestors, read by many branches) stay dense.
Exact attention stays the default; a result generated with SWA says so (``GenResult.kv_keep``,
``state.info[name]["kv_keep"]``).

How it runs (the choices, and why):

* **Compaction, no kernel change.** A node's KV is one contiguous slot range (:mod:`~treegen.runtime.kv_store`)
  read by every layer. Dropping tokens moves the kept ones to the front of the leaf's range (one gather /
  scatter over all layers, :meth:`KVStore.keep`) and frees its tail for new tokens, so the tree kernels
  read the kept tokens as one dense block and the step stays regular — what the paper does with its
  gathered "sparse KV tensors". The attention mask compares positions, so a compacted segment is planned
  at the *mask* position ``node position + dropped`` (its written keys sit just before the next query,
  its unwritten tail after it) while the queries keep their true RoPE positions
  (:meth:`~treegen.runtime.tree_run.TreeRun.plan_rows`). Sliding-window layers compare true distances, so
  SWA is refused on models that have them.
* **A kept set per layer and KV head.** ALISA selects per layer, H2O per head. A compacted segment's
  keys are all visible to every query of its rows (they precede them), so the kernels never ask which
  token a slot holds: each layer and KV head keeps its own ``m`` tokens in the same ``m`` slots
  (:meth:`KVStore.keep` with ``[layers, kv_heads, m]``), ranked by its own attention weight summed over
  steps and the query heads of its group. (Measured against one set for all layers, chosen by the weight
  summed over layers and heads too: ``benchmarks/swa_accuracy.py --methods swa swa_shared window``, see
  the README.)
* **Exact attention weights, cheaply.** The kernels return no probabilities. During a decode phase the
  SWA rows' queries (after RoPE) are recorded per layer in a ring buffer of the last ``history`` steps
  (static device tensors in the phase's buffers, so CUDA graphs capture it and later phases replay them).
  When the phase ends, each recorded query's weights over the branch's own keys are computed by
  :func:`~treegen.kernels.own_importance.own_importance`, normalised over *everything the row saw* (its
  ancestors' LSE comes from the reference tree attention's LSE over their plan), which is the paper's
  softmax over the whole (sparse) context.
* **Every ``every`` steps.** A phase with an SWA branch runs at most ``every`` steps (its CUDA graph is
  planned with fixed segment lengths), then compacts; while one decodes, at most ``MIXED_STEPS`` steps
  that prefill other work run between two phases. A branch's segment thus holds at most its kept
  budget plus ``every + MIXED_STEPS``, which is what the scheduler reserves for it (:func:`reserve_slots`)
  instead of its whole length: more branches fit a KV budget.

The selection (:func:`alisa_select`): a branch with ``n`` own tokens accounted for keeps
``m = ceil(r * n)`` of them (at least one): the ``ceil(m / 2)`` most recent and the ``floor(m / 2)``
earlier ones of largest importance (ties: the earlier token). This is Algorithm 1's even split of
``2k = n r`` tokens, rounded so that ``r = 1`` keeps everything (and is then exact). Dropped tokens
never come back; every compaction chooses again among the tokens still held.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from treegen.kernels.own_importance import own_importance
from treegen.kernels.tree_attention import plan_tree_attention, tree_lse_reference

# steps between compactions (the slack a branch holds above its kept budget); also the longest phase
DEFAULT_EVERY = 32
# forward passes that prefill other work, at most, between two decode phases while a sparse-window
# branch decodes (each adds one token to every live branch; the engine starts the phase after them)
MIXED_STEPS = 4
# decode steps whose queries' attention weights rank the earlier tokens (ALISA's "last few steps")
DEFAULT_HISTORY = 8


def check_kv_keep(value, where: str = "kv_keep") -> float | None:
    """``value`` if it is None or a number in (0, 1], else ValueError naming it and ``where``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{where} must be a number in (0, 1] (the fraction of a branch's own KV that sparse "
                         f"window attention keeps; None: exact attention), got {value!r}")
    return float(value)


def check_period(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def kept_count(keep: float, tokens: int) -> int:
    """Tokens a branch with ``tokens`` own tokens keeps at ratio ``keep``: ``ceil(keep * tokens)``, at
    least 1 (and at most ``tokens``). E.g. keep 0.3 of 10 → 3, of 1 → 1; keep 1.0 → all."""
    if tokens <= 0:
        return 0
    return min(tokens, max(1, math.ceil(keep * tokens - 1e-9)))


def reserve_slots(prompt_tokens: int, max_tokens: int, keep: float | None, every: int, dropped: int = 0) -> int:
    """KV slots a gen into a leaf holding ``prompt_tokens`` reserves for its node: all its tokens
    (``prompt_tokens + max_tokens``) when exact; with SWA at most what it ever holds — its prompt (written
    densely before the first compaction) or its kept budget at full length, plus what it gains between
    two compactions: a phase's ``every`` steps and the ``MIXED_STEPS`` that may prefill other work
    before it (the engine holds to both: ``Decoder.phase``, ``TreeRun.advance``), and one slot.
    ``dropped``: prompt tokens whose KV an earlier compaction dropped (a branch that goes on after a
    sparse-window gen, say a follow-up): they take no slot."""
    held = prompt_tokens - dropped
    if keep is None:
        return held + max_tokens
    return min(held + max_tokens, max(held, kept_count(keep, prompt_tokens + max_tokens)) + every + MIXED_STEPS + 1)


def alisa_select(importance: Tensor, written: int, tokens: int, keep: float) -> Tensor:
    """ALISA Algorithm 1 over a segment's ``written`` slots (token order; ``tokens`` of the node's
    tokens accounted for, dropped ones included): the slot offsets to keep, ascending, int64.

    ``importance [..., written]``: each slot's attention weight summed over recent steps (and heads,
    layers); leading dimensions (say ``[layers, kv_heads]``, :func:`own_attention`'s ``per_head``) each
    choose on their own, giving ``[..., m]``. Keeps ``m = kept_count(keep, tokens)``: the ``ceil(m/2)``
    last slots (the most recent tokens) and the ``floor(m/2)`` earlier slots of largest importance, ties
    to the earlier slot. ``m >= written``: every slot. E.g. importance ``[5, 1, 9, 2, 0, 3]``, 6 of 10
    tokens, keep 0.4 → m 4: slots 4, 5 (recent) and 2, 0 → ``[0, 2, 4, 5]``."""
    device, lead = importance.device, importance.shape[:-1]
    m = kept_count(keep, tokens)
    if m >= written:
        return torch.arange(written, device=device).expand(*lead, written).contiguous()
    local = (m + 1) // 2
    earlier = importance[..., : written - local].float()
    order = torch.sort(-earlier, dim=-1, stable=True).indices[..., : m - local]
    recent = torch.arange(written - local, written, device=device).expand(*lead, local)
    return torch.sort(torch.cat([order.to(device), recent], dim=-1), dim=-1).values


class QueryRecorder:
    """The last ``history`` steps' queries of a decode phase's SWA rows, per layer, in a ring buffer.

    ``rows [S]``: the SWA rows among the phase's rows. ``q [layers, history, S, heads, head_dim]`` (the
    model's dtype); step ``t`` of the phase is at ``t % history``. Everything is a static device tensor
    advanced in place (``slot``), so the phase's CUDA graph captures :meth:`record` and :meth:`advance`.
    ``capacity``: room for that many SWA rows (a kept phase's recorder, :meth:`load`-ed by later phases
    with as many or fewer; the entries past a phase's own record its row 0, and nothing reads them).
    """

    def __init__(self, *, num_layers: int, rows: list[int], history: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int | None = None) -> None:
        self.history = history
        capacity = len(rows) if capacity is None else capacity
        self.rows = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.q = torch.zeros(num_layers, history, capacity, num_heads, head_dim, dtype=dtype, device=device)
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)
        self.load(rows)

    def load(self, rows: list[int]) -> None:
        """Record ``rows`` from the next step on, the ring empty (its first step at entry 0)."""
        if len(rows) > self.rows.numel():
            raise ValueError(f"a recorder for {self.rows.numel()} rows cannot record {len(rows)}")
        self.rows.zero_()
        self.rows[: len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))
        self.slot.zero_()

    def record(self, layer: int, q: Tensor) -> None:
        """Store this step's queries ``q [T, heads, head_dim]`` (all the pass's rows) of the SWA rows."""
        self.q[layer].index_copy_(0, self.slot, q.index_select(0, self.rows).unsqueeze(0))

    def advance(self) -> None:
        self.slot.add_(1).remainder_(self.history)

    def steps(self, steps_run: int, valid: int) -> tuple[list[int], list[int]]:
        """``(ring entries, step indices)`` of a row's last ``history`` steps among the phase's
        ``steps_run``, when only its first ``valid`` steps count (a branch that finished part way ran
        garbage rows afterwards), in step order. The ring holds the phase's last ``history`` steps, so a
        row that finished earlier has fewer."""
        end = min(steps_run, valid)
        taken = list(range(max(0, end - self.history, steps_run - self.history), end))
        return [t % self.history for t in taken], taken


# about the most fp32 elements one of :func:`own_attention`'s reference tensors holds (512 MiB: the ancestors'
# scores, or the keys they gather): it takes as many layers a call as fit
SCORE_ELEMENTS = 2**27


def own_attention(kv, tree, model, nodes: list[int], queries: list[Tensor], positions: list[list[int]],
                  chunk: int = 32, per_head: bool = False) -> list[Tensor]:
    """Each node's importance: the attention weight of its written keys, summed over the given queries,
    heads and layers — ALISA's "local attention sum".

    ``queries[b] [layers, T_b, heads, head_dim]`` (after RoPE, as the model gave them to ``attend``) at
    true positions ``positions[b] [T_b]`` were rows of node ``nodes[b]``; each sees what its row saw: the
    node's ancestors and its own written keys up to its position (in the segment's mask positions, see
    :meth:`~treegen.runtime.tree_run.TreeRun.plan_rows`). Weights are softmax-normalised over all of it
    (the ancestors' LSE from :func:`~treegen.kernels.tree_attention.tree_lse_reference`, merged with that of
    the node's own keys, which are scored once for both).
    Returns fp32 ``[written slots of the node]`` per node; ``per_head``: ``[layers, kv_heads, written]``,
    each layer's and KV head's own sum (over the queries and the query heads of its group: H2O's
    per-head choice, for :meth:`KVStore.keep` with a kept set per layer and head). Batched over ``chunk``
    nodes at a time."""
    out: list[Tensor] = []
    with _tf32_when_exact(kv, queries):
        for begin in range(0, len(nodes), chunk):
            out += _own_attention(kv, tree, model, nodes[begin:begin + chunk], queries[begin:begin + chunk],
                                  positions[begin:begin + chunk], per_head)
    return out


@contextlib.contextmanager
def _tf32_when_exact(kv, queries: list[Tensor]):
    """fp32 matrix products on TF32 tensor cores where that changes nothing: queries and keys of 16 bits
    (bf16's 8 and fp16's 11 significant bits fit TF32's 11; products and sums stay fp32). An 8-bit cache's
    dequantized keys (int8 x an fp32 scale) do not fit: full fp32 there."""
    exact = (kv.device.type == "cuda" and not kv.format.quantized and kv.dtype in (torch.bfloat16, torch.float16)
             and all(q.dtype in (torch.bfloat16, torch.float16) for q in queries))
    if not exact:
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        name, before, value = "allow_tf32", matmul.allow_tf32, True
    except RuntimeError:  # this process set the newer API (torch >= 2.9), and reading the older one now raises
        name, before, value = "fp32_precision", matmul.fp32_precision, "tf32"
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def _own_attention(kv, tree, model, nodes, queries, positions, per_head=False) -> list[Tensor]:
    device = kv.device
    # the ancestors' keys go through the reference's plan (their LSE); each node's own keys are scored once,
    # below, for both their LSE and their weights
    parents = [tree.parent(n) for n in nodes]
    segs = sorted({p for n, parent in zip(nodes, parents) if parent is not None for p in tree.path(parent)})
    index = {s: j for j, s in enumerate(segs)}
    seg_pos = {s: tree.position(s) + kv.segments[s].dropped for s in {*segs, *nodes}}  # mask positions
    with_parent = [(index[parent], p) for parent, pos in zip(parents, positions) if parent is not None for p in pos]
    plan = None
    if with_parent:
        plan = plan_tree_attention(
            segment_parent=[index.get(tree.parent(s), -1) for s in segs],
            segment_start=[kv.segments[s].start for s in segs],
            segment_len=[kv.segments[s].computed for s in segs],
            segment_pos=[seg_pos[s] for s in segs],
            query_segment=[q for q, _ in with_parent], query_pos=[p for _, p in with_parent], device=device,
            backend="reference", softcap=model.attn_softcap)
    written = [kv.segments[n].computed for n in nodes]
    width, steps = max(written), max(len(p) for p in positions)
    num_b = len(nodes)
    num_kv, head_dim = kv.num_kv_heads, kv.head_dim
    qpos = torch.full((num_b, steps), -1, dtype=torch.int64)  # padding rows see no key
    # each (node, step)'s query row (padding: row 0) and its row in the ancestors' plan (padding and the rows
    # of a node without a parent: the extra last row, LSE -inf — no key)
    where = torch.zeros(num_b, steps, dtype=torch.int64)
    where_anc = torch.full((num_b, steps), len(with_parent), dtype=torch.int64)
    at = anc = 0
    for b, (pos, parent) in enumerate(zip(positions, parents)):
        qpos[b, : len(pos)] = torch.tensor(pos)
        where[b, : len(pos)] = torch.arange(at, at + len(pos))
        at += len(pos)
        if parent is not None:
            where_anc[b, : len(pos)] = torch.arange(anc, anc + len(pos))
            anc += len(pos)
    planned_rows = None if anc == at else torch.tensor(  # (the rows of the nodes with a parent, when not all)
        [r for b, (pos, parent) in enumerate(zip(positions, parents)) if parent is not None
         for r in where[b, : len(pos)].tolist()], dtype=torch.int64).to(device)
    own = torch.tensor([[kv.segments[n].start, w, seg_pos[n]] for n, w in zip(nodes, written)], dtype=torch.int64)
    qpos, where, where_anc, own = (t.to(device) for t in (qpos, where, where_anc, own))
    start, written_t, own_pos = (t.contiguous() for t in own.unbind(1))
    total = torch.zeros(num_b, *((kv.num_layers, num_kv) if per_head else ()), width, dtype=torch.float32,
                        device=device)
    scale, softcap = model.attn_scale, model.attn_softcap
    # several layers a call (the plan is every layer's): as many as keep the largest score tensor in bounds
    num_heads = queries[0].shape[-2]
    # (a layer's largest tensor: the scores of the rows against the longest level, or the keys every level
    # gathers — fp32 and a copy as stored — when the branches' ancestors are many and short)
    keys = max([width] + ([level.kv_slots.shape[1] for level in plan.levels] if plan is not None else []))
    gathered = 2 * num_kv * head_dim * max([num_b * width] + (
        [level.kv_slots.numel() for level in plan.levels] if plan is not None else []))
    per_layer = max(num_b * steps * num_heads * keys, gathered)
    layers_a_call = max(1, min(kv.num_layers, SCORE_ELEMENTS // per_layer))
    where, where_anc = where.reshape(-1), where_anc.reshape(-1)
    for first in range(0, kv.num_layers, layers_a_call):
        layers = slice(first, min(first + layers_a_call, kv.num_layers))
        q_rows = torch.cat([q[layers] for q in queries], dim=1)  # [c, R, heads, D]
        k_cache = kv.k[layers]
        k_scale = None if kv.k_scale is None else kv.k_scale[layers]
        c = k_cache.shape[0]
        ancestors = torch.full((c, len(with_parent) + 1, num_heads), float("-inf"), device=device)
        if plan is not None:
            rows = q_rows if planned_rows is None else q_rows.index_select(1, planned_rows)
            ancestors[:, :-1] = tree_lse_reference(rows, k_cache, plan, scale, k_scale)
        weights = own_importance(q_rows.index_select(1, where).view(c, num_b, steps, num_heads, head_dim), k_cache,
                                 k_scale, ancestors.index_select(1, where_anc).view(c, num_b, steps, num_heads),
                                 start, written_t, qpos, own_pos, scale, softcap, width)  # [B, c, kv_heads, W]
        if per_head:
            total[:, layers] += weights
        else:
            total += weights.sum(dim=(1, 2))
    return [total[b, ..., :w] for b, w in enumerate(written)]

