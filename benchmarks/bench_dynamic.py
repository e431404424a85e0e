"""Dynamic workloads (programs that grow as they run) against the same token work as one static fork.

Random weights of a real model shape (speed does not depend on the weights), bf16, EOS ignored so
every ``gen`` makes exactly its ``max_tokens``; token ids are their own text (``IdTokenizer``). Every
workload runs through ``run_batch`` — the continuous engine loop, programs resuming as soon as their
own work is done — and is compared with **the same token work run as one static fork in the same
process**: the same shared prefix, one node per program, ``branches`` leaves each generating the
workload's mean tokens per branch, all known up front (``TreeRun.execute``) — or ``--static-forks k``
such forks in a row, each with 1/k of the tokens, when one fork's KV would not fit the GPU.

The engine runs at most ``branches`` generating branches at once (``Engine(max_batch=branches)``),
and the workload has ``oversubscribe`` times more programs than that batch holds when every program
generates (``programs = oversubscribe x branches / width``): programs waiting on their own answers
leave the batch to others, as in any serving engine. The static run decodes the same number of
tokens with ``branches`` leaves.

Workloads:

* ``rounds`` — each program: the shared prefix, its own question, then three rounds of
  fork(width) → gen (lengths drawn between 16 and 384) → join → read the answers → append a follow-up;
* ``rounds-equal`` — the same with every gen 128 tokens;
* ``tot`` — a tree-of-thought search: fork(width) thoughts (lengths 32..192), keep the two with the
  best mean log-probability (``top_k``), prune the others, expand each kept thought by fork(width/2),
  three levels;

Inputs: a list (every program starts at once and the passes merge their prompts), or with ``--variants
arriving`` an iterator drawn as the run goes (a program starts when the engine has room, its prompt
attached to the live tree's prefix by radix lookup: :mod:`treegen.lang.arrivals`).

Reported per case: tokens/s of both (generated tokens / wall time, prefill included), their ratio,
decode steps, host seconds per decode step by kind (``TreeRun.host_seconds``), the step time of the
static run (for host time as a fraction of a step) and the GPU busy fraction (NVML utilisation sampled
every 20 ms, when available).

    python benchmarks/bench_dynamic.py --shape tinyllama-1.1b --branches 256 1024
    python benchmarks/bench_dynamic.py --shape llama3-8b --branches 256 1024 --workloads rounds
    python benchmarks/bench_dynamic.py --branches 1024 --repeats 3 --update   # interleaved, medians; add to the file
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import transformers
import triton

import treegen
from treegen.kernels.launch import Launcher
from treegen.runtime import collector, decode as decode_module, scheduler as scheduler_module
from treegen.runtime.decode import Decoder
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.scheduler import Scheduler
from bench_end_to_end import SHAPES, config_of, median_run  # benchmarks/
from plotting import pyplot, save

PREFIX, QUESTION, FOLLOW_UP, ROUNDS = 512, 32, 8, 3


def text(ids) -> str:
    return " " + " ".join(map(str, ids))


@treegen.program
def rounds(s, prefix, question, follow_up, lengths, width):
    s += text(prefix) + text(question)
    for r in range(ROUNDS):
        b = s.fork(width)
        b += lambda i: treegen.gen("answer", max_tokens=lengths[r][i], ignore_eos=True)
        s.join(b)
        s["answer"]  # the next round depends on these answers
        s += text(follow_up[r])
    return [len(a.split()) for a in s["answer"]]


@treegen.program
def tot(s, prefix, question, lengths, width):
    s += text(prefix) + text(question)
    frontier, level = [s], 0
    for level in range(ROUNDS):
        k = width if level == 0 else max(1, width // 2)
        nxt = []
        for node in frontier:
            b = node.fork(k)
            b += lambda i, node=node: treegen.gen("thought", max_tokens=lengths.pop(), ignore_eos=True)
            nxt += list(b)
        scores = [st.info["thought"]["logprob"] if st["thought"] is not None else 0 for st in nxt]
        ranked = sorted(range(len(nxt)), key=lambda i: -scores[i])
        keep = set(ranked[:2])
        for i, st in enumerate(nxt):
            if i not in keep:
                st.prune()
        frontier = [nxt[i] for i in sorted(keep)]
    return [st["thought"] for st in frontier]


def workload(kind: str, programs: int, width: int, vocab: int, seed: int = 0):
    """(program, inputs, generated tokens in all) for ``programs`` programs of ``kind``."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    prefix = ids(PREFIX)
    inputs, total = [], 0
    for _ in range(programs):
        if kind == "tot":
            n = width + 2 * max(1, width // 2) * (ROUNDS - 1)
            lengths = [rng.randint(32, 192) for _ in range(n)]
            inputs.append(dict(prefix=prefix, question=ids(QUESTION), lengths=list(lengths), width=width))
        else:
            draw = (lambda: 128) if kind == "rounds-equal" else (lambda: rng.randint(16, 384))
            lengths = [[draw() for _ in range(width)] for _ in range(ROUNDS)]
            inputs.append(dict(prefix=prefix, question=ids(QUESTION), follow_up=[ids(FOLLOW_UP) for _ in range(ROUNDS)],
                               lengths=lengths, width=width))
        total += sum(map(sum, lengths)) if kind != "tot" else sum(lengths)
    return (tot if kind == "tot" else rounds), inputs, total


class Busy:
    """Samples the GPU's utilisation (NVML: the fraction of time a kernel ran) every 20 ms."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        try:
            torch.cuda.utilization()
            self.ok = True
        except Exception as e:  # noqa: BLE001 - no NVML here: report None
            print(f"no GPU utilisation ({type(e).__name__}: {e})")
            self.ok = False

    def __enter__(self):
        if self.ok:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append(torch.cuda.utilization())

    def __exit__(self, *exc) -> None:
        self._stop.set()

    @property
    def fraction(self):
        return sum(self.samples) / (100 * len(self.samples)) if self.ok and self.samples else None


class Collections:
    """Python's garbage collections while in the block: count and seconds, full (oldest generation) and young."""

    def __init__(self) -> None:
        self.counts = {"full": 0, "young": 0}
        self.seconds = {"full": 0.0, "young": 0.0}
        self.full_where: list[str] = []  # per full collection: the caller that started it (file:line function)
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            if info["generation"] == 2:
                self.full_where.append(started_at())
            self._started = time.perf_counter()
            return
        kind = "full" if info["generation"] == 2 else "young"
        self.counts[kind] += 1
        self.seconds[kind] += time.perf_counter() - self._started

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def as_dict(self) -> dict:
        return {f"gc_{k}_collections": self.counts[k] for k in self.counts} | \
               {f"gc_{k}_s": round(self.seconds[k], 4) for k in self.seconds} | {"gc_full_where": self.full_where}


def started_at() -> str:
    """Where the code that started a garbage collection was: its innermost frame outside this file (an
    explicit ``gc.collect()`` names its caller; an automatic collection, the allocation that crossed the
    threshold)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"


WORKLOADS = ["rounds", "rounds-equal", "tot"]


def one_workload_arguments(parser, shape: str = "tinyllama-1.1b", branches: int = 256) -> None:
    """The arguments of a diagnostic that runs one of this file's workloads (trace_dynamic, profile_schedule,
    profile_dynamic_host): ``--shape --workload --branches --width --oversubscribe``, as bench_dynamic's."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default=shape)
    parser.add_argument("--workload", default="tot", choices=WORKLOADS)
    parser.add_argument("--branches", type=int, default=branches)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--oversubscribe", type=int, default=3)


