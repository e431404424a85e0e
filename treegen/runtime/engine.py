"""Runs a model over a sharing tree, continuously: jobs arrive at any time and complete on their own.

An :class:`Engine` holds a loaded model and tokenizer. :meth:`Engine.start` opens a :class:`TreeRun`:
a sharing tree plus the KV store for its nodes. The language layer grows the tree and submits
generation and scoring requests (:meth:`TreeRun.submit`); :meth:`TreeRun.advance` runs the engine's
loop until at least one job completes, so a program resumes as soon as its own work is done while
the others keep decoding. Each step of the loop is decided by the
:class:`~treegen.runtime.scheduler.Scheduler` (admission by KV memory, which new tokens to prefill)
and run here:

* a step with new work is one forward pass over every live branch's next token **and** the new
  tokens of admitted jobs' nodes (each node prefilled once however many branches lie below it; a
  child's tokens attend to their ancestors' KV through the tree-attention decomposition); new gens
  draw their first token from it, ``select`` choices are scored from it (length-normalised
  log-probability);
* otherwise the live branches decode in phases planned once and captured as CUDA graphs
  (:mod:`~treegen.runtime.decode`); finished branches leave, new work joins when the scheduler ends
  the phase.

The last sampled token of a branch is appended to its node without KV; it is computed when the
branch continues. When a request's conditioning token already has KV (e.g. a fork after a finished
phase), that token is run again as a query and writes the identical KV into its own slot.
:meth:`TreeRun.execute` is the static special case: submit everything, run until all is done.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import networkx as nx
import torch

from treegen.kernels.kv_quant import kv_format
from treegen.kernels.tree_attention import TreeAttentionPlan, plan_tree_attention, tree_attention
from treegen.kernels.tree_attention_triton import SUPPORTED_HEAD_DIMS
from treegen.runtime import swa
from treegen.runtime.constraint import Grammars
from treegen.runtime.decode import Decoder
from treegen.runtime.kv_store import KVStore
from treegen.runtime.offload import OffloadPolicy, OffloadRates, default_host_bytes, measure_rates
from treegen.runtime.requests import GenRequest, GenResult, Job, ScoreRequest
from treegen.runtime.scheduler import KVBudget, Scheduler, conditioning_row, score_rows
from treegen.tree.sharing_tree import KVShape, SharingTree

__all__ = ["ATTENTION_MODES", "Engine", "GenRequest", "GenResult", "Job", "PassPlan", "ScoreRequest", "TreeRun"]


ATTENTION_MODES = ("tree", "flat", "none")

logger = logging.getLogger(__name__)


class Engine:
    """A loaded model + tokenizer; cheap to :meth:`start` many tree runs on.

    attention: ``"tree"`` (hierarchical attention over the sharing tree), ``"flat"`` (no sharing:
    every branch gets its own copy of its whole prompt, prefilled and attended per sequence — the
    FlashAttention/vLLM-style baseline), or ``"none"`` (attention skipped: a throughput ceiling for
    benchmarks, functionally wrong). cuda_graphs: capture each decode phase's step on CUDA.
    max_prefill_tokens: prefill runs in chunks of at most this many tokens (bounded activations).
    kv_budget_bytes: KV memory a run may use (default: the free device memory on CUDA, no limit on
    the CPU); work is admitted while its KV fits, the rest waits for finished branches to free
    theirs (:mod:`treegen.runtime.scheduler`). max_batch: branches generating at once at most (None:
    as many as the KV budget holds); more work waits for branches to finish. kv_dtype: how the KV
    cache is stored — None (the model's dtype), ``"int8"`` or ``"fp8"`` (8 bits per value plus an fp32
    scale per token and KV head, :mod:`treegen.kernels.kv_quant`: about half the memory and the
    attention's reads, so twice the branches fit). kv_keep: sparse window attention for every gen that
    names no ``kv_keep`` of its own (None, the default: exact attention; a number in (0, 1]: the fraction
    of a branch's own KV kept, see :mod:`treegen.runtime.swa`); kv_keep_every / kv_keep_history: the
    steps between its compactions and the steps of queries that rank the tokens (defaults
    ``swa.DEFAULT_EVERY`` / ``swa.DEFAULT_HISTORY``).

    offload: what happens to the KV of idle nodes (no running job reads them: branches that continue
    later, nodes of waiting subtrees) when work does not fit the KV budget (:mod:`treegen.runtime.offload`):
    ``"auto"`` (default) moves it to the host (pinned memory on CUDA) and back, or drops it and
    prefills its tokens again, whichever the rates measured on this machine (once per engine,
    :attr:`offload_rates`) say is cheaper; ``"host"`` always moves it; ``"recompute"`` always drops
    it; ``"off"`` keeps it (work waits, or is refused when it could never fit). Lossless: results are
    those of a run with all KV in memory. offload_bytes: the most KV bytes kept on the host (default
    a quarter of the machine's physical memory); past it, ``"auto"`` recomputes and ``"host"`` refuses
    what cannot fit, naming the sizes. With tensor parallelism ``"auto"`` acts as ``"host"`` (every
    rank must decide the same, without measuring).

    The model runs on one of two paths (``implementation``, see :mod:`treegen.runtime.loader`): the fast
    path (treegen's own forward) or the generic path (transformers' own modules with tree attention
    plugged in; exact, slower). The engine logs a one-line notice when it runs the generic path, and
    its repr names the path; CUDA graphs stay off for a model whose modules cannot be captured.
    parallel: this process's place among several (:class:`~treegen.runtime.distributed.Parallel`;
    None: one process) — set by :meth:`load` with ``tensor_parallel`` / ``data_parallel``. The model
    is then this rank's shard, every rank of a replica runs the same programs on the same tree (host
    decisions that read the device, like the KV budget, are agreed on), and a batch is split across
    replicas by :func:`treegen.lang.data_parallel.run_batch_data_parallel`.
    """

    def __init__(self, model, tokenizer, *, attention: str = "tree", cuda_graphs: bool = True,
                 max_prefill_tokens: int = 16384, kv_budget_bytes: int | None = None,
                 max_batch: int | None = None, kv_dtype: str | None = None, offload: str = "auto",
                 offload_bytes: int | None = None, kv_keep: float | None = None,
                 kv_keep_every: int = swa.DEFAULT_EVERY, kv_keep_history: int = swa.DEFAULT_HISTORY,
                 parallel=None, workers=None) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.attention = attention
        self.implementation = getattr(model, "implementation", "fast")
        # why the model's forward cannot be captured as a CUDA graph (None: it can)
        self.graphs_off_reason = getattr(model, "graphs_off_reason", None) if cuda_graphs else None
        self.cuda_graphs = cuda_graphs and self.graphs_off_reason is None
        if self.implementation == "generic":
            graphs = f"; CUDA graphs off: {self.graphs_off_reason}" if self.graphs_off_reason else ""
            logger.warning("treegen: %s runs on the generic path (transformers' modules with tree attention; exact, "
                           "slower than the fast path): %s%s", model.config.model_type, model.reason, graphs)
        if not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be an integer >= 1, got {max_prefill_tokens!r}")
        self.max_prefill_tokens = max_prefill_tokens
        if kv_budget_bytes is not None and (not isinstance(kv_budget_bytes, int) or kv_budget_bytes <= 0):
            raise ValueError(f"kv_budget_bytes must be a positive integer or None, got {kv_budget_bytes!r}")
        self.kv_budget_bytes = kv_budget_bytes
        if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive integer or None, got {max_batch!r}")
        self.max_batch = max_batch
        self.offload = "host" if offload == "auto" and parallel is not None else offload
        self.offload_bytes = default_host_bytes() if offload_bytes is None else offload_bytes
        OffloadPolicy(self.offload, self.offload_bytes, rates=lambda: None)  # checks both
        self._offload_rates: OffloadRates | None = None
        self.kv_keep = swa.check_kv_keep(kv_keep, "Engine(kv_keep=...)")
        self.kv_keep_every = swa.check_period(kv_keep_every, "Engine(kv_keep_every=...)")
        self.kv_keep_history = swa.check_period(kv_keep_history, "Engine(kv_keep_history=...)")
        self.parallel = parallel
        self.workers = workers  # the tensor-parallel workers this process started (treegen.runtime.workers.Team)
        self.phases_captured = 0  # decode graphs captured by this engine's runs (later ones skip the warm-up)
        if workers is not None:
            import weakref

            weakref.finalize(self, workers.close)
        # progress hook: on_step(live_branches, tokens_done, tokens_budget), called by the decoder
        # after the first tokens and at every host sync (display/progress.py adapts it to a bar)
        self.on_step = None
        self.kv_format = kv_format(kv_dtype, model.dtype, model.device)
        # the Triton kernels take head_dim 64/128/256; others (e.g. 96) run the PyTorch reference, exact but slower
        self.attention_backend = "auto" if model.head_dim in SUPPORTED_HEAD_DIMS else "reference"
        if self.kv_keep is not None:
            self.check_swa("Engine(kv_keep=...)")
        self.kv_shape = KVShape(model.num_layers, model.num_kv_heads, model.head_dim,
                                self.kv_format.bytes_per_value, self.kv_format.scale_bytes)
        self._grammars: Grammars | None = None

    def check_swa(self, where: str) -> None:
        """Raise ValueError when this engine cannot run sparse window attention (``where`` asked for it)."""
        windows = sorted({w for w in self.model.layer_window if w is not None})
        if windows:
            raise ValueError(f"{where}: sparse window attention is not supported on a model with sliding-window "
                             f"layers (windows {windows}): its compacted KV would sit at the wrong distances "
                             "for the window's mask")
        if self.parallel is not None and self.parallel.tp > 1:
            raise ValueError(f"{where}: sparse window attention is not supported with tensor_parallel > 1 (each "
                             "rank sees only its heads' attention weights, so the ranks would keep different tokens)")
        if self.workers is not None:
            raise ValueError(f"{where}: sparse window attention is not supported with tensor-parallel workers")

    @property
    def offload_rates(self) -> OffloadRates:
        """Host↔device copy bandwidth and the model's prefill tokens/s on this machine, measured at the
        first use (:func:`~treegen.runtime.offload.measure_rates`) and kept; settable (e.g. to force a
        choice in a test)."""
        if self._offload_rates is None:
            self._offload_rates = measure_rates(self)
            logger.info("treegen: measured offload rates: %s", self._offload_rates)
        return self._offload_rates

    @offload_rates.setter
    def offload_rates(self, rates: OffloadRates) -> None:
        self._offload_rates = rates

    def offload_policy(self) -> OffloadPolicy:
        return OffloadPolicy(self.offload, self.offload_bytes, rates=lambda: self.offload_rates)

    @property
    def grammars(self) -> Grammars:
        """Constrained gens' grammars compiled for this tokenizer and vocabulary, each once, shared by
        every run (the first constrained gen builds the tokenizer's tables; see :mod:`~treegen.runtime.constraint`)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.vocab_size, self.model.eos_token_ids)
        return self._grammars

    @classmethod
    def load(cls, model: str | None = None, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             implementation: str = "auto", tensor_parallel: int = 1, data_parallel: int | None = None,
             vocab_parallel: bool | str = "auto", **options) -> "Engine":
        """Load ``model`` (None = the embedded SmolLM2-135M-Instruct; else a local path or hub id) on the
        path ``implementation`` names: ``"auto"`` (the fast path where it runs the model, else the generic
        path), ``"fast"`` or ``"generic"``. ``options``: ``attention``, ``cuda_graphs``, ``kv_dtype``, ...
        (see :class:`Engine`).

        Several GPUs (or CPU processes): ``tensor_parallel`` ranks per model replica, ``data_parallel``
        replicas (None: as many as the launch has processes for). Two ways in:

        * under ``torchrun`` this process is one rank: it joins the process group and loads only its
          shard; every rank runs the same program code;
        * from a plain Python process or a notebook with ``data_parallel`` > 1, this process loads only
          the tokenizer and starts ``data_parallel`` replica processes (each on its ``tensor_parallel``
          GPUs, itself tensor parallel as below) and returns a
          :class:`~treegen.runtime.replicas.ReplicatedEngine`, which runs programs and batches (a batch
          split across the replicas by :func:`treegen.lang.data_parallel.run_batch_replicas`; the
          programs must pickle), not tree runs;
        * from a plain Python process or a notebook with tensor parallel alone, this process becomes rank 0
          and starts ranks 1..``tensor_parallel``-1 itself (one per GPU, ``cuda:0``.. of this host; gloo
          processes on the CPU), which load their shards and mirror every tree run of this process
          (:mod:`treegen.runtime.workers`, :mod:`treegen.runtime.mirror`). A worker that fails makes the
          next (or the waiting) call raise :class:`~treegen.runtime.workers.WorkerError` with its error.
          :meth:`close` (or dropping the engine, or exit) ends the workers.

        ``vocab_parallel`` (with ``tensor_parallel`` > 1): the LM head split by vocabulary over the ranks
        (True: each rank holds and computes the logits of ``1 / tensor_parallel`` of the tokens; the
        sampler combines the ranks' best tokens, gathering the whole logits only for top-p / top-k, scores
        and prefill; the embedding stays whole, see :mod:`treegen.runtime.shard`), or whole on every
        rank (False); ``"auto"`` splits it wherever the vocabulary splits. The tokens are the same either
        way. True without tensor parallel is refused.

        A layout the model cannot split into is refused from its config, before any process group is
        made or weight is read."""
        from treegen.runtime import distributed
        from treegen.runtime.loader import load_config, load_model
        from treegen.runtime.shard import check_tensor_parallel, vocab_parallel_for

        device = torch.device(device)
        distributed.check_layout(tensor_parallel, data_parallel, device)
        vocab_parallel_for(vocab_parallel, tensor_parallel)  # (a bad value: refused before anything runs)
        if tensor_parallel == 1 and data_parallel in (None, 1) and not distributed.launched():
            return cls(*load_model(model, dtype=dtype, device=device, implementation=implementation), **options)
        if tensor_parallel > 1 and implementation == "generic":
            raise distributed.DistributedError("tensor_parallel > 1 runs treegen's fast path only (its split "
                                               "forward); the generic path runs on one GPU per replica")
        config = load_config(model)
        check_tensor_parallel(config, tensor_parallel)
        split_vocab = vocab_parallel_for(vocab_parallel, tensor_parallel, int(config.vocab_size))
        if not distributed.launched():
            if data_parallel not in (None, 1):
                from treegen.runtime.loader import load_tokenizer
                from treegen.runtime.replicas import ReplicatedEngine, start_replicas
                from treegen.tree.sharing_tree import KVShape

                tokenizer = load_tokenizer(model)
                fmt = kv_format(options.get("kv_dtype"), dtype)  # (the bytes; each replica checks its GPU)
                replicas = start_replicas(model, dtype=dtype, device=device, implementation=implementation,
                                          tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                                          options=dict(options, vocab_parallel=vocab_parallel))
                return ReplicatedEngine(tokenizer, replicas, model_name=str(model or "SmolLM2-135M-Instruct (embedded)"),
                                        kv_shape=KVShape.from_config(load_config(model), fmt.bytes_per_value,
                                                                     fmt.scale_bytes),
                                        attention=options.get("attention", "tree"), device=device)
            from treegen.runtime.workers import start_team

            parallel, team = start_team(model, dtype=dtype, device=device, tensor_parallel=tensor_parallel,
                                        options=options, vocab_parallel=split_vocab)
            try:
                return cls(*load_model(model, dtype=dtype, device=parallel.device, tp=parallel.tensor),
                           parallel=parallel, workers=team, **options)
            except BaseException:
                team.close()
                raise
        parallel = distributed.init_parallel(tensor_parallel=tensor_parallel, data_parallel=data_parallel, device=device,
                                             vocab_parallel=split_vocab)
        return cls(*load_model(model, dtype=dtype, device=parallel.device, tp=parallel.tensor,
                               implementation=implementation if tensor_parallel == 1 else "fast"),
                   parallel=parallel, **options)

    def start(self) -> "TreeRun":
        if self.workers is not None:
            from treegen.runtime.mirror import LeaderRun

            return LeaderRun(self, self.workers)
        return TreeRun(self)

    def close(self) -> None:
        """End the tensor-parallel workers this process started (nothing to do otherwise); the engine
        cannot run afterwards."""
        if self.workers is not None:
            self.workers.close()

    def __repr__(self) -> str:
        backend = "tree kernels" if self.attention_backend == "auto" else "PyTorch reference attention"
        graphs = f" ({self.graphs_off_reason})" if self.graphs_off_reason else ""
        where = f", {self.parallel!r}" if self.parallel is not None else ""
        return (f"Engine({self.model!r}, path={self.implementation!r}, attention={self.attention!r} ({backend}), "
                f"kv={self.kv_format.name}, cuda_graphs={self.cuda_graphs}{graphs}{where})")



@dataclass(frozen=True)
class PassPlan:
    """The tree-attention plans of one forward pass: one per kind of attention among the model's layers
    (full, or a sliding window of some size: Mistral, Gemma 2/3's local layers), all sharing one
    ``query_pos`` tensor, which a decode phase advances in place between steps.

    ``by_window``: window (None: full attention) → plan; ``layer_window[i]``: layer i's window."""

    by_window: dict[int | None, TreeAttentionPlan]
    layer_window: tuple[int | None, ...]

    @property
    def query_pos(self) -> torch.Tensor:
        return next(iter(self.by_window.values())).query_pos

    @property
    def backend(self) -> str:
        return next(iter(self.by_window.values())).backend

    def layer(self, i: int) -> TreeAttentionPlan:
        return self.by_window[self.layer_window[i]]


class TreeRun:
    """One sharing tree, the KV of its nodes, and the jobs running over it (see the module doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.tree = SharingTree()
        m = self.model
        self.kv = KVStore(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                          dtype=m.dtype, device=m.device, fmt=engine.kv_format)
        self.scheduler = Scheduler(self.tree, self.kv, self.kv_budget, engine.max_prefill_tokens, engine.max_batch,
                                   offload=engine.offload_policy(), kv_keep_every=engine.kv_keep_every)
        self.decoder = Decoder(self)
        self.forward_passes = 0
        self.decode_phases: list[int] = []  # live branches of each decode phase, in order
        self.mixed_steps = 0  # forward passes that prefilled new work (with the live branches' decode rows)
        self._phase = None  # the running decode phase (a generator), if any
        self._just_mixed = False  # the last step prefilled new work (see advance)
        # host time by kind (seconds): scheduling, planning phases, capturing their CUDA graphs (which
        # runs the first step), reading sampled tokens, running program code (batch driver)
        self.host_seconds = {"schedule": 0.0, "plan": 0.0, "capture": 0.0, "accept": 0.0, "programs": 0.0,
                             "swa": 0.0}
        # sparse window attention: compactions run, KV tokens dropped; swa_log (None: off) = {} records
        # each compaction as node -> [(tokens accounted for, token indices kept), ...]
        self.swa_compactions = self.swa_dropped = 0
        self.swa_log: dict | None = None
        self._completed: list[Job] = []

    # jobs ----------------------------------------------------------------------------------------
    def submit(self, request: GenRequest | ScoreRequest, on_done=None, on_tokens=None) -> Job:
        """Queue a request; it runs when :meth:`advance` is called. Returns its :class:`Job`.
        Raises at once for a request that can never run (a gen into a node with children, or past
        the model's context)."""
        if isinstance(request, GenRequest):
            tree = self.tree
            if tree.children(request.node):
                raise RuntimeError(f"gen into node {request.node}, which has children")
            total = len(tree.path_tokens(request.node)) + request.params.max_tokens
            if total > self.model.max_context:
                raise ValueError(f"a branch would reach {total} tokens (prompt + max_tokens={request.params.max_tokens}), "
                                 f"past the model's context of {self.model.max_context}")
            if request.params.constraint is not None:
                if not self.model.eos_token_ids:
                    raise ValueError(f"a constrained gen ({request.params.constraint}) ends on an EOS token, "
                                     "and this model has none")
                self.engine.grammars.compile(request.params.constraint)  # once per constraint, before it runs
            if request.params.kv_keep is None and self.engine.kv_keep is not None:  # the engine's default
                request = dataclasses.replace(request, params=dataclasses.replace(request.params,
                                                                                  kv_keep=self.engine.kv_keep))
            if request.params.kv_keep is not None:
                self.engine.check_swa(f"gen into node {request.node} with kv_keep={request.params.kv_keep}")
        elif not isinstance(request, ScoreRequest):
            raise TypeError(f"submit expects a GenRequest or ScoreRequest, got {type(request).__name__}")
        job = Job(request, on_done=on_done, on_tokens=on_tokens)
        self.scheduler.submit(job)
        return job

    def busy(self) -> bool:
        """Jobs are waiting, prefilling or decoding."""
        return self._phase is not None or bool(self.decoder.live) or self.scheduler.has_work()

    def advance(self) -> list[Job]:
        """Run the engine's loop until at least one job completes; returns the jobs that did (their
        ``on_done`` already called). An empty list: nothing is left to run."""
        while not self._completed:
            if self._phase is not None:
                try:
                    next(self._phase)
                except StopIteration:
                    self._phase = None
                continue
            live = len(self.decoder.live)
            if self._just_mixed and live and not self.scheduler.phase_should_end(live, live):
                # new work arrived during the last mixed step, too little to be worth another
                # uncaptured step before the live branches decode on: it joins when the phase ends
                self._just_mixed = False
                self._phase = self.decoder.phase()
                continue
            t0 = time.perf_counter()
            step = self.scheduler.next_step(live, [self.decoder.jobs[b].request.node for b in self.decoder.live])
            self.host_seconds["schedule"] += time.perf_counter() - t0
            for job in step.refused:
                self.complete(job, None)
            self._just_mixed = step.runs_model
            if step.runs_model:
                self._run_step(step)
            elif self.decoder.live:
                self._phase = self.decoder.phase()
            elif not step.refused:
                if self.scheduler.has_work():  # the scheduler refuses what cannot fit when nothing runs
                    raise RuntimeError("the engine has waiting jobs but nothing it can run (a scheduler bug)")
                break
        done, self._completed = self._completed, []
        return done

    @property
    def offload_stats(self) -> dict:
        """KV moved to the host and back, dropped and recomputed during this run, and the time it took
        (:class:`~treegen.runtime.kv_store.OffloadCounters`)."""
        return self.kv.counters.as_dict()

    def cancel(self, job: Job) -> None:
        """Drop a job that is not done: a waiting or admitted one leaves the queue, a decoding
        branch leaves the batch (a running phase computes its row until it ends, unread). Its
        ``on_done`` is not called; the KV it holds stays until its owner frees it."""
        if job.done:
            return
        job.done = True
        job.error = RuntimeError("cancelled")
        if not self.scheduler.cancel(job):
            self.decoder.cancel(job)

    def complete(self, job: Job, result) -> None:
        """Record a job's result (``job.error`` set: refused) and tell its submitter."""
        job.result, job.done = result, True
        self._completed.append(job)
        if job.on_done is not None:
            job.on_done(job)

    def execute(self, gens: list[GenRequest], scores: list[ScoreRequest]) -> tuple[list[GenResult], list[list[float]]]:
        """Run these requests to completion (the static case: everything known up front); returns
        the generations and the choice scores in request order. A refused request raises its error."""
        jobs = [self.submit(r) for r in [*gens, *scores]]
        while not all(j.done for j in jobs) and self.advance():
            pass
        for j in jobs:
            if j.error is not None:
                raise j.error
        return [j.result for j in jobs[: len(gens)]], [j.result for j in jobs[len(gens):]]

    def _run_step(self, step) -> None:
        """One forward pass: the live branches' decode rows, then ``step.rows``; draws the live
        branches' next tokens and the first tokens of ready gens, and scores ready selects."""
        tree, dec = self.tree, self.decoder
        decode_rows = dec.decode_rows()
        rows = decode_rows + step.rows
        row_of = {r: j for j, r in enumerate(rows)}
        gens = [j for j in step.ready if j.is_gen]
        scores = [j for j in step.ready if not j.is_gen]
        wanted = [row_of[r] for r in decode_rows] + [row_of[conditioning_row(tree, j.request.node)] for j in gens]
        per_score = [score_rows(tree, j) for j in scores]
        for rs in per_score:
            wanted += [row_of[r] for choice in rs for r in choice]
        split = self.model.vocab_split  # (a head split by vocabulary: the sampler reads this rank's logits)
        logits = self._forward(rows, wanted, gather=split is None)
        self.mixed_steps += 1
        dec.draw(logits[: len(decode_rows) + len(gens)], gens)
        if not scores:
            return
        # every choice's mean token log-probability, read to the host at once
        at = len(decode_rows) + len(gens)
        targets = torch.tensor([t for job in scores for c in job.request.choices for t in tree.tokens(c)],
                               device=logits.device)
        chosen = logits[at:] if split is None else split.gather(logits[at:])
        picked = chosen.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        sizes = [len(choice_rows) for rs in per_score for choice_rows in rs]
        means = iter(torch.stack([part.mean() for part in picked.split(sizes)]).tolist())
        for job in scores:
            self.complete(job, [next(means) for _ in job.request.choices])

    # ---------------------------------------------------------------------------------------------
    def free(self, node: int) -> None:
        """Drop a node's KV and mark it (and its subtree) pruned."""
        for n in [node, *sorted(nx.descendants(self.tree.graph, node))]:
            self.kv.free(n)
        self.tree.prune(node)

    def plan_rows(self, rows: list[tuple[int, int]], grow: dict[int, int] | None = None):
        """Inputs and attention plan for running the (node, index) token ``rows`` through the model.

        Every node on a row's path must already have its KV or have all its missing rows here.
        ``grow``: node → extra keys it may gain during a decode phase; its segment is planned that
        long (keys not yet written sit at positions after every query, so attention masks them).
        Returns ``(input_ids [T], slots [T], plan)``: a :class:`PassPlan` (one plan per window size
        among the layers); ``plan.query_pos`` holds the positions [T].

        A segment that sparse window attention compacted (``dropped`` tokens, :mod:`treegen.runtime.swa`)
        holds its kept keys in its first slots: token ``i`` written since goes to slot ``i - dropped``,
        and the plan gives the segment the *mask* position ``node position + dropped``, so its written
        keys sit just before the next query and the unwritten tail after it. The queries keep their
        true positions (``query_pos`` is also their RoPE position; the keys were stored after RoPE at
        theirs), so only the mask of that one segment moves — which is why sliding-window layers, whose
        mask compares true distances, are refused with SWA.
        """
        tree, kv, model = self.tree, self.kv, self.model
        new_len: dict[int, int] = {}  # tokens of each node accounted for after this pass
        for n, i in rows:
            new_len[n] = max(new_len.get(n, kv.computed(n)), i + 1)
        segments = sorted({p for n in new_len for p in tree.path(n)})
        drop = {s: kv.dropped(s) for s in segments}
        for n, i in rows:
            if i < drop[n]:
                raise RuntimeError(f"token {i} of node {n} is among the {drop[n]} whose KV sparse window "
                                   "attention dropped; it cannot be run again")
        for s in segments:
            if s in kv.offloaded:
                raise RuntimeError(f"node {s} is read while its KV is on the host (a scheduling bug)")
            length = new_len.get(s, kv.computed(s))
            if s not in new_len and length != len(tree.tokens(s)):
                raise RuntimeError(f"node {s} is missing KV for {len(tree.tokens(s)) - length} tokens")
            new_len[s] = length
            kv.reserve(s, max(length - drop[s] + (grow or {}).get(s, 0), 1))
        index = {s: j for j, s in enumerate(segments)}
        pos = {s: tree.position(s) for s in segments}
        device = model.device
        input_ids = torch.tensor([tree.tokens(n)[i] for n, i in rows], dtype=torch.int64, device=device)
        slots = torch.tensor([kv.segments[n].start + i - drop[n] for n, i in rows], dtype=torch.int64, device=device)
        query_pos = [pos[n] + i for n, i in rows]
        query_pos_buffer = torch.tensor(query_pos, dtype=torch.int64, device=device)  # shared by every window's plan
        layer_window = tuple(model.layer_window)
        plan = PassPlan({window: plan_tree_attention(
            segment_parent=[index.get(tree.parent(s), -1) for s in segments],
            segment_start=[kv.segments[s].start for s in segments],
            segment_len=[new_len[s] - drop[s] + (grow or {}).get(s, 0) for s in segments],
            segment_pos=[pos[s] + drop[s] for s in segments],
            query_segment=[index[n] for n, _ in rows],
            query_pos=query_pos,
            query_pos_buffer=query_pos_buffer,
            device=device,
            backend=self.engine.attention_backend,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            dtype=model.dtype,  # the queries' dtype (an 8-bit cache's large shared segment is dequantized to it)
            window=window,
            softcap=model.attn_softcap,
        ) for window in dict.fromkeys(layer_window)}, layer_window)
        for s in new_len:
            seg = kv.segments[s]
            seg.computed = max(seg.computed, new_len[s] - drop[s])
        return input_ids, slots, plan

    def attend_fn(self, plan, slots: torch.Tensor, recorder=None):
        """The per-layer ``attend`` callback: write the new keys/values at ``slots``, then attend.
        ``recorder``: a :class:`~treegen.runtime.swa.QueryRecorder` keeping the SWA rows' queries."""
        kv, scale = self.kv, self.model.attn_scale
        if self.engine.attention == "none":
            return lambda layer, q, k, v: q  # benchmark ceiling: no KV traffic, no attention

        def attend(layer: int, q, k, v):
            kv.wait_layer(layer)  # KV copied back from the host for this step: this layer's copies first
            if recorder is not None:
                recorder.record(layer, q)
            if k is not None:  # else the model wrote them already (see cache below)
                kv.write(layer, slots, k, v)
            k_cache, v_cache, k_scale, v_scale = kv.layer(layer)
            return tree_attention(q, k_cache, v_cache, plan.layer(layer), scale, k_scale, v_scale)

        def cache(layer: int):
            """Where this pass's keys/values go: the model's fused RoPE kernel writes (and, for an 8-bit
            cache, quantizes) them there directly — ``(k_cache, v_cache, slots[, k_scale, v_scale])``."""
            kv.wait_layer(layer)  # (before the write: the slots may have held offloaded KV still being copied)
            k_cache, v_cache, k_scale, v_scale = kv.layer(layer)
            return (k_cache, v_cache, slots) + ((k_scale, v_scale) if k_scale is not None else ())

        attend.cache = cache
        return attend

    def _forward(self, rows: list[tuple[int, int]], logits_rows: list[int], gather: bool = True) -> torch.Tensor:
        """Run the model on the (node, index) token rows → fp32 logits [len(logits_rows), vocab].

        Rows are taken in order (parents before children) in chunks of at most
        ``engine.max_prefill_tokens``, so activations stay bounded however large the prefill.
        ``gather=False``: of a head split by vocabulary, this rank's columns only (``model.forward``)."""
        chunk = self.engine.max_prefill_tokens
        parts, taken = [], []
        for begin in range(0, len(rows), chunk):
            input_ids, slots, plan = self.plan_rows(rows[begin : begin + chunk])
            mine = [i for i, r in enumerate(logits_rows) if begin <= r < begin + chunk]
            wanted = torch.tensor([logits_rows[i] - begin for i in mine], dtype=torch.int64, device=self.model.device)
            parts.append(self.model.forward(input_ids, plan.query_pos, self.attend_fn(plan, slots), wanted,
                                            gather=gather))
            self.kv.wait_restores()  # (every layer waited already; nothing is pending afterwards)
            taken += mine
            self.forward_passes += 1
        if len(taken) != len(logits_rows):
            raise ValueError("logits_rows must name rows of this forward pass")
        split = self.model.vocab_split
        width = self.model.vocab_size if gather or split is None else split.width
        logits = torch.cat(parts) if parts else torch.empty(0, width, device=self.model.device)
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
        """The KV memory this run may use now. On CUDA: its slot pool plus what the device has free
        (cached blocks included) less a margin for activations — less the pool itself again once KV
        is written, because a grown pool is a copy made while the old one is still held (so
        admitting work never needs memory the device cannot give); at most ``engine.kv_budget_bytes``
        when set. On the CPU: ``engine.kv_budget_bytes`` (None: no limit)."""
        kv, engine = self.kv, self.engine
        if kv.device.type != "cuda":
            return KVBudget(engine.kv_budget_bytes, kv.bytes_per_token)
        free, total = torch.cuda.mem_get_info(kv.device)
        free += torch.cuda.memory_reserved(kv.device) - torch.cuda.memory_allocated(kv.device)
        pool = kv.num_slots * kv.bytes_per_token
        room = int(free - max(0.1 * total, 4 * 2**30)) - (pool if kv.written() else 0)
        reachable = pool + max(0, room)
        if engine.kv_budget_bytes is not None:
            reachable = min(reachable, engine.kv_budget_bytes)
        if engine.parallel is not None:  # every rank of a replica admits the same work: the smallest budget
            reachable = engine.parallel.tensor.agree_min(reachable, kv.device)
        return KVBudget(reachable, kv.bytes_per_token)
