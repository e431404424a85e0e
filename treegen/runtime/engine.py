"""Runs a model over a sharing tree: one batched prefill of everything pending, then decoding.

An :class:`Engine` holds a loaded model and tokenizer. :meth:`Engine.start` opens a :class:`TreeRun`:
a sharing tree plus the KV store for its nodes. The language layer grows the tree and calls
:meth:`TreeRun.execute` with generation and scoring requests; the run

1. prefills, in one forward pass (in chunks of ``max_prefill_tokens``), every token of every node on
   the requests' paths that has no KV yet (a child's tokens attend to their ancestors' KV through the
   tree-attention decomposition; every node is prefilled once however many branches lie below it);
   KV memory is planned first, and over-large workloads run in groups (:mod:`~treegen.runtime.schedule`);
2. scores ``select`` choices from that pass (length-normalised log-probability);
3. decodes all generation requests together, one token per live branch per step, with hierarchical
   attention, in phases (:mod:`~treegen.runtime.decode`); finished branches leave the batch.

The last sampled token of a branch is appended to its node without KV; it is computed when the
branch continues. When a request's conditioning token already has KV (e.g. a fork after a finished
phase), that token is run again as a query and writes the identical KV into its own slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch

from treegen.kernels.tree_attention import plan_tree_attention, tree_attention
from treegen.runtime.kv_store import KVStore
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.schedule import KVBudget, release_after, request_slots, schedule
from treegen.tree.sharing_tree import KVShape, SharingTree


@dataclass(frozen=True)
class GenRequest:
    """Generate into ``node`` (a leaf owned by one branch). ``key``: the branch's random key.
    ``final``: the branch takes nothing more afterwards, so its KV may be freed once it is done
    (what lets a workload too big for memory run in groups, see :mod:`treegen.runtime.schedule`)."""

    node: int
    params: SamplingParams
    key: int
    final: bool = False


@dataclass(frozen=True)
class GenResult:
    """A branch's generation: its tokens, the text (stop string excluded), why it ended, and the
    natural-log probability of each token under the distribution it was drawn from (before
    temperature and filtering)."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: str  # "eos" | "stop" | "length"
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ScoreRequest:
    """Score each child ``choices[i]`` of ``parent`` by its mean token log-probability."""

    parent: int
    choices: tuple[int, ...]


ATTENTION_MODES = ("tree", "flat", "none")


class Engine:
    """A loaded model + tokenizer; cheap to :meth:`start` many tree runs on.

    attention: ``"tree"`` (hierarchical attention over the sharing tree), ``"flat"`` (no sharing:
    every branch gets its own copy of its whole prompt, prefilled and attended per sequence — the
    FlashAttention/vLLM-style baseline), or ``"none"`` (attention skipped: a throughput ceiling for
    benchmarks, functionally wrong). cuda_graphs: capture each decode phase's step on CUDA.
    max_prefill_tokens: prefill runs in chunks of at most this many tokens (bounded activations).
    kv_budget_bytes: KV memory a run may use (default: the free device memory on CUDA, no limit on
    the CPU); workloads over it run in groups (:mod:`treegen.runtime.schedule`).
    """

    def __init__(self, model, tokenizer, *, attention: str = "tree", cuda_graphs: bool = True,
                 max_prefill_tokens: int = 16384, kv_budget_bytes: int | None = None) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.attention = attention
        self.cuda_graphs = cuda_graphs
        if not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be an integer >= 1, got {max_prefill_tokens!r}")
        self.max_prefill_tokens = max_prefill_tokens
        if kv_budget_bytes is not None and (not isinstance(kv_budget_bytes, int) or kv_budget_bytes <= 0):
            raise ValueError(f"kv_budget_bytes must be a positive integer or None, got {kv_budget_bytes!r}")
        self.kv_budget_bytes = kv_budget_bytes
        # progress hook: on_step(live_branches, tokens_done, tokens_budget), called by the decoder
        # after the first tokens and at every host sync (display/progress.py adapts it to a bar)
        self.on_step = None
        self.kv_shape = KVShape(model.num_layers, model.num_kv_heads, model.head_dim,
                                torch.empty((), dtype=model.dtype).element_size())

    @classmethod
    def load(cls, model: str | None = None, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             **options) -> "Engine":
        """Load ``model`` (None = the embedded SmolLM2-135M-Instruct; else a local path or hub id).
        ``options``: ``attention``, ``cuda_graphs`` (see :class:`Engine`)."""
        from treegen.runtime.loader import load_model

        return cls(*load_model(model, dtype=dtype, device=device), **options)

    def start(self) -> "TreeRun":
        return TreeRun(self)