def measure_dynamic(engine: Engine, kind: str, programs: int, width: int, warm_up: bool = True,
                    arriving: bool = False) -> dict:
    """The workload run twice with different inputs of the same sizes; the second is measured (only the
    measured one when ``warm_up`` is false). (A smaller warm-up left kernel variants of the full run's
    sizes to compile inside the timed run: measured on an H100, tot at 256 branches took 7.4 s cold and
    5.9 s warm.) ``arriving``: the inputs given as an iterator, drawn as the run goes
    (:mod:`treegen.lang.arrivals`: each program starts when the engine has room, its prompt attached to
    the live tree by radix lookup) instead of a list whose programs all start at once."""
    given = iter if arriving else list
    prog, inputs, total = workload(kind, programs, width, engine.model.vocab_size)
    torch.cuda.synchronize()
    cold = None
    if warm_up:
        start = time.perf_counter()
        prog.run_batch(engine, given(workload(kind, programs, width, engine.model.vocab_size, seed=1)[1]))  # compile, warm
        torch.cuda.synchronize()
        cold = time.perf_counter() - start
    variants = kernel_variants()
    with Busy() as busy, Collections() as collections:
        start = time.perf_counter()
        roots = prog.run_batch(engine, given(inputs))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tree_run = roots[0]._run.tree_run
    made = sum(st.info[name]["tokens"] for st in roots[0]._run.states for name in ("answer", "thought")
               if name in st.info and "tokens" in st.info[name])
    assert made == total, (made, total)
    steps = tree_run.forward_passes
    return {"dynamic_s": elapsed, "dynamic_cold_s": cold, "dynamic_tok_s": total / elapsed, "tokens": total, "forward_passes": steps,
            "mixed_steps": tree_run.mixed_steps, "phase_joins": tree_run.phase_joins,
            # a mixed step's wall time (planned, launched uncaptured, its tokens drawn and read on the host)
            "mixed_step_ms": 1e3 * tree_run.mixed_seconds / max(1, tree_run.mixed_steps), "decode_phases": len(tree_run.decode_phases),
            # mixed steps in kept graphs, and those replaying an earlier one's (on by default; the mixed-uncaptured variant turns keeping off)
            "mixed_kept": tree_run.mixed_kept, "mixed_replays": tree_run.mixed_reused,
            # token rows prefilled (new tokens, conditioning tokens run again), and prompt tokens later programs
            # found in the live tree (arriving inputs)
            "prefill_rows": tree_run.prefill_rows, "attached_tokens": roots[0]._run.pass_report.get("attached_tokens", 0),
            "kv_compactions": tree_run.kv.compactions, "kv_allocations": tree_run.kv.allocations,
            "kv_slots_moved": tree_run.kv.slots_moved,
            # phases captured as CUDA graphs, and phases that replayed graphs kept from an earlier one
            "phases_captured": tree_run.decoder.captured_phases, "phases_replaying_kept": tree_run.decoder.kept_phases,
            "keep_phase_graphs": tree_run.decoder.kept is not None,
            "host_ms_per_step": {k: 1e3 * v / steps for k, v in tree_run.host_seconds.items()},
            # scheduling runs only between decode phases: its time per call (the GPU may wait that long)
            "schedule_calls": tree_run.schedule_calls,
            "schedule_ms_per_call": 1e3 * tree_run.host_seconds["schedule"] / max(1, tree_run.schedule_calls),
            # kernel variants (Triton specializations) first launched, so compiled, inside the timed run
            "new_kernel_variants": kernel_variants() - variants,
            "phase_rows": tree_run.decode_phases, "phase_passes": tree_run.phase_passes,
            "phase_capture_ms": [round(1e3 * s, 1) for s in tree_run.phase_capture_seconds],
            # KV that left the GPU for want of memory and came back, or was dropped and prefilled again
            "offload": tree_run.offload_stats, "memory_waits": tree_run.scheduler.memory_waits,
            "gpu_busy": busy.fraction, **collections.as_dict()}


