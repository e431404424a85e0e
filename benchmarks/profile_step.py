"""Where a decode step's GPU time goes: the kernels of N completions of one shared prompt, per step.

Runs the end-to-end workload of ``bench_end_to_end.py`` (one shared prefix, ``batch`` branches of
``new`` tokens, random weights of a named shape) under ``torch.profiler`` for each mode (``tree``: the
engine as it is; ``none``: attention skipped, the ceiling), and reports each kernel's GPU time per
decode step (its total over the run less a one-token run's, divided by ``new - 1`` steps), largest
first, with the difference between the modes by kernel. The decode steps replay CUDA graphs; the
profiler sees their kernels one by one (``--no-graphs``: launched eagerly instead).

    python benchmarks/profile_step.py --shape phi-4-mini --batch 256 --prefix 2048

Tensor parallel: ``NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N benchmarks/profile_step.py --tp N ...``
profiles rank 0's kernels (every rank runs the same steps; the LM head split by vocabulary).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
from torch.profiler import ProfilerActivity, profile

from treegen.kernels import tree_attention as planning
from treegen.kernels.launch import Launcher
from treegen.runtime.distributed import init_parallel
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from bench_end_to_end import SHAPES, config_of, timed_run  # benchmarks/


def kernel_times(engine: Engine, batch: int, prompt: list[int], new: int) -> dict[str, tuple[float, int]]:
    """GPU microseconds and launches of each kernel (by short name) in one run of ``new`` tokens."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)
        torch.cuda.synchronize()
    times: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    for event in kernels:
        times[short(event.name)][0] += event.device_time
        times[short(event.name)][1] += 1
    global last_sequence
    last_sequence = one_step(kernels)
    return {name: (us, n) for name, (us, n) in times.items()}


last_sequence: list = []  # the kernels of one decode step of the last profiled run, in launch order