class TreeRun:
    """One sharing tree and the KV of its nodes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.tree = SharingTree()
        m = self.model
        self.kv = KVStore(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                          dtype=m.dtype, device=m.device)
        self.forward_passes = 0
        self.decode_phases: list[int] = []  # live branches of each decode phase, in order
        self.groups: list[int] = []  # memory groups each execute() ran in (1 = everything fit)

    # ---------------------------------------------------------------------------------------------
    def free(self, node: int) -> None:
        """Drop a node's KV and mark it (and its subtree) pruned."""
        for n in [node, *sorted(nx.descendants(self.tree.graph, node))]:
            self.kv.free(n)
        self.tree.prune(node)

    def _conditioning_row(self, node: int) -> tuple[int, int]:
        """(node, index) of the last token on ``node``'s path — the one whose logits come next."""
        for n in reversed(self.tree.path(node)):
            if self.tree.tokens(n):
                return n, len(self.tree.tokens(n)) - 1
        raise ValueError("nothing to condition on: append some text before gen or select")

    def plan_rows(self, rows: list[tuple[int, int]], grow: dict[int, int] | None = None):
        """Inputs and attention plan for running the (node, index) token ``rows`` through the model.

        Every node on a row's path must already have its KV or have all its missing rows here.
        ``grow``: node → extra keys it may gain during a decode phase; its segment is planned that
        long (keys not yet written sit at positions after every query, so attention masks them).
        Returns ``(input_ids [T], slots [T], plan)``; ``plan.query_pos`` holds the positions [T].
        """
        tree, kv, model = self.tree, self.kv, self.model
        new_len: dict[int, int] = {}
        for n, i in rows:
            new_len[n] = max(new_len.get(n, kv.computed(n)), i + 1)
        segments = sorted({p for n in new_len for p in tree.path(n)})
        for s in segments:
            length = new_len.get(s, kv.computed(s))
            if s not in new_len and length != len(tree.tokens(s)):
                raise RuntimeError(f"node {s} is missing KV for {len(tree.tokens(s)) - length} tokens")
            new_len[s] = length
            kv.reserve(s, max(length + (grow or {}).get(s, 0), 1))
        index = {s: j for j, s in enumerate(segments)}
        pos = {s: tree.position(s) for s in segments}
        device = model.device
        input_ids = torch.tensor([tree.tokens(n)[i] for n, i in rows], dtype=torch.int64, device=device)
        slots = torch.tensor([kv.segments[n].start + i for n, i in rows], dtype=torch.int64, device=device)
        plan = plan_tree_attention(
            segment_parent=[index.get(tree.parent(s), -1) for s in segments],
            segment_start=[kv.segments[s].start for s in segments],
            segment_len=[new_len[s] + (grow or {}).get(s, 0) for s in segments],
            segment_pos=[pos[s] for s in segments],
            query_segment=[index[n] for n, _ in rows],
            query_pos=[pos[n] + i for n, i in rows],
            device=device,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            dtype=kv.dtype,
        )
        for s in new_len:
            kv.segments[s].computed = max(kv.segments[s].computed, new_len[s])
        return input_ids, slots, plan

    def attend_fn(self, plan, slots: torch.Tensor):
        """The per-layer ``attend`` callback: write the new keys/values at ``slots``, then attend."""
        kv, scale = self.kv, self.model.attn_scale
        if self.engine.attention == "none":
            return lambda layer, q, k, v: q  # benchmark ceiling: no KV traffic, no attention

        def attend(layer: int, q, k, v):
            if k is not None:  # else the model wrote them already (see cache below)
                kv.k[layer].index_copy_(0, slots, k.to(kv.dtype))
                kv.v[layer].index_copy_(0, slots, v.to(kv.dtype))
            return tree_attention(q, kv.k[layer], kv.v[layer], plan, scale)

        # where this pass's keys/values go: the model's fused RoPE kernel writes them there directly
        attend.cache = lambda layer: (kv.k[layer], kv.v[layer], slots)
        return attend

    def _forward(self, rows: list[tuple[int, int]], logits_rows: list[int]) -> torch.Tensor:
        """Run the model on the (node, index) token rows → fp32 logits [len(logits_rows), vocab].

        Rows are taken in order (parents before children) in chunks of at most
        ``engine.max_prefill_tokens``, so activations stay bounded however large the prefill."""
        chunk = self.engine.max_prefill_tokens
        parts, taken = [], []
        for begin in range(0, len(rows), chunk):
            input_ids, slots, plan = self.plan_rows(rows[begin : begin + chunk])
            mine = [i for i, r in enumerate(logits_rows) if begin <= r < begin + chunk]
            wanted = torch.tensor([logits_rows[i] - begin for i in mine], dtype=torch.int64, device=self.model.device)
            parts.append(self.model.forward(input_ids, plan.query_pos, self.attend_fn(plan, slots), wanted))
            taken += mine
            self.forward_passes += 1
        if len(taken) != len(logits_rows):
            raise ValueError("logits_rows must name rows of this forward pass")
        logits = torch.cat(parts) if parts else torch.empty(0, self.model.vocab_size, device=self.model.device)
        out = torch.empty_like(logits)
        out[torch.tensor(taken, dtype=torch.int64, device=logits.device)] = logits
        return out

    def prefill(self, nodes: list[int]) -> dict[int, torch.Tensor]:
        """Compute the KV of every pending token on the paths of ``nodes`` in one forward pass.

        Returns, for each node in ``nodes``, the fp32 logits of its newly computed tokens
        ``[new tokens of that node, vocab]`` (row i predicts the token after the node's i-th new one).
        Forcing tokens this way (append, prefill, repeat) is how tests compare with Hugging Face.
        """
        pending = sorted({p for n in nodes for p in self.tree.path(n) if self.kv.computed(p) < len(self.tree.tokens(p))})
        rows = [(n, i) for n in pending for i in range(self.kv.computed(n), len(self.tree.tokens(n)))]
        chosen = set(nodes)
        wanted = [j for j, (n, _) in enumerate(rows) if n in chosen]
        logits = self._forward(rows, wanted) if rows else None
        per_node: dict[int, list[int]] = {n: [] for n in nodes}
        for k, j in enumerate(wanted):
            per_node[rows[j][0]].append(k)
        empty = torch.empty(0, self.model.vocab_size)
        return {n: logits[idx] if idx else empty for n, idx in per_node.items()}

    # ---------------------------------------------------------------------------------------------
    def kv_budget(self) -> KVBudget:
        """The KV memory this run may use: ``engine.kv_budget_bytes`` if set; on CUDA what it holds
        plus what the device has free (cached blocks included) less a margin for activations; on the
        CPU no limit."""
        kv, engine = self.kv, self.engine
        if engine.kv_budget_bytes is not None:
            return KVBudget(engine.kv_budget_bytes, kv.bytes_per_token)
        if kv.device.type != "cuda":
            return KVBudget(None, kv.bytes_per_token)
        free, total = torch.cuda.mem_get_info(kv.device)
        free += torch.cuda.memory_reserved(kv.device) - torch.cuda.memory_allocated(kv.device)
        return KVBudget(kv.bytes_reserved() + int(free - max(0.1 * total, 4 * 2**30)), kv.bytes_per_token)

    def execute(self, gens: list[GenRequest], scores: list[ScoreRequest]) -> tuple[list[GenResult], list[list[float]]]:
        """Prefill what the requests need, score the choices, generate; see the module docstring.

        KV memory is planned first; requests that do not fit run in groups (see
        :mod:`treegen.runtime.schedule`), and ``groups`` records how many ran."""
        groups = schedule(self.tree, self.kv, gens, scores, self.kv_budget())
        self.groups.append(len(groups))
        if len(groups) == 1:
            return self._execute(gens, scores)
        # size the pool for the largest group now, while little is written: growing a pool that holds
        # KV copies it (old and new side by side), which a pool sized near the budget cannot afford
        self.kv.ensure_free(max(sum(request_slots(self.tree, self.kv, group, []).values()) for group in groups))
        done: dict[int, GenResult] = {}
        for i, group in enumerate(groups):
            results, _ = self._execute(group, [])
            done.update({id(g): r for g, r in zip(group, results)})
            release_after(self.tree, self.kv, group, [g for later in groups[i + 1:] for g in later])
        return [done[id(g)] for g in gens], []

    def _execute(self, gens: list[GenRequest], scores: list[ScoreRequest]) -> tuple[list[GenResult], list[list[float]]]:
        tree, kv = self.tree, self.kv
        max_context = self.model.max_context
        kv.ensure_free(sum(request_slots(tree, kv, gens, scores).values()))
        for g in gens:
            if tree.children(g.node):
                raise RuntimeError(f"gen into node {g.node}, which has children")
            total = len(tree.path_tokens(g.node)) + g.params.max_tokens
            if total > max_context:
                raise ValueError(f"a branch would reach {total} tokens (prompt + max_tokens={g.params.max_tokens}), "
                                 f"past the model's context of {max_context}")
            kv.reserve(g.node, len(tree.tokens(g.node)) + g.params.max_tokens)
        # 1. rows: every pending token on the requests' paths, plus conditioning tokens to re-run
        wanted = [g.node for g in gens] + [c for s in scores for c in s.choices]
        pending = sorted({n for w in wanted for n in tree.path(w) if kv.computed(n) < len(tree.tokens(n))})
        rows = [(n, i) for n in pending for i in range(kv.computed(n), len(tree.tokens(n)))]
        row_of = {r: j for j, r in enumerate(rows)}
        cond = [self._conditioning_row(g.node) for g in gens] + [self._conditioning_row(s.parent) for s in scores]
        for r in cond:
            if r not in row_of:
                row_of[r] = len(rows)
                rows.append(r)
        score_rows = [[cond[len(gens) + k]] + [(c, i) for i in range(len(tree.tokens(c)) - 1)]
                      for k, s in enumerate(scores) for c in s.choices]
        logit_keys = sorted({r for r in cond} | {r for rs in score_rows for r in rs}, key=row_of.__getitem__)
        logits = self._forward(rows, [row_of[r] for r in logit_keys]) if rows else None
        at = {r: j for j, r in enumerate(logit_keys)}

        # 2. select scores
        score_out, flat = [], iter(score_rows)
        for s in scores:
            vals = []
            for c in s.choices:
                src = next(flat)
                targets = torch.tensor(tree.tokens(c), device=self.model.device)
                lp = logits[[at[r] for r in src]].log_softmax(-1).gather(1, targets.unsqueeze(1))
                vals.append(float(lp.mean()))
            score_out.append(vals)
        if not gens:
            return [], score_out
        first = logits[[at[cond[k]] for k in range(len(gens))]]
        return self._decode(gens, first), score_out

    def _decode(self, gens: list[GenRequest], logits: torch.Tensor) -> list[GenResult]:
        from treegen.runtime.decode import Decoder

        return Decoder(self, gens).run(logits)
