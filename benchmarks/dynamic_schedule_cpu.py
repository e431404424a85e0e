"""The scheduling of bench_dynamic's workloads, replayed on the CPU with a tiny random model.

How many forward passes a dynamic workload takes, and how full they are, depends on the scheduler and
the programs, not on the model's speed: ``max_tokens`` fixes every gen's length (EOS ignored), so a
one-layer model of 64 hidden units on the CPU takes the same decisions as TinyLlama on a GPU (up to the
thoughts ``tot`` keeps, which follow the model's log-probabilities, and phase ends that new work's
arrival decides). Reported: forward passes against the ideal (generated tokens / branches), mixed
steps, decode phases with their rows and passes, the *tail* (passes of phases below 90% of the batch:
the last programs' dependent levels, which the static fork has not), and the row occupancy of phases
(generated tokens / rows the phases computed: a finished branch's row computes until its phase ends;
a gen's first token, drawn in a mixed step, is counted too, so it reads a little high). With
``--replan-fraction`` the scheduler's ``REPLAN_FRACTION`` is replaced for the run; ``--variant fifo``
admits waiting work in arrival order (the order before the scheduler's priorities; see bench_dynamic's
``VARIANTS``). With ``--kv-budget-mb`` the engine's KV budget is that small, so admission waits for memory
and evicts idle KV as a large model's run does on a GPU (reported: ``offload``, the bytes moved and
nodes dropped, and ``memory_waits``; the host time of the copies themselves is a GPU's to measure). With
``--arriving N`` the inputs are an iterator drawn as the run goes (:mod:`treegen.lang.arrivals`), programs
started while fewer than N x max_batch branches decode or wait.

    python benchmarks/dynamic_schedule_cpu.py --workload tot --branches 256
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig

import treegen.lang.batch as batch
import treegen.runtime.decode as decode
import treegen.runtime.scheduler as scheduler
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from bench_dynamic import VARIANTS, workload  # benchmarks/


def replay(kind: str, branches: int, width: int, oversubscribe: int, kv_budget_bytes: int | None = None,
           arriving: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu")
    engine = Engine(model, IdTokenizer(), max_batch=branches, kv_budget_bytes=kv_budget_bytes)
    prog, inputs, total = workload(kind, oversubscribe * branches // width, width, cfg.vocab_size)
    start = time.perf_counter()
    roots = prog.run_batch(engine, iter(inputs) if arriving else inputs)
    elapsed = time.perf_counter() - start
    run = roots[0]._run.tree_run
    phases = [{"rows": rows, "passes": passes} for rows, passes in zip(run.decode_phases, run.phase_passes)]
    phase_rows = sum(p["rows"] * p["passes"] for p in phases)
    tail = [p for p in phases if p["rows"] < 0.9 * branches]
    return {"workload": kind, "branches": branches, "width": width, "programs": len(inputs), "arriving": arriving,
            "arrival_batches": batch.ARRIVAL_BATCHES if arriving else None,
            "replan_fraction": scheduler.REPLAN_FRACTION, "kv_budget_bytes": kv_budget_bytes, "tokens": total, "forward_passes": run.forward_passes,
            "ideal_passes": round(total / branches), "mixed_steps": run.mixed_steps, "decode_phases": len(phases),
            "tail_passes": sum(p["passes"] for p in tail), "tail_rows_at_most": max((p["rows"] for p in tail), default=0),
            "phase_rows": phase_rows, "row_occupancy": total / max(1, phase_rows),
            "phases": phases, "cpu_seconds": elapsed,
            # the engine's host time by part (on this CPU; the model's own time is in none of them)
            "host_seconds": {k: round(v, 3) for k, v in run.host_seconds.items()},
            "schedule_calls": run.schedule_calls,
            "offload": run.offload_stats, "memory_waits": run.scheduler.memory_waits,
            # pool compactions (memory short and fragmented) and the written slots they moved
            "kv_compactions": run.kv.compactions, "kv_slots_moved": run.kv.slots_moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["rounds", "rounds-equal", "tot"], default="tot")
    parser.add_argument("--branches", type=int, default=256)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--oversubscribe", type=int, default=3)
    parser.add_argument("--replan-fraction", type=float, default=None)
    parser.add_argument("--variant", choices=list(VARIANTS), default="default",
                        help="the engine with one choice undone (fifo: arrival order, as before priorities)")
    parser.add_argument("--kv-budget-mb", type=float, default=None,
                        help="the engine's KV budget (default: no limit); Llama-3-8B's at 1,024 branches on an H100 "
                             "is about 110 MB of this model's KV (the same tokens)")
    parser.add_argument("--arriving", type=int, default=None, metavar="BATCHES",
                        help="the inputs as an iterator drawn as the run goes, programs started while fewer than "
                             "BATCHES x max_batch branches decode or wait (treegen.lang.batch.ARRIVAL_BATCHES)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.arriving is not None:
        if args.arriving < 1:
            parser.error(f"--arriving must be at least 1, got {args.arriving}")
        batch.ARRIVAL_BATCHES = args.arriving
    if args.replan_fraction is not None:
        if not 0 < args.replan_fraction <= 1:
            parser.error(f"--replan-fraction must be in (0, 1], got {args.replan_fraction}")
        scheduler.REPLAN_FRACTION = decode.REPLAN_FRACTION = args.replan_fraction
    with VARIANTS[args.variant]():
        row = replay(args.workload, args.branches, args.width, args.oversubscribe,
                     None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20), args.arriving is not None)
    row["variant"] = args.variant
    print({k: v for k, v in row.items() if k != "phases"})
    print("phases (rows x passes):", [(p["rows"], p["passes"]) for p in row["phases"]])
    out = Path(args.out or Path(__file__).parent / "results" /
               f"dynamic_schedule_cpu_{args.workload}_{args.branches}"
               f"{'' if args.variant == 'default' else '_' + args.variant}"
               f"{'' if args.kv_budget_mb is None else f'_budget_{args.kv_budget_mb:g}mb'}"
               f"{'' if args.arriving is None else f'_arriving_{args.arriving}'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "dynamic_schedule_cpu", "device": "cpu", "model": "random Llama, 1 layer, hidden 64",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "rows": [row]}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
