"""Host time of tree-attention planning on the plans a dynamic workload makes, against the loop planner.

Replays one of ``bench_dynamic``'s workloads on the CPU with a tiny model (``dynamic_schedule_cpu.py``),
records the arguments of every ``plan_tree_attention`` call the engine makes (decode phases and mixed
steps), then plans each of them again for the Triton backend on the CPU, in the same process: with the
planner (``row_paths`` + ``plan_triton``: numpy over all segments) and with the loop planner it replaced
(``tests/triton_plan_reference.py``), both producing the same tables. The heap is frozen first
(``gc.freeze``): the engine runs with full collections paused (``treegen.runtime.collector``), and a
frozen heap keeps young collections from charging the recorded plans' objects to either planner.
Reported: milliseconds per plan (mean, and the largest plans by rows and segments), the total, and the
ratio.

    python benchmarks/bench_planning.py --branches 1024
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import treegen.runtime.tree_run as tree_run
from treegen.kernels.row_paths import row_paths
from treegen.kernels.triton_plan import plan_triton
import dynamic_schedule_cpu  # benchmarks/

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from triton_plan_reference import reference_paths, reference_plan_triton  # noqa: E402

HEADS, KV_HEADS = 32, 4  # TinyLlama's: the group size sets the tiles


def record(workload: str, branches: int) -> list[dict]:
    """The arguments of every plan the replayed workload makes (sequences copied)."""
    calls = []
    planner = tree_run.plan_tree_attention

    def recording(**kw):
        calls.append({k: list(v) if isinstance(v, list) else v for k, v in kw.items()
                      if k in ("segment_parent", "segment_start", "segment_len", "segment_pos", "query_segment",
                               "query_pos", "window")})
        return planner(**kw)

    tree_run.plan_tree_attention = recording
    try:
        dynamic_schedule_cpu.replay(workload, branches, 4, 3)
    finally:
        tree_run.plan_tree_attention = planner
    return calls


def plan_now(kw: dict):
    paths = row_paths(kw["segment_parent"], kw["query_segment"], query_pos=kw["query_pos"],
                      segment_pos=kw["segment_pos"], segment_len=kw["segment_len"], window=kw["window"])
    return plan_triton(segment_start=kw["segment_start"], segment_len=kw["segment_len"], segment_pos=kw["segment_pos"],
                       paths=paths, num_kv_heads=KV_HEADS, group=HEADS // KV_HEADS, device="cpu")


def plan_loops(kw: dict):
    rows_of, paths, local = reference_paths(kw["segment_parent"], kw["segment_pos"], kw["segment_len"],
                                            kw["query_segment"], kw["query_pos"], kw["window"])
    return reference_plan_triton(segment_start=kw["segment_start"], segment_len=kw["segment_len"],
                                 segment_pos=kw["segment_pos"], rows_of=rows_of, paths=paths, path_local=local,
                                 num_kv_heads=KV_HEADS, group=HEADS // KV_HEADS, device="cpu")


def timed(fn, kw: dict, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn(kw)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["rounds", "rounds-equal", "tot"], default="tot")
    parser.add_argument("--branches", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    calls = record(args.workload, args.branches)
    gc.collect()
    gc.freeze()
    rows = []
    for kw in calls:
        a, b = plan_now(kw), plan_loops(kw)
        # (a packed launch holds the loop planner's items regrouped several to a program, then empty ones)
        if not (torch.equal(a.merge_idx, b.merge_idx) and a.leaf_tail == b.leaf_tail
                and all(torch.equal(x.work.reshape(-1, 7)[:len(y.work)], y.work) for x, y in zip(a.launches, b.launches))):
            raise AssertionError("the planners disagree on a recorded plan")
        rows.append({"rows": len(kw["query_segment"]), "segments": len(kw["segment_parent"]),
                     "numpy_ms": 1e3 * timed(plan_now, kw, args.repeats),
                     "loops_ms": 1e3 * timed(plan_loops, kw, args.repeats)})
    total_now, total_loops = sum(r["numpy_ms"] for r in rows), sum(r["loops_ms"] for r in rows)
    largest = sorted(rows, key=lambda r: -r["loops_ms"])[:8]
    print(f"{len(rows)} plans: numpy {total_now:.1f} ms, loops {total_loops:.1f} ms "
          f"({total_loops / total_now:.1f}x); mean {total_now / len(rows):.2f} vs {total_loops / len(rows):.2f} ms")
    for r in largest:
        print(f"  {r['rows']} rows, {r['segments']} segments: {r['numpy_ms']:.2f} vs {r['loops_ms']:.2f} ms")
    out = Path(args.out or Path(__file__).parent / "results" / f"planning_cpu_{args.workload}_{args.branches}.json")
    out.write_text(json.dumps({
        "benchmark": "bench_planning", "device": "cpu", "workload": args.workload, "branches": args.branches,
        "heads": HEADS, "kv_heads": KV_HEADS,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()},
        "plans": len(rows), "numpy_ms_total": round(total_now, 2), "loops_ms_total": round(total_loops, 2),
        "ratio": round(total_loops / total_now, 2), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
