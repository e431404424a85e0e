"""Where a dynamic workload's host time goes, on the GPU host (diagnostic): a cProfile of one run.

``trace_dynamic.py`` says *when* the GPU waits (the torch profiler, which slows every eager operation
it records); this says *what the host does* in a run timed as ``bench_dynamic.py`` times it, under
cProfile only (about 1.3x slower, evenly). The workload runs twice with inputs of the same sizes (the
first compiles and warms, as in bench_dynamic); the second is profiled. Reported: the run's wall time
with and without the profiler (a third, unprofiled run), the functions with the most own time and the
most cumulative time, and the cumulative seconds of the engine's parts named in ``PARTS``; and for the
unprofiled run, the host time of the mixed steps' parts (``MixedParts``).

    python benchmarks/profile_dynamic_host.py --shape tinyllama-1.1b --workload tot --branches 256
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench_dynamic import config_of, one_workload_arguments, workload  # benchmarks/
import treegen.runtime.model as model_module
import treegen.runtime.tree_run as tree_run_module
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.phase_graphs import _fits, _room, bucket

# (file suffix, function): the engine's parts whose cumulative time is reported by name
PARTS = [("mixed_step.py", "_run_step"), ("tree_run.py", "plan_rows"), ("tree_run.py", "_forward"),
         ("scheduler.py", "next_step"), ("decode.py", "phase"), ("decode.py", "draw"), ("decode.py", "_steps"),
         ("decode.py", "_replayer"), ("phase_graphs.py", "load"), ("token_accept.py", "_settle"),
         ("token_accept.py", "_accept"), ("model.py", "forward"), ("phase_io.py", "pick"),
         ("tree_attention.py", "plan_tree_attention"), ("triton_plan.py", "plan_triton"),
         ("batch.py", "run_batch_here"), ("decode.py", "_kept"), ("cuda_graph.py", "capture_cold")]


@contextmanager
def mixed_plan_options(options: dict | None):
    """While in the block, the attention plans of mixed steps (``MixedSteps._run_step``) get these
    ``triton_options`` (e.g. ``{"library": false, "use_tma": false}``); decode phases keep theirs."""
    if not options:
        yield
        return
    plan, step = tree_run_module.plan_tree_attention, tree_run_module.TreeRun._run_step
    inside = [False]

    def planned(**kw):
        if inside[0] and kw.get("backend") == "triton":
            kw["triton_options"] = {**(kw.get("triton_options") or {}), **options}
        return plan(**kw)

    def run_step(self, s):
        inside[0] = True
        try:
            return step(self, s)
        finally:
            inside[0] = False

    tree_run_module.plan_tree_attention, tree_run_module.TreeRun._run_step = planned, run_step
    try:
        yield
    finally:
        tree_run_module.plan_tree_attention, tree_run_module.TreeRun._run_step = plan, step


def timed_wrap(owner, name: str, record, saved: list, active=None, marks=None) -> None:
    """Replace ``owner.name`` by a timed wrapper: timed while ``active[0]`` (None: always), ``record(seconds,
    result)`` after each call, ``marks[0]`` true during it; what :func:`restore` needs goes on ``saved``."""
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        if active is not None and not active[0]:
            return fn(*a, **kw)
        if marks is not None:
            marks[0] = True
        t0 = time.perf_counter()
        try:
            out = fn(*a, **kw)
        finally:
            if marks is not None:
                marks[0] = False
        record(time.perf_counter() - t0, out)
        return out

    saved.append((owner, name, fn, name in vars(owner)))  # (not its own: a base class's, put back by deleting)
    setattr(owner, name, wrapper)


def restore(saved: list) -> None:
    """Put back what :func:`timed_wrap` replaced, the last first."""
    for owner, name, fn, own in reversed(saved):
        if own:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)
    saved.clear()


class MixedParts:
    """Host seconds of the mixed steps' parts (``MixedSteps._run_step``) while in the block: planning
    (``plan_rows``), launching the forward (``model.forward``, returning before the device is done), drawing
    (``Decoder.draw``: the tokens read back), and the step whole; within the forward, its calls of tree
    attention, of ``F.linear`` and of the fused norm / RoPE / SiLU kernels (``in_forward``); and the plans'
    launches per attention call, and how many had a library segment."""

    IN_FORWARD = ("attention", "linear", "add_rms_norm", "rope_", "silu_mul")

    def __init__(self) -> None:
        self.s = {"plan_rows": 0.0, "forward_launch": 0.0, "draw": 0.0, "whole": 0.0}
        self.in_forward = {k: [0, 0.0] for k in self.IN_FORWARD}  # part -> [calls, seconds]
        self.steps = self.plans = self.library_plans = self.launches = 0
        self.keys: list = []  # per mixed step's plan: (rows bucketed, the plan's shape key, its tables' sizes)
        self._saved: list = []

    def __enter__(self):
        from treegen.runtime.decode import Decoder
        parts, inside, in_forward = self, [False], [False]

        def wrap(owner, name, active, record, marks=None):
            timed_wrap(owner, name, record, self._saved, active, marks)

        def add(key):
            def record(seconds, _):
                parts.s[key] += seconds
            return record

        def plan_rows(seconds, out):
            parts.s["plan_rows"] += seconds
            plan = out[2].by_window[next(iter(out[2].by_window))]
            if plan.triton is not None:
                parts.plans += 1
                parts.launches += len(plan.triton.launches) + (not plan.triton.fused_merge)
                parts.library_plans += plan.triton.library is not None
                parts.keys.append((bucket(out[0].numel()), out[2].shape_key(), out[2].sizes()))

        def step(seconds, _):
            parts.s["whole"] += seconds
            parts.steps += 1

        def piece(key):
            def record(seconds, _):
                parts.in_forward[key][0] += 1
                parts.in_forward[key][1] += seconds
            return record

        wrap(tree_run_module.TreeRun, "_run_step", None, step, marks=inside)
        wrap(tree_run_module.TreeRun, "plan_rows", inside, plan_rows)
        wrap(LlamaFamilyModel, "forward", inside, add("forward_launch"), marks=in_forward)
        wrap(tree_run_module, "tree_attention", in_forward, piece("attention"))
        wrap(model_module.F, "linear", in_forward, piece("linear"))
        for name in ("add_rms_norm", "rope_", "silu_mul"):
            wrap(model_module, name, in_forward, piece(name))
        wrap(Decoder, "draw", inside, add("draw"))
        return self

    def __exit__(self, *exc) -> None:
        restore(self._saved)

    def reuse(self) -> dict:
        """Had each mixed step's forward been captured and kept as decode phases' are (``phase_graphs``: tables
        padded half again), how many of them would have replayed an earlier one: same rows bucket and shape
        key, tables within the kept capacity."""
        def replays(at_sighting: int) -> tuple[int, int]:
            """(replays, captures) when a shape is captured at its ``at_sighting``-th mixed step (earlier ones
            run uncaptured)."""
            kept: dict = {}
            seen: dict = {}
            hits = captures = 0
            for rows, key, sizes in self.keys:
                if key is None:
                    continue
                found = next((cap for cap in kept.get((rows, key), []) if _fits(cap, sizes)), None)
                if found is not None:
                    hits += 1
                    continue
                seen[rows, key] = seen.get((rows, key), 0) + 1
                if seen[rows, key] >= at_sighting:
                    kept.setdefault((rows, key), []).append(_room(sizes))
                    captures += 1
            return hits, captures

        first, second = replays(1), replays(2)
        return {"mixed_plans": len(self.keys), "paddable": sum(k is not None for _, k, _ in self.keys),
                "would_replay": first[0], "would_capture": first[1],
                "capturing_at_second_sighting": {"would_replay": second[0], "would_capture": second[1]},
                "rows_buckets": sorted({r for r, _, _ in self.keys})}

    def as_dict(self) -> dict:
        n = max(1, self.steps)
        inside = {f"{k}_ms": round(1e3 * sec / n, 2) for k, (_, sec) in self.in_forward.items()}
        inside["calls_per_step"] = {k: round(c / n, 1) for k, (c, _) in self.in_forward.items()}
        inside["other_ms"] = round(1e3 * (self.s["forward_launch"] - sum(sec for _, sec in self.in_forward.values())) / n, 2)
        return {"steps": self.steps, **{f"{k}_ms": round(1e3 * v / n, 2) for k, v in self.s.items()},
                "in_forward": inside,
                "launches_per_attention_call": round(self.launches / max(1, self.plans), 2),
                "plans_with_library": f"{self.library_plans}/{self.plans}", **self.reuse()}


class Timed:
    """Host seconds and calls of the functions named ``module.Class.method`` (or ``module.function``) while in
    the block, wrapped by a timer only (no profiler): e.g. the scheduler's parts in a run timed as bench_dynamic
    times it. A call inside another timed one counts in both."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.s = {n: [0, 0.0] for n in names}
        self._saved: list = []

    def __enter__(self):
        import importlib

        for name in self.names:
            parts = name.split(".")
            for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
                try:
                    owner = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            else:
                raise ValueError(f"--time {name}: no importable module in it")
            for attr in parts[cut:-1]:
                owner = getattr(owner, attr)
            timed_wrap(owner, parts[-1], self._record(name), self._saved)
        return self

    def _record(self, name: str):
        def record(seconds, _):
            self.s[name][0] += 1
            self.s[name][1] += seconds
        return record

    def __exit__(self, *exc) -> None:
        restore(self._saved)

    def as_dict(self) -> dict:
        return {n: {"calls": c, "ms": round(1e3 * sec, 2), "ms_per_call": round(1e3 * sec / max(1, c), 3)}
                for n, (c, sec) in self.s.items()}


