"""Where a dynamic workload's GPU waits: its idle time attributed to what the host was doing.

Runs one workload of ``bench_dynamic.py`` (warm-up run first, same sizes, other inputs) under the
PyTorch profiler, with the engine loop's host work marked (``record_function`` ranges wrapped around
the methods listed in ``MARKED``, by this script only). The GPU's busy time is the union of its kernels
and copies; every gap between them is idle, and each instant of a gap is charged to the innermost
marked range the host was in then ("unmarked": none; program code is split by whether a decode phase
was running: ``programs_in_phase``, ``programs_between``). Reported: wall time, busy fraction, idle ms
by range, the gaps by size, the host's time in each range, and the longest gaps each with the host events inside.
GPU time by kernel name (the most costly); with ``--static`` the same token work as one static fork is traced too,
for the GPU time a forward pass takes in each (a dynamic pass may cost more: a deeper tree, padded phases,
mixed steps' prefill rows).
Python's garbage collections are ranges too (``gc0``/``gc1``: young, ``gc2``: full).

The profiler slows the host (every operator is recorded): the traced run is slower than an untraced
one; what it shows is where the gaps are, not their exact size.

    python benchmarks/trace_dynamic.py --workload tot --branches 256 --out trace.json [--chrome trace.gz]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gc
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_dynamic import VARIANTS, measure_static, now, one_workload_arguments, workload  # benchmarks/
from bench_end_to_end import config_of
from treegen.lang.batch import Cooperative
from treegen.lang.program_run import ProgramRun
from treegen.runtime import decode, kv_store, phase_graphs, phase_io, tree_run
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.scheduler import Scheduler

# (owner, method) -> the range it is marked as
MARKED = {
    (Scheduler, "next_step"): "schedule",
    (Scheduler, "phase_should_end"): "schedule",
    (tree_run.TreeRun, "plan_rows"): "plan_rows",
    (tree_run.TreeRun, "_run_step"): "mixed_step",
    (decode.Decoder, "draw"): "draw",
    (decode.Decoder, "_settle"): "settle",
    (phase_io.TokenBlock, "read"): "wait_tokens",
    (decode.Decoder, "capture_graph"): "capture",
    (phase_graphs.PhaseBuffers, "load"): "kept_load",
    (phase_io.RowSampling, "__init__"): "params",
    (Cooperative, "_resume"): "programs",
    (tree_run.TreeRun, "complete"): "complete",
    (tree_run.TreeRun, "advance"): "advance",  # (the engine loop's own code: what no inner range marks)
    (tree_run.TreeRun, "free"): "free",
    (kv_store.KVStore, "free"): "free",
    (tree_run.TreeRun, "attend_fn"): "attend_fn",
    (decode.Decoder, "_kept"): "kept_lookup",
    (decode.Decoder, "decode_rows"): "decode_rows",
    (phase_io.TokenBlock, "__init__"): "block_copy",
    (ProgramRun, "submit"): "program_submit",
}
GAP_SIZES_US = (10, 100, 1_000, 10_000)  # the gap histogram's bin edges
LONG_GAPS = 16  # the longest gaps, each with the host events inside it
TOP_KERNELS, KERNEL_NAME_CHARS = 25, 80  # GPU time by kernel: the most costly names, cut this short


@contextlib.contextmanager
def marked():
    saved = {}
    for (owner, name), label in MARKED.items():
        fn = saved[owner, name] = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, _label=label, **kwargs):
            if _label == "programs":  # resumed during a decode phase, or between steps (the GPU has nothing queued)
                _label += "_in_phase" if args[1].tree_run._phase is not None else "_between"
            with record_function(_label):
                return _fn(*args, **kwargs)

        setattr(owner, name, wrapper)
    open_gc: list = []

    def gc_range(phase: str, info: dict) -> None:  # Python's garbage collections: a range of their own
        if phase == "start":
            open_gc.append(record_function(f"gc{info['generation']}"))
            open_gc[-1].__enter__()
        elif open_gc:
            open_gc.pop().__exit__(None, None, None)

    gc.callbacks.append(gc_range)
    try:
        yield
    finally:
        gc.callbacks.remove(gc_range)
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def attribute(gaps: list[tuple[int, int]], ranges: list[tuple[int, int, str]]) -> dict[str, float]:
    """ns of the ``gaps`` by the innermost (shortest) of ``ranges`` covering each instant."""
    ranges = sorted(ranges)
    starts = [r[0] for r in ranges]
    longest = max((e - s for s, e, _ in ranges), default=0)
    charged: dict[str, float] = {}
    for gs, ge in gaps:
        # the ranges that may overlap the gap: started before its end, and not ended before its start
        lo = bisect.bisect_left(starts, gs - longest)
        hi = bisect.bisect_right(starts, ge)
        cover = [(s, e, lab) for s, e, lab in ranges[lo:hi] if e > gs and s < ge]
        cuts = sorted({gs, ge, *(max(gs, s) for s, _, _ in cover), *(min(ge, e) for _, e, _ in cover)})
        for a, b in zip(cuts, cuts[1:]):
            inside = [(e - s, lab) for s, e, lab in cover if s <= a and e >= b]
            lab = min(inside)[1] if inside else "unmarked"
            charged[lab] = charged.get(lab, 0.0) + (b - a)
    return charged


def analyse(prof) -> dict:
    events = prof.profiler.kineto_results.events()
    gpu, ranges = [], []
    labels = set(MARKED.values()) | {"programs_in_phase", "programs_between", "gc0", "gc1", "gc2"}
    host = []  # every other host event: (start, end, name, thread), to say what the host did in long gaps
    by_kernel: dict[str, float] = {}  # GPU ms per kernel (or copy) name
    for e in events:
        kind = str(e.device_type())
        if "CUDA" in kind and e.name() in labels:
            continue  # (a marked range's mirror on the GPU's timeline, spanning what ran inside it: not work)
        if "CUDA" in kind and e.duration_ns() > 0:
            gpu.append((e.start_ns(), e.end_ns()))
            name = e.name()[:KERNEL_NAME_CHARS]
            by_kernel[name] = by_kernel.get(name, 0.0) + e.duration_ns() / 1e6
        elif e.name() in labels:
            ranges.append((e.start_ns(), e.end_ns(), e.name()))
        elif e.duration_ns() > 0:
            host.append((e.start_ns(), e.end_ns(), e.name(), e.start_thread_id()))
    busy = union(gpu)
    begin, end = busy[0][0], busy[-1][1]
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] > a[1]]
    idle = sum(e - s for s, e in gaps)
    charged = attribute(gaps, ranges)
    histogram = {}
    for s, e in gaps:
        bin_ = next((f"<{b}us" for b in GAP_SIZES_US if e - s < 1000 * b), f">={GAP_SIZES_US[-1]}us")
        n, t = histogram.get(bin_, (0, 0.0))
        histogram[bin_] = (n + 1, t + (e - s) / 1e6)
    long_gaps = []  # the longest gaps: when, what range covered them, the host events inside (by time)
    for gs, ge in sorted(gaps, key=lambda g: g[0] - g[1])[:LONG_GAPS]:
        inside: dict[tuple[str, int], float] = {}
        for s, e, name, thread in host:
            if e > gs and s < ge:
                key = (name, thread)
                inside[key] = inside.get(key, 0.0) + (min(e, ge) - max(s, gs)) / 1e6
        covering = sorted({lab for s, e, lab in ranges if s < ge and e > gs})
        long_gaps.append({"at_ms": round((gs - begin) / 1e6, 2), "ms": round((ge - gs) / 1e6, 2),
                          "ranges": covering, "charged": {k: round(v / 1e6, 2) for k, v in attribute([(gs, ge)], ranges).items()},
                          "host_events": [f"{n} (thread {t}): {ms:.2f} ms" for (n, t), ms in
                                          sorted(inside.items(), key=lambda x: -x[1])[:12]]})
    host_ms = {}
    for s, e, lab in ranges:
        host_ms[lab] = host_ms.get(lab, 0.0) + (e - s) / 1e6
    return {"gpu_span_ms": (end - begin) / 1e6, "gpu_busy_ms": sum(e - s for s, e in busy) / 1e6,
            "gpu_idle_ms": idle / 1e6, "gpu_busy_fraction": 1 - idle / (end - begin),
            "idle_ms_by_host_range": {k: round(v / 1e6, 2) for k, v in sorted(charged.items(), key=lambda x: -x[1])},
            "gaps_by_size": {k: {"count": n, "ms": round(t, 2)} for k, (n, t) in histogram.items()},
            "host_ms_in_range": {k: round(v, 2) for k, v in sorted(host_ms.items(), key=lambda x: -x[1])},
            "gpu_events": len(gpu), "long_gaps": long_gaps,
            "gpu_ms_by_kernel": {k: round(v, 2) for k, v in sorted(by_kernel.items(), key=lambda x: -x[1])[:TOP_KERNELS]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_workload_arguments(parser)
    parser.add_argument("--variant", default="default", choices=list(VARIANTS), help="as bench_dynamic's --variants")
    parser.add_argument("--out", required=True, help="the analysis (JSON)")
    parser.add_argument("--chrome", default=None, help="also the profiler's trace (Chrome trace format)")
    parser.add_argument("--static", action="store_true",
                        help="also trace the same token work as one static fork (bench_dynamic's): GPU ms a pass, by kernel")
    args = parser.parse_args()

    model = LlamaFamilyModel.random(config_of(args.shape), dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, IdTokenizer(), max_batch=args.branches)
    programs = args.oversubscribe * args.branches // args.width
    prog, inputs, total = workload(args.workload, programs, args.width, model.vocab_size)
    with VARIANTS[args.variant]():
        warm = workload(args.workload, programs, args.width, model.vocab_size, seed=1)[1]
        prog.run_batch(engine, warm)
        torch.cuda.synchronize()
        start = time.perf_counter()
        prog.run_batch(engine, workload(args.workload, programs, args.width, model.vocab_size, seed=2)[1])
        torch.cuda.synchronize()
        untraced = time.perf_counter() - start
        with marked(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            roots = prog.run_batch(engine, inputs)
            torch.cuda.synchronize()
            traced = time.perf_counter() - start
    run = roots[0]._run.tree_run
    result = {"benchmark": "trace_dynamic", "shape": args.shape, "workload": args.workload,
              "branches": args.branches, "programs": programs, "variant": args.variant, "device": torch.cuda.get_device_name(),
              "date": now(), "torch": torch.__version__, "untraced_s": untraced, "traced_s": traced,
              "tokens": total, "forward_passes": run.forward_passes, "mixed_steps": run.mixed_steps,
              "decode_phases": len(run.decode_phases),
              "host_ms": {k: round(1e3 * v, 1) for k, v in run.host_seconds.items()}, **analyse(prof)}
    if args.static:  # the same token work as one static fork, traced alike: GPU time per pass and by kernel
        per_branch = round(total / args.branches)
        measure_static(engine, args.branches // args.width, args.width, per_branch)  # (warm: untraced)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            static = measure_static(engine, args.branches // args.width, args.width, per_branch, warm_up=False)
        result["static"] = {**static, **{k: v for k, v in analyse(prof).items() if k != "long_gaps"}}
        for key, part in (("dynamic", result), ("static", result["static"])):
            passes = part.get("forward_passes", part.get("static_steps"))
            print(f"{key}: GPU busy {part['gpu_busy_ms']:.0f} ms over {passes} passes = "
                  f"{part['gpu_busy_ms'] / passes:.3f} ms a pass")
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.chrome:
        prof.export_chrome_trace(args.chrome)


if __name__ == "__main__":
    main()