def kernel_variants() -> int:
    """Triton kernel specializations launched so far by treegen's launchers."""
    return sum(len(launcher.compiled) for launcher in Launcher.every)


def measure_static(engine: Engine, programs: int, width: int, new: int, forks: int = 1, warm_up: bool = True) -> dict:
    """The same prefix, one question node per program, programs x width leaves of ``new`` tokens each;
    ``forks`` such static forks one after the other (so the KV of each fits the GPU: a 1,024-branch
    fork of 1,800 tokens per branch would not, with Llama-3-8B). ``warm_up``: a short fork first."""
    g = torch.Generator().manual_seed(1)
    vocab = engine.model.vocab_size
    if warm_up:
        run = engine.start()  # compile this batch's kernels
        root = run.tree.add_node(None, list(range(1, PREFIX + 1)))
        run.execute([GenRequest(run.tree.add_node(root, [7]), SamplingParams(max_tokens=9, ignore_eos=True), key=i)
                     for i in range(programs * width)], [])
        del run
    torch.cuda.synchronize()
    steps = waits = made = 0
    with Busy() as busy:
        start = time.perf_counter()
        for _ in range(forks):
            run = engine.start()
            root = run.tree.add_node(None, torch.randint(1, vocab, (PREFIX,), generator=g).tolist())
            leaves = []
            for _ in range(programs):
                q = run.tree.add_node(root, torch.randint(1, vocab, (QUESTION,), generator=g).tolist())
                leaves += [run.tree.add_node(q) for _ in range(width)]
            params = SamplingParams(max_tokens=new, ignore_eos=True)
            results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in enumerate(leaves)], [])
            assert all(len(r.tokens) == new for r in results)
            steps += run.forward_passes
            waits += run.scheduler.memory_waits
            made += len(leaves) * new
            del run, results
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return {"static_s": elapsed, "static_tok_s": made / elapsed, "static_new": new, "static_forks": forks,
            "static_step_ms": 1e3 * elapsed / max(1, steps), "static_steps": steps,
            "static_memory_waits": waits, "static_gpu_busy": busy.fraction}


