"""The engine: a loaded model and tokenizer, and how runs over sharing trees are made.

An :class:`Engine` holds the model (loaded once: :meth:`Engine.load`, also split over tensor-parallel
ranks or replicated over data-parallel processes) and its settings (attention mode, CUDA graphs, KV
format and memory, offload, sparse window attention). :meth:`Engine.start` opens a
:class:`~treegen.runtime.tree_run.TreeRun`, which runs the engine's loop over one sharing tree (see
:mod:`treegen.runtime.tree_run`).
"""

from __future__ import annotations

import inspect
import logging

import torch

from treegen.kernels.kv_quant import kv_format
from treegen.kernels.tree_attention_triton import SUPPORTED_HEAD_DIMS
from treegen.runtime import swa
from treegen.runtime.constraint import Constraint, Grammars
from treegen.runtime.stop_strings import StopStrings
from treegen.runtime.text_decode import BatchDecoder
from treegen.runtime.token_automata import Automata, Automaton
from treegen.runtime.distributed import finish_launch
from treegen.runtime.host_arena import HostArena
from treegen.runtime.offload import OffloadPolicy, OffloadRates, default_host_bytes, measure_rates
from treegen.runtime.requests import GenRequest, GenResult, Job, ScoreRequest
from treegen.runtime.tree_run import PassPlan, TreeRun
from treegen.tree.sharing_tree import KVShape

__all__ = ["ATTENTION_MODES", "Engine", "GenRequest", "GenResult", "Job", "PassPlan", "ScoreRequest", "TreeRun"]