def one_step(kernels: list) -> list[tuple[str, float]]:
    """The kernels of a decode step in the middle of the run: those between two launches of the kernel
    launched once a step (the sampler's), as (name, us) in order; [] if there is none."""
    counts = collections.Counter(short(e.name) for e in kernels)
    marks = [name for name, n in counts.items() if "gumbel_partial" in name or "argmax" in name]
    if not marks:
        return []
    at = [i for i, e in enumerate(kernels) if short(e.name) == marks[0]]
    if len(at) < 3:
        return []
    middle = len(at) // 2
    return [(short(e.name), e.device_time) for e in kernels[at[middle] + 1: at[middle + 1] + 1]]


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (one row per kernel)."""
    name = re.sub(r"\(.*$", "", name)
    name = re.sub(r"<.*>", "<>", name)
    return name[:90]


def per_step(engine: Engine, batch: int, prompt: list[int], new: int) -> dict[str, dict]:
    """Each kernel's GPU microseconds and launches per decode step (a ``new``-token run less a 1-token one)."""
    timed_run(engine, batch=batch, prompt=prompt, new=8, flat=False)  # compile, capture
    one = kernel_times(engine, batch, prompt, 1)
    many = kernel_times(engine, batch, prompt, new)
    steps = new - 1
    out = {}
    for name, (us, n) in many.items():
        us1, n1 = one.get(name, (0.0, 0))
        if n - n1 > 0:
            out[name] = {"us": (us - us1) / steps, "launches": (n - n1) / steps}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def wall_per_step(engine: Engine, batch: int, prompt: list[int], new: int) -> float:
    """Wall microseconds per decode step without the profiler: a ``new``-token run less a 1-token one (best of 3)."""
    one = min(timed_run(engine, batch=batch, prompt=prompt, new=1, flat=False)[0] for _ in range(3))
    many = min(timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)[0] for _ in range(3))
    return (many - one) / (new - 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="phi-4-mini")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--modes", nargs="+", default=["tree", "none"], choices=["tree", "none"])
    parser.add_argument("--no-graphs", action="store_true", help="decode steps launched eagerly")
    parser.add_argument("--no-library", action="store_true", help="every segment to the Triton kernels (no cuDNN)")
    parser.add_argument("--plan", nargs="*", default=[], metavar="KEY=INT",
                        help="plan_triton knobs for the run (e.g. target_programs=132), an experiment")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="the KV cache's format (auto: the model's dtype)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sequence", type=int, default=0, help="print this many kernels of one decode step, in order")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel over N GPUs (under torchrun)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.new < 2:
        parser.error(f"--new must be at least 2 (steps are a run of NEW tokens less a 1-token run), got {args.new}")

    if args.no_library:
        planning.library_available = lambda device, dtype: False
    if args.plan:
        knobs = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.plan)}
        planning.plan_triton = functools.partial(planning.plan_triton, **knobs)
    config = config_of(args.shape)
    parallel = init_parallel(tensor_parallel=args.tp, device="cuda", timeout_s=1800, vocab_parallel=True) \
        if args.tp > 1 else None
    if parallel is not None and parallel.rank != 0:  # every rank profiles its own kernels; rank 0 reports
        sys.stdout = open(os.devnull, "w")
    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device=parallel.device if parallel else "cuda",
                                    tp=parallel.tensor if parallel else None)
    prompt = torch.randint(0, model.vocab_size, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    modes, sequences, walls, idle = {}, {}, {}, {}
    for mode in args.modes:
        engine = Engine(model, IdTokenizer(), attention=mode, parallel=parallel,
                        kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype)
        if args.no_graphs:
            engine.cuda_graphs = False
        modes[mode] = per_step(engine, args.batch, prompt, args.new)
        walls[mode] = wall_per_step(engine, args.batch, prompt, args.new)
        total = sum(k["us"] for k in modes[mode].values())
        idle[mode] = walls[mode] - total
        print(f"\n## {args.shape} {mode}, batch {args.batch}, prefix {args.prefix}, KV {args.kv_dtype}: {total:.0f} us of "
              f"kernels per decode step, {walls[mode]:.0f} us wall (unprofiled): {idle[mode]:.0f} us between kernels\n")
        print("| kernel | us / step | launches / step |\n|---|---|---|")
        for name, k in list(modes[mode].items())[: args.top]:
            print(f"| {name} | {k['us']:.1f} | {k['launches']:.0f} |")
        sequences[mode] = last_sequence
        if args.sequence:
            print(f"\nthe first {args.sequence} kernels of a decode step (of {len(last_sequence)}):")
            for name, us in last_sequence[: args.sequence]:
                print(f"  {us:8.1f} us  {name}")
    if {"tree", "none"} <= modes.keys():
        names = set(modes["tree"]) | set(modes["none"])
        diff = {n: modes["tree"].get(n, {"us": 0.0})["us"] - modes["none"].get(n, {"us": 0.0})["us"] for n in names}
        print(f"\n## tree - none by kernel: {sum(diff.values()):.0f} us per step (and {idle['tree'] - idle['none']:+.0f} us "
              f"between kernels)\n")
        print("| kernel | us / step |\n|---|---|")
        for name, us in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
            print(f"| {name} | {us:+.1f} |")
    out = Path(args.out or Path(__file__).parent / "results" / f"profile_step_{args.shape}_{args.batch}"
                                                                 f"{'' if args.kv_dtype == 'auto' else '_' + args.kv_dtype}"
                                                                 f"{'' if args.tp == 1 else f'_tp{args.tp}'}.json")
    if parallel is not None:
        torch.distributed.barrier()
        if parallel.rank != 0:
            torch.distributed.destroy_process_group()
            return
    out.write_text(json.dumps({
        "benchmark": "profile_step", "shape": args.shape, "batch": args.batch, "prefix": args.prefix,
        "new": args.new, "kv_dtype": args.kv_dtype, "tp": args.tp, "wall_us_per_step": walls,
        # wall less the profiled kernels' sum: the GPU between kernels (launch gaps, dependencies), an estimate
        # (the kernels are timed in a profiled run of their own)
        "idle_us_per_step": idle, "cuda_graphs": not args.no_graphs, "library": not args.no_library, "plan": args.plan, "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "method": "torch.profiler CUDA kernel times of a NEW-token run less a 1-token run, per decode step",
        "modes": modes, "one_step": sequences}, indent=1))
    print(f"wrote {out}")
    for launcher in Launcher.every:  # registers and spills of each attention kernel variant compiled
        for key, kernel in launcher.compiled.items():
            shown = {k: v for k, v in key[2] if k in ("GROUP", "BLOCK_M", "BLOCK_N", "FUSE_MERGE", "MERGE_J",
                                                      "LIB_BY_ROW", "HAS_LIB", "LIB_TAIL", "PACK", "num_warps",
                                                      "num_stages")}
            if shown:
                print(f"{getattr(launcher.kernel, '__name__', '?')}: regs {getattr(kernel, 'n_regs', '?')} "
                      f"spills {getattr(kernel, 'n_spills', '?')} {shown}")
    if parallel is not None:
        torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