def plot(rows: list[dict], out: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, how in dict.fromkeys((r["workload"], variant_of(r)) for r in rows):
        pts = sorted((r["branches"], r["ratio"]) for r in rows if r["workload"] == kind and variant_of(r) == how)
        ax.plot(*zip(*pts), marker="o", linestyle="-" if how == "default" else ":", label=f"{kind} ({how})")
    ax.axhline(0.85, color="grey", linestyle="--", linewidth=1, label="target 0.85")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("branches (max batch)")
    ax.set_ylabel("dynamic / static tokens/s")
    ax.set_ylim(0, max(1.2, 1.1 * max(r["ratio"] for r in rows)))
    ax.legend()
    fig.suptitle(title)
    save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--branches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--oversubscribe", type=int, default=3, help="programs per batch's worth of programs")
    parser.add_argument("--static-forks", type=int, default=1,
                        help="run the static equivalent as this many forks in a row (each one's KV must fit)")
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed dynamic and static runs per case, interleaved; medians are reported")
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                        help="the engine as it is (default) or with one choice undone (see VARIANTS); several: "
                             "each one's dynamic runs, interleaved (an A/B in one process)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--update", action="store_true",
                        help="keep the output file's rows of cases not run now (each row names its device and date)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    model = LlamaFamilyModel.random(config_of(args.shape), dtype=torch.bfloat16, device="cuda")
    rows = []
    for kind in args.workloads:
        for branches in args.branches:
            engine = Engine(model, IdTokenizer(), max_batch=branches)
            programs = args.oversubscribe * branches // args.width
            print(f"{time.strftime('%H:%M:%S')} {kind}, {branches} branches, {programs} programs", flush=True)
            dynamic, static = {a: [] for a in args.variants}, []
            for k in range(args.repeats):  # interleaved: the host's speed drifts between runs
                for variant in args.variants:
                    with VARIANTS[variant]():
                        dynamic[variant].append(measure_dynamic(engine, kind, programs, args.width,
                                                                  warm_up=k == 0, arriving=variant == "arriving"))
                    gc.collect()
                per_branch = round(dynamic[args.variants[0]][0]["tokens"] / (branches * args.static_forks))
                static.append(measure_static(engine, branches // args.width, args.width, per_branch,
                                             args.static_forks, warm_up=k == 0))
                gc.collect()
            for variant in args.variants:
                runs = dynamic[variant]
                row = {"workload": kind, "shape": args.shape, "branches": branches, "programs": programs,
                       "width": args.width, "max_batch": branches, "variant": variant}
                row.update(median_run(runs, "dynamic_tok_s"))
                row["dynamic_cold_s"] = runs[0]["dynamic_cold_s"]
                row.update(median_run(static, "static_tok_s"))
                row["ratio"] = row["dynamic_tok_s"] / row["static_tok_s"]  # of the medians
                row["repeats"] = args.repeats
                row["dynamic_tok_s_runs"] = [d["dynamic_tok_s"] for d in runs]
                row["static_tok_s_runs"] = [s["static_tok_s"] for s in static]
                row["ratio_runs"] = [d["dynamic_tok_s"] / s["static_tok_s"] for d, s in zip(runs, static)]
                row["device"], row["date"] = torch.cuda.get_device_name(), now()
                row["host_fraction_of_step"] = sum(row["host_ms_per_step"].values()) / row["static_step_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            write(args, rows)  # after every case: a run cut short keeps what it measured
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n## {args.shape}, bf16 — dynamic vs the same token work as one static fork\n")
    print("| workload | variant | branches | static tok/s | dynamic tok/s | ratio | GPU busy (dyn/static) | host ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        busy = "/".join("-" if b is None else f"{b:.2f}" for b in (r["gpu_busy"], r["static_gpu_busy"]))
        print(f"| {r['workload']} | {r['variant']} | {r['branches']} | {r['static_tok_s']:,.0f} | {r['dynamic_tok_s']:,.0f} | "
              f"{r['ratio']:.2f} | {busy} | {sum(r['host_ms_per_step'].values()):.2f} |")
    out = write(args, rows)
    plot(json.loads(out.read_text())["rows"], out.with_suffix(".png"),
         f"{args.shape} shape, bf16, {torch.cuda.get_device_name()}")


@contextlib.contextmanager
def undone(owner, name: str, value):
    """``owner.name`` set to ``value`` (an engine choice undone) for the block, then restored."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# the engine as it is, and with one of its choices undone (an A/B: --variants default fifo):
# replan-0.75, replan-0.9 — decode phases end for new work later (REPLAN_FRACTION 0.75 / 0.9, not 0.5):
#     fewer phase boundaries (each leaves the GPU idle while the host schedules, plans and runs an eager step),
#     more finished rows computing until their phase ends;
# fifo — the scheduler admits waiting work in arrival order (its order before priorities existed);
# programs-after-phase — a block that completes jobs resumes their programs after the phase's end
# decision (``Decoder.overlap_programs``); mixed-uncaptured — mixed steps launched eagerly, not
# captured and kept as CUDA graphs (``TREEGEN_KEEP_MIXED_GRAPHS=0``, :mod:`treegen.runtime.mixed_graphs`; rows of
# earlier runs name the kept graphs' side "kept-mixed", from when they were off by default); gc-full-collections — Python's full garbage collections run
# during the batch (``treegen.runtime.collector`` not applied); arriving — not an engine choice: the inputs
# given as an iterator, drawn as the run goes (see measure_dynamic)
@contextlib.contextmanager
def environment(name: str, value: str):
    """The environment variable ``name`` set to ``value`` for the block, then restored."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def replan_fraction(value: float):
    """The scheduler's ``REPLAN_FRACTION`` (read by the scheduler and the decoder) set to ``value`` for the block."""
    with undone(scheduler_module, "REPLAN_FRACTION", value), undone(decode_module, "REPLAN_FRACTION", value):
        yield


VARIANTS = {"default": contextlib.nullcontext, "arriving": contextlib.nullcontext,
            "replan-0.25": lambda: replan_fraction(0.25),
            "replan-0.75": lambda: replan_fraction(0.75), "replan-0.9": lambda: replan_fraction(0.9),
            "fifo": lambda: undone(Scheduler, "priority", lambda self, job: (self._submitted,)),
            "programs-after-phase": lambda: undone(Decoder, "overlap_programs", False),
            "mixed-uncaptured": lambda: environment("TREEGEN_KEEP_MIXED_GRAPHS", "0"),
            "no-phase-joins": lambda: environment("TREEGEN_JOIN_PHASES", "0"),
            "gc-full-collections": lambda: undone(collector, "enabled", False)}


def variant_of(row: dict) -> str:
    """A row's variant; rows from before variants name their admission (before that: arrival order)."""
    if "variant" in row:
        return row["variant"]
    admission = row.get("admission", "fifo")
    return "default" if admission == "priority" else admission


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write(args, rows: list[dict]) -> Path:
    out = Path(args.out or Path(__file__).parent / "results" / f"dynamic_{args.shape}.json")
    if args.update and out.exists():  # rows of other cases from an earlier run, then this run's
        case = lambda r: (r["workload"], r["branches"], variant_of(r))  # noqa: E731
        ran = {case(r) for r in rows}
        rows = [r for r in json.loads(out.read_text())["rows"] if case(r) not in ran] + rows
    result = {"benchmark": "dynamic", "shape": args.shape, "config": SHAPES[args.shape], "dtype": "bfloat16",
              "device": torch.cuda.get_device_name(),
              "date": now(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version()},
              "method": "tokens/s = generated tokens / wall time (prefill and program code included); static = "
                        "the same prefix, one node per program, branches leaves of the workload's mean tokens, "
                        "one execute(); same process, same engine; the dynamic workload is timed on its second "
                        "run (the first, with other inputs of the same sizes, is dynamic_cold_s); with repeats, "
                        "dynamic and static timed alternately, the median run of each reported, ratio of the "
                        "medians (every run's figures in *_runs)",
              "oversubscribe": args.oversubscribe, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