ATTENTION_MODES = ("tree", "flat", "none")
# Engine's parameters that are not options (Engine.load makes them)
_NOT_OPTIONS = ("self", "model", "tokenizer", "parallel", "workers")

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
    ``swa.DEFAULT_EVERY`` / ``swa.DEFAULT_HISTORY``). jump_forward: constrained gens that name no
    ``jump_forward`` of their own start with the text their constraint forces written at once, not decoded
    (default False; see :class:`~treegen.runtime.sampler.SamplingParams`).

    offload: what happens to the KV of idle nodes (no running job reads them: branches that continue
    later, nodes of waiting subtrees) when work does not fit the KV budget (:mod:`treegen.runtime.offload`):
    ``"auto"`` (default) moves it to the host (pinned memory on CUDA) and back, or drops it and
    prefills its tokens again, whichever the rates measured on this machine (once per engine,
    :attr:`offload_rates`) say is cheaper; ``"host"`` always moves it; ``"recompute"`` always drops
    it; ``"off"`` keeps it (work waits, or is refused when it could never fit). Lossless: results are
    those of a run with all KV in memory. offload_bytes: the most KV bytes kept on the host (default
    a quarter of the machine's physical memory); past it, ``"auto"`` recomputes and ``"host"`` refuses
    what cannot fit, naming the sizes. host_reserve_bytes: host memory for offloaded KV allocated (pinned)
    when the engine is made (default 0: as offloads first need it), so that no run pays for pinning — slow:
    ~0.3-0.7 ms a MiB on an H100 host (:attr:`host_reserve_seconds` says what it took; at most
    ``offload_bytes``; vLLM's swap space). With tensor parallelism ``"auto"`` acts as ``"host"`` (every
    rank must decide the same, without measuring). slice_tokens: None (default) — every gen reserves its
    whole length; a number (``scheduler.SLICE_TOKENS`` = 512 is the measured one) — with offload on and a
    bounded budget, the most tokens a gen reserves ahead: where its slice ends it takes the next one, or
    pauses (its KV may go to the host) while branches further along use the memory (see
    :mod:`treegen.runtime.scheduler`; long generations short of memory run in far fewer forward passes).

    The model runs on one of two paths (``implementation``, see :mod:`treegen.runtime.loader`): the fast
    path (treegen's own forward) or the generic path (transformers' own modules with tree attention
    plugged in; exact, slower). The engine logs a one-line notice when it runs the generic path, and
    its repr names the path; CUDA graphs stay off for a model whose modules cannot be captured.
    token_automata: serve constrained gens whose constraint is a regular language of ASCII text (most
    regexes and choices) from a token automaton on the device — a step's masks and next states
    computed in the captured step, no host work per step (:mod:`~treegen.runtime.token_automata`);
    False: xgrammar's matchers serve every constraint (the host fills each step's masks).
    parallel: this process's place among several (:class:`~treegen.runtime.distributed.Parallel`;
    None: one process) — set by :meth:`load` with ``tensor_parallel`` / ``data_parallel``. The model
    is then this rank's shard, every rank of a replica runs the same programs on the same tree (host
    decisions that read the device, like the KV budget, are agreed on), and a batch is split across
    replicas by :func:`treegen.lang.data_parallel.run_batch_data_parallel`.
    """

    def __init__(self, model, tokenizer, *, attention: str = "tree", cuda_graphs: bool = True,
                 max_prefill_tokens: int = 16384, kv_budget_bytes: int | None = None,
                 max_batch: int | None = None, kv_dtype: str | None = None, offload: str = "auto",
                 offload_bytes: int | None = None, host_reserve_bytes: int = 0, slice_tokens: int | None = None,
                 kv_keep: float | None = None,
                 kv_keep_every: int = swa.DEFAULT_EVERY, kv_keep_history: int = swa.DEFAULT_HISTORY,
                 token_automata: bool = True, jump_forward: bool = False, parallel=None, workers=None) -> None:
        self.check_settings(attention=attention, cuda_graphs=cuda_graphs, max_prefill_tokens=max_prefill_tokens,
                            kv_budget_bytes=kv_budget_bytes, max_batch=max_batch, kv_dtype=kv_dtype, offload=offload,
                            offload_bytes=offload_bytes, host_reserve_bytes=host_reserve_bytes,
                            slice_tokens=slice_tokens, kv_keep=kv_keep, kv_keep_every=kv_keep_every,
                            kv_keep_history=kv_keep_history, token_automata=token_automata,
                            jump_forward=jump_forward)
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
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_budget_bytes = kv_budget_bytes
        self.max_batch = max_batch
        self.offload = "host" if offload == "auto" and parallel is not None else offload
        self.offload_bytes = default_host_bytes() if offload_bytes is None else offload_bytes
        self._offload_rates: OffloadRates | None = None
        self.slice_tokens = slice_tokens
        # offloaded KV's host memory (pinned on CUDA), kept across runs: pinning is slow (see host_arena)
        self.host_arena = HostArena(pinned=model.device.type == "cuda")
        self.kv_keep = None if kv_keep is None else float(kv_keep)
        self.kv_keep_every, self.kv_keep_history = kv_keep_every, kv_keep_history
        self.jump_forward = jump_forward
        self.parallel = parallel
        self.workers = workers  # the tensor-parallel workers this process started (treegen.runtime.workers.Team)
        self.phases_captured = 0  # decode graphs captured by this engine's runs (later ones skip the warm-up)
        # device memory held with no run alive (the weights): see TreeRun.kv_budget
        device = getattr(model, "device", None)
        self.idle_allocated = torch.cuda.memory_allocated(device) \
            if isinstance(device, torch.device) and device.type == "cuda" else 0
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
        self.token_automata = token_automata
        self._automata: Automata | None = None
        self._stop_strings: StopStrings | None = None
        # many texts decoded at once (stop strings' tails, the texts of the branches a block finishes)
        self.batch_decode = BatchDecoder(tokenizer)
        # last: pinning takes seconds, spent only once every setting has been accepted
        self.host_reserve_seconds = self.host_arena.reserve(host_reserve_bytes)

    @classmethod
    def check_options(cls, options: dict, where: str = "Engine.load") -> None:
        """Refuse what no model could run with before one is loaded (minutes for a large one): an option
        :class:`Engine` does not take (TypeError naming it and the options), or a bad value
        (:meth:`check_settings`)."""
        names = [p for p in inspect.signature(cls.__init__).parameters if p not in _NOT_OPTIONS]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{where} got unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"the options are {', '.join(names)}")
        cls.check_settings(**options)

    @staticmethod
    def check_settings(*, attention: str = "tree", cuda_graphs: bool = True, max_prefill_tokens: int = 16384,
                       kv_budget_bytes=None, max_batch=None, kv_dtype=None, offload: str = "auto",
                       offload_bytes=None, host_reserve_bytes: int = 0, slice_tokens=None, kv_keep=None,
                       kv_keep_every: int = swa.DEFAULT_EVERY, kv_keep_history: int = swa.DEFAULT_HISTORY,
                       token_automata: bool = True, jump_forward: bool = False) -> None:
        """Raise ValueError naming the first setting of :class:`Engine` whose value is bad whatever the model
        (those that depend on it — FP8 on an old GPU, sparse window attention beside sliding windows — are
        checked when the engine is made)."""
        def positive(name, value, none_ok=True):
            if value is None and none_ok:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer{' or None' if none_ok else ''}, got {value!r}")

        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
        for name, value in (("cuda_graphs", cuda_graphs), ("token_automata", token_automata),
                            ("jump_forward", jump_forward)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        positive("max_prefill_tokens", max_prefill_tokens, none_ok=False)
        positive("kv_budget_bytes", kv_budget_bytes)
        positive("max_batch", max_batch)
        positive("slice_tokens", slice_tokens)
        kv_format(kv_dtype, torch.float32)  # (the name; FP8 on this GPU is checked when the engine is made)
        host_bytes = default_host_bytes() if offload_bytes is None else offload_bytes
        OffloadPolicy(offload, host_bytes, rates=lambda: None)  # checks both
        if not isinstance(host_reserve_bytes, int) or isinstance(host_reserve_bytes, bool) or host_reserve_bytes < 0:
            raise ValueError(f"host_reserve_bytes must be an integer >= 0, got {host_reserve_bytes!r}")
        if host_reserve_bytes and offload in ("off", "recompute"):
            raise ValueError(f"host_reserve_bytes={host_reserve_bytes} with offload={offload!r}: no KV goes to the host")
        if host_reserve_bytes > host_bytes:
            raise ValueError(f"host_reserve_bytes={host_reserve_bytes} is more than offload_bytes={host_bytes}, the "
                             "most KV kept on the host")
        swa.check_kv_keep(kv_keep, "Engine(kv_keep=...)")
        swa.check_period(kv_keep_every, "Engine(kv_keep_every=...)")
        swa.check_period(kv_keep_history, "Engine(kv_keep_history=...)")

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

    def automaton(self, constraint: Constraint | None) -> Automaton | None:
        """The device automaton that serves ``constraint`` (regexes, choices, and JSON schemas that are
        plainly regular, of ASCII text, small; built on first use), or None: xgrammar's matchers serve it
        (see :mod:`~treegen.runtime.token_automata`; ``token_automata=False``: always)."""
        if not self.token_automata or constraint is None:
            return None
        if self._automata is None:
            self._automata = Automata(self.grammars, self.model.device)
        return self._automata.get(constraint)

    @property
    def stop_strings(self) -> StopStrings:
        """The test that rules stop strings out of a block of new tokens for this tokenizer (its table of
        the characters each token writes is made at the first gen with stop strings; see
        :mod:`~treegen.runtime.stop_strings`)."""
        if self._stop_strings is None:
            self._stop_strings = StopStrings(self.tokenizer, self.batch_decode)
        return self._stop_strings

    @property
    def automata(self) -> Automata | None:
        """The device tables of the automata built so far (None before the first)."""
        return self._automata

    @classmethod
    def load(cls, model: str | None = None, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
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
          next (or the waiting) call raise :class:`~treegen.runtime.workers.WorkerError` with its error (in a
          ``run_batch``, :class:`~treegen.lang.batch.EngineFailed` with the results so far, caused by it).
          :meth:`close` (or dropping the engine, or exit) ends the workers.

        ``vocab_parallel`` (with ``tensor_parallel`` > 1): the LM head split by vocabulary over the ranks
        (True: each rank holds and computes the logits of ``1 / tensor_parallel`` of the tokens; the
        sampler combines the ranks' best tokens, gathering the whole logits only for top-p / top-k, scores
        and prefill; the embedding stays whole, see :mod:`treegen.runtime.shard`), or whole on every
        rank (False); ``"auto"`` splits it wherever the vocabulary splits. The tokens are the same either
        way. True without tensor parallel is refused.

        A layout the model cannot split into is refused from its config, before any process group is
        made or weight is read. ``dtype``: a floating torch dtype or its name (``"bfloat16"``, as ``treegen run
        --dtype`` takes it)."""
        from treegen.runtime import distributed
        from treegen.runtime.loader import UnsupportedModelError, implementation_of, load_config, load_model
        from treegen.runtime.shard import check_tensor_parallel, vocab_parallel_for

        device = torch.device(device)
        dtype = model_dtype(dtype)
        cls.check_options(options)  # (before any weight is read or process started)
        distributed.check_layout(tensor_parallel, data_parallel, device)
        vocab_parallel_for(vocab_parallel, tensor_parallel)  # (a bad value: refused before anything runs)
        if tensor_parallel == 1 and data_parallel in (None, 1) and not distributed.launched():
            return cls(*load_model(model, dtype=dtype, device=device, implementation=implementation), **options)
        if tensor_parallel > 1 and implementation == "generic":
            raise distributed.DistributedError("tensor_parallel > 1 runs treegen's fast path only (its split "
                                               "forward); the generic path runs on one GPU per replica")
        if tensor_parallel > 1:  # (before any process starts: a model only the generic path runs has no split)
            path, reason = implementation_of(model, implementation)
            if path == "generic":
                raise UnsupportedModelError(f"{model!r} runs on the generic path ({reason}), which has no "
                                            f"tensor-parallel split: use tensor_parallel=1 (data parallel works)")
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
                replicas = start_replicas(cls, model, dtype=dtype, device=device, implementation=implementation,
                                          tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                                          options=dict(options, vocab_parallel=vocab_parallel))
                return ReplicatedEngine(tokenizer, replicas, model_name=str(model or "SmolLM2-135M-Instruct (embedded)"),
                                        kv_shape=KVShape.from_config(load_config(model), fmt.bytes_per_value,
                                                                     fmt.scale_bytes),
                                        attention=options.get("attention", "tree"), device=device)
            from treegen.runtime.workers import start_team

            parallel, team = start_team(cls, model, dtype=dtype, device=device, tensor_parallel=tensor_parallel,
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
        """End the tensor-parallel workers this process started, or, under torchrun, this rank's part of
        the launch (every rank calls it: it waits for all, then ends the process group); the engine
        cannot run afterwards."""
        if self.workers is not None:
            self.workers.close()
        elif self.parallel is not None:
            finish_launch()

    def __repr__(self) -> str:
        backend = "tree kernels" if self.attention_backend == "auto" else "PyTorch reference attention"
        graphs = f" ({self.graphs_off_reason})" if self.graphs_off_reason else ""
        where = f", {self.parallel!r}" if self.parallel is not None else ""
        return (f"Engine({self.model!r}, path={self.implementation!r}, attention={self.attention!r} ({backend}), "
                f"kv={self.kv_format.name}, cuda_graphs={self.cuda_graphs}{graphs}{where})")


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(dtype) -> torch.dtype:
    """The weights' dtype from a torch dtype or its name; ValueError naming ``dtype`` otherwise."""
    if isinstance(dtype, str) and dtype in MODEL_DTYPES:
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2:
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)} (a torch dtype or its name), got {dtype!r}")