def run_once(engine: Engine, kind: str, programs: int, width: int, seed: int, profile: cProfile.Profile | None):
    prog, inputs, _ = workload(kind, programs, width, engine.model.vocab_size, seed=seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    roots = prog.run_batch(engine, inputs)
    torch.cuda.synchronize()
    if profile is not None:
        profile.disable()
    return time.perf_counter() - start, roots[0]._run.tree_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_workload_arguments(parser)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--mixed-options", type=json.loads, default=None,
                        help='JSON triton_options for the plans of mixed steps, e.g. \'{"library": false}\'')
    parser.add_argument("--time", nargs="*", default=[], metavar="MODULE.CLASS.METHOD",
                        help="functions timed (calls, ms) in the unprofiled run, e.g. "
                             "treegen.runtime.scheduler.Scheduler._admit")
    parser.add_argument("--callees", nargs="*", default=[], metavar="FILE:FUNCTION",
                        help="print the profiled callees of these (pstats restrictions, e.g. scheduler.py:351, the admission)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaFamilyModel.random(config_of(args.shape), dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, IdTokenizer(), max_batch=args.branches)
    programs = args.oversubscribe * args.branches // args.width
    profile = cProfile.Profile()
    with mixed_plan_options(args.mixed_options):
        run_once(engine, args.workload, programs, args.width, seed=1, profile=None)  # compile, warm
        with MixedParts() as mixed_parts, Timed(args.time) as timed:
            plain_s, plain_run = run_once(engine, args.workload, programs, args.width, seed=0, profile=None)
        profiled_s, tree_run = run_once(engine, args.workload, programs, args.width, seed=0, profile=profile)
    plain_mixed_ms = 1e3 * plain_run.mixed_seconds / max(1, plain_run.mixed_steps)
    stats = pstats.Stats(profile)
    parts = {}
    for (file, _, name), (_, calls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        for suffix, want in PARTS:
            if name == want and file.endswith(suffix):
                key = f"{suffix}:{want}"
                parts[key] = {"calls": parts.get(key, {}).get("calls", 0) + calls,
                              "s": round(parts.get(key, {}).get("s", 0) + cum, 4)}
    listings = {}
    for order in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(profile, stream=s).sort_stats(order).print_stats(args.top)
        listings[order] = s.getvalue()
        print(s.getvalue())
    callees = {}
    for want in args.callees:
        s = io.StringIO()
        pstats.Stats(profile, stream=s).sort_stats("cumtime").print_callees(want)
        callees[want] = s.getvalue()
        print(s.getvalue())
    row = {"benchmark": "profile_dynamic_host", "shape": args.shape, "workload": args.workload,
           "branches": args.branches, "programs": programs, "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "mixed_options": args.mixed_options, "run_s": plain_s, "profiled_s": profiled_s,
           "unprofiled_mixed_step_ms": round(plain_mixed_ms, 2), "unprofiled_mixed_parts": mixed_parts.as_dict(),
           "unprofiled_timed": timed.as_dict(), "callees": callees,
           "forward_passes": tree_run.forward_passes, "mixed_steps": tree_run.mixed_steps,
           "mixed_step_ms": round(1e3 * tree_run.mixed_seconds / max(1, tree_run.mixed_steps), 2),
           "decode_phases": len(tree_run.decode_phases),
           "host_ms": {k: round(1e3 * v, 1) for k, v in tree_run.host_seconds.items()},
           "parts_s": dict(sorted(parts.items(), key=lambda kv: -kv[1]["s"])), "listings": listings,
           # every function: [file:line(name), primitive calls, own s, cumulative s], most cumulative first
           "functions": sorted(([f"{f}:{line}({name})", calls, round(own, 5), round(cum, 5)]
                                for (f, line, name), (calls, _, own, cum, _) in stats.stats.items()),  # type: ignore
                               key=lambda r: -r[3])}
    print(json.dumps({k: v for k, v in row.items() if k not in ("listings", "functions")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
