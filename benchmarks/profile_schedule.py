"""Where a dynamic workload's scheduling calls spend their host time, on the GPU host (diagnostic).

``bench_dynamic.py`` reports ``schedule_ms_per_call``: the host time of each ``Scheduler.next_step``
(admission, eviction, offload / restore copies' issue, compaction). Scheduling runs between decode
phases, so while it runs the GPU may have nothing queued. This runs one of bench_dynamic's workloads
(random weights of a real shape, bf16) twice — the first warms up and fills the engine's host arena,
the second is measured — and for the measured one records, per scheduling call: its wall time, whether
the GPU's queue was already empty when it began (``gpu_idle_at_start``: ``torch.cuda.Stream.query``),
the nodes it offloaded, restored and dropped, the compactions it ran, the time inside
``KVStore.offload`` / ``restore`` / ``ensure_free`` (offload and restore also until the device has done
their copies, ``*_done_ms``: the profile synchronizes after each), and each compaction's room asked, free
slots (and in how many spans), written slots, slots moved, host time and time until the device has done
it (synchronized around it). The calls run under cProfile
(only they): the functions with the most own time, and the most cumulative time, are listed.

    python benchmarks/profile_schedule.py --shape llama3-8b --workload tot --branches 1024
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import time
from pathlib import Path

import torch

from bench_dynamic import config_of, one_workload_arguments, workload  # benchmarks/
from treegen.runtime.engine import Engine
from treegen.runtime.kv_store import KVStore
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.scheduler import Scheduler

TIMED = ("offload", "restore", "ensure_free", "drop")
SYNCED = ("offload", "restore")  # timed until the device has done them too (the profile synchronizes after each)


class CallLog:
    """Wraps ``Scheduler.next_step`` and the KV store's copy methods while active."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.profile = cProfile.Profile()
        self._current: dict | None = None
        self._saved: list[tuple[type, str, object]] = []

    def __enter__(self) -> "CallLog":
        log = self
        step = Scheduler.next_step

        def next_step(sched, live, reading=()):
            idle = torch.cuda.current_stream().query()
            kv = sched.kv
            before = (kv.compactions, kv.counters.nodes_offloaded, kv.counters.nodes_restored,
                      kv.counters.nodes_dropped)
            log._current = {"live": live, "waiting": len(sched.waiting), "gpu_idle_at_start": idle,
                            **{f"{name}_ms": 0.0 for name in TIMED}}
            t0 = time.perf_counter()
            log.profile.enable()
            try:
                return step(sched, live, reading)
            finally:
                log.profile.disable()
                call = log._current
                call["ms"] = 1e3 * (time.perf_counter() - t0)
                after = (kv.compactions, kv.counters.nodes_offloaded, kv.counters.nodes_restored,
                         kv.counters.nodes_dropped)
                for key, a, b in zip(("compactions", "offloaded", "restored", "dropped"), after, before):
                    call[key] = a - b
                log.calls.append(call)
                log._current = None

        self._patch(Scheduler, "next_step", next_step)
        for name in TIMED:
            self._patch(KVStore, name, self._timed(name, getattr(KVStore, name)))
        compact = KVStore._compact

        def described(kv, chunk=None, room=None):  # what each compaction was asked and what it moved
            spans, moved = kv.free_spans, kv.slots_moved
            what = {"room": room, "free": spans.total, "free_spans": len(spans.by_start),
                    "largest_free": spans.largest(), "slots": kv.num_slots, "segments": len(kv.segments),
                    "written": sum(seg.computed for seg in kv.segments.values())}
            torch.cuda.synchronize()  # (the device's own time too: what was queued before runs first)
            t0 = time.perf_counter()
            compact(kv, chunk, room)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            what.update(moved=kv.slots_moved - moved, ms=1e3 * (t1 - t0), ms_until_done=1e3 * (time.perf_counter() - t0))
            if log._current is not None:
                log._current.setdefault("compactions_seen", []).append(what)
        self._patch(KVStore, "_compact", described)
        return self

    def _timed(self, name: str, fn):
        log = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if log._current is not None:
                    log._current[f"{name}_ms"] += 1e3 * (time.perf_counter() - t0)
                    if name in SYNCED:  # and until the device has done its copies
                        torch.cuda.synchronize()
                        log._current[f"{name}_done_ms"] = (log._current.get(f"{name}_done_ms", 0.0)
                                                           + 1e3 * (time.perf_counter() - t0))
        return timed

    def _patch(self, owner: type, name: str, fn) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)

    def top(self, key: str, n: int) -> list[str]:
        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats(key).print_stats(n)
        lines = out.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        return [line.rstrip() for line in lines[start:] if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_workload_arguments(parser, shape="llama3-8b", branches=1024)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_schedule.py profiles a GPU host: no CUDA device here")

    model = LlamaFamilyModel.random(config_of(args.shape), dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, IdTokenizer(), max_batch=args.branches)
    programs = args.oversubscribe * args.branches // args.width
    prog, inputs, _ = workload(args.workload, programs, args.width, model.vocab_size)
    t0 = time.perf_counter()
    prog.run_batch(engine, workload(args.workload, programs, args.width, model.vocab_size, seed=1)[1])
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    with CallLog() as log:
        t0 = time.perf_counter()
        roots = prog.run_batch(engine, inputs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    tree_run = roots[0]._run.tree_run
    calls = log.calls
    busy = [c for c in calls if c["offloaded"] or c["restored"] or c["compactions"] or c["dropped"]]
    summary = {
        "calls": len(calls), "calls_moving_kv": len(busy),
        "total_ms": sum(c["ms"] for c in calls),
        "total_ms_moving_kv": sum(c["ms"] for c in busy),
        **{f"total_{name}_ms": sum(c[f"{name}_ms"] for c in calls) for name in TIMED},
        **{f"total_{name}_done_ms": sum(c.get(f"{name}_done_ms", 0.0) for c in calls) for name in SYNCED},
        "total_compaction_ms": sum(x["ms"] for c in calls for x in c.get("compactions_seen", ())),
        "slots_moved": sum(x["moved"] for c in calls for x in c.get("compactions_seen", ())),
        "total_compaction_done_ms": sum(x["ms_until_done"] for c in calls for x in c.get("compactions_seen", ())),
        "calls_gpu_idle_at_start": sum(c["gpu_idle_at_start"] for c in calls),
    }
    result = {
        "benchmark": "profile_schedule", "shape": args.shape, "workload": args.workload,
        "branches": args.branches, "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "warm_up_s": warm, "run_s": elapsed, "forward_passes": tree_run.forward_passes,
        "offload": tree_run.offload_stats, "summary": summary,
        "slowest_calls": sorted(calls, key=lambda c: -c["ms"])[:25],
        "top_tottime": log.top("tottime", args.top), "top_cumtime": log.top("cumulative", args.top),
    }
    print(json.dumps({k: result[k] for k in ("run_s", "forward_passes", "summary")}, indent=1))
    for line in result["top_tottime"][:30]:
        print(line)
    out = Path(args.out or Path(__file__).parent / "results" /
               f"profile_schedule_{args.shape}_{args.workload}_{args.branches}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
